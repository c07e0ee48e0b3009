"""jetrl.kernels.quantize_dual against its reference (jetrl.quant.quantize_1x128 and quantize_128x1).

CPU (Triton interpreter, subprocess): both scale tensors bitwise in both layouts; both sets of clamped
pre-cast fp32 values (written by the kernel to test-only buffers, ``[M, K]`` and ``[K, M]``) bitwise
via the e4m3 bytes ml_dtypes' correct cast makes of them; the launch options give the same outputs.
NOT checked on CPU: the kernel's ``.to(tl.float8e4nv)`` instructions (the interpreter's fp8 cast is
wrong for a few % of values, NUMERICS.md section 3); the bytes themselves are checked on the GPU.
GPU (sm_90): bytes and scales bitwise, both layouts, every launch option.
"""

from __future__ import annotations

import pytest
import torch
from kernels_cases import (
    DTYPES,
    GPU_SHAPES,
    INTERP_SHAPES,
    KINDS,
    assert_bitwise,
    e4m3_bytes_of,
    make_input,
    run_interpreted,
)

import jetrl.kernels as K
from jetrl import quant
from jetrl.gemm.base import is_scale_layout
from jetrl.testing.numerics import has_sm90

LAYOUTS = ("row", "deepgemm")
# options tried against the launcher's defaults (each must give the default's outputs)
OPTIONS = [
    {"k_fastest": True},
    {"chunk_m": 128, "chunk_k": 128},
    {"chunk_m": 16, "chunk_k": 32, "num_warps": 8},
    {"rcp": False},
]


def _reference(x: torch.Tensor, layout: str):
    q, s = quant.quantize_1x128(x.cpu())
    q_t, s_t = quant.quantize_128x1(x.cpu())
    return q, s, q_t, s_t


def _check(out, x, layout: str, ctx: str, bytes_of=None) -> None:
    """`out` = (q, s, q_t, s_t) against the reference; `bytes_of` (interpreter) rebuilds the two byte
    tensors from the pre-cast buffers."""
    q, s, q_t, s_t = out
    rq, rs, rq_t, rs_t = _reference(x, layout)
    assert is_scale_layout(s, layout) and is_scale_layout(s_t, layout), f"scale strides {s.stride()} {s_t.stride()}"
    if bytes_of is not None:
        q, q_t = bytes_of
    assert_bitwise("bytes", q, rq, ctx)
    assert_bitwise("scales", s, rs, ctx)
    assert_bitwise("bytes_t", q_t, rq_t, ctx)
    assert_bitwise("scales_t", s_t, rs_t, ctx)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_cpu_public_api_is_reference(layout):
    x = make_input(130, 300, torch.bfloat16, "wide-range")
    _check(K.quantize_dual(x, scale_layout=layout, name="t.x"), x, layout, layout)
    _check(K.torch_quantize_dual(x, scale_layout=layout), x, layout, layout)


def test_cpu_rejects_bad_input():
    x = torch.randn(4, 256)
    x[1, 200] = float("nan")
    with pytest.raises(quant.NonFiniteError, match="layers.0.self_attn.o_proj:grad_output"):
        K.quantize_dual(x, name="layers.0.self_attn.o_proj:grad_output")
    with pytest.raises(ValueError, match="scale_layout='col'"):
        K.quantize_dual(torch.randn(4, 256), scale_layout="col")
    with pytest.raises(ValueError, match="must be 2-D"):
        K.quantize_dual(torch.randn(256))
    with pytest.raises(TypeError, match="dtype torch.int32"):
        K.quantize_dual(torch.zeros(4, 256, dtype=torch.int32))


def test_fake_impl_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, s, q_t, s_t = K.quantize_dual(torch.empty(300, 129, dtype=torch.bfloat16), scale_layout="deepgemm")
    assert [tuple(t.shape) for t in (q, s, q_t, s_t)] == [(300, 129), (300, 2), (129, 300), (129, 3)]
    assert q.dtype == q_t.dtype == torch.float8_e4m3fn and s.dtype == s_t.dtype == torch.float32
    assert is_scale_layout(s, "deepgemm") and is_scale_layout(s_t, "deepgemm")


_INTERP = [(m, k, d, kind) for (m, k) in INTERP_SHAPES for d in DTYPES for kind in KINDS]
_INTERP_OPTS = [(i, 130, 257) for i in range(len(OPTIONS))]


def _layout(case: int) -> str:
    return LAYOUTS[case % 2]


@pytest.fixture(scope="module")
def interp_results():
    calls = []
    for i, (m, k, d, kind) in enumerate(_INTERP):
        x = make_input(m, k, DTYPES[d], kind, seed=m + k)
        pre = (torch.empty(m, k), torch.empty(k, m))
        calls.append(("quantize_dual", "launch_quantize_dual", (x, _layout(i), "t.x", pre), {}))
    for i, m, k in _INTERP_OPTS:
        x = make_input(m, k, torch.bfloat16, "wide-range", seed=m + k)
        pre = (torch.empty(m, k), torch.empty(k, m))
        calls.append(("quantize_dual", "launch_quantize_dual", (x, "deepgemm", "t.x", pre), OPTIONS[i]))
    bad = torch.randn(200, 130)
    bad[150, 129] = float("inf")
    calls.append(("quantize_dual", "launch_quantize_dual", (bad, "row", "layers.4.mlp.up_proj:grad_output"), {}))
    return run_interpreted(calls)


def _check_interpreted(r, ctx: str) -> None:
    x, layout, _, (pre, pre_t) = r["args"]
    assert r["nonfinite"] is None, ctx
    fp8 = [e4m3_bytes_of(p).view(torch.float8_e4m3fn) for p in (pre, pre_t)]
    _check(r["out"], x, layout, ctx, bytes_of=fp8)


@pytest.mark.parametrize("case", range(len(_INTERP)), ids=[f"M{m}-K{k}-{d}-{kd}" for m, k, d, kd in _INTERP])
def test_interpreter_scales_and_precast(interp_results, case):
    m, k, d, kind = _INTERP[case]
    _check_interpreted(interp_results[case], f"{m=} {k=} {d} {kind} {_layout(case)}")


@pytest.mark.parametrize("case", range(len(_INTERP_OPTS)), ids=[f"{OPTIONS[i]}-M{m}-K{k}" for i, m, k in _INTERP_OPTS])
def test_interpreter_launch_options(interp_results, case):
    i, m, k = _INTERP_OPTS[case]
    _check_interpreted(interp_results[len(_INTERP) + case], f"{OPTIONS[i]} {m=} {k=}")


def test_interpreter_nonfinite_flag_names_op_and_tensor(interp_results):
    msg = interp_results[-1]["nonfinite"]
    assert msg is not None and "jetrl::quantize_dual" in msg and "layers.4.mlp.up_proj:grad_output" in msg, msg


gpu = pytest.mark.skipif(not has_sm90(), reason="needs an sm_90 GPU to run the compiled Triton kernel")


@gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("m,k", GPU_SHAPES)
def test_gpu_bitwise(m, k, kind):
    for d, dtype in DTYPES.items():
        x = make_input(m, k, dtype, kind, seed=m * 7 + k, device="cuda")
        for layout in LAYOUTS:
            _check(K.quantize_dual(x, scale_layout=layout), x, layout, f"{m=} {k=} {d} {kind} {layout}")
    K.check_nonfinite()


@gpu
@pytest.mark.parametrize("opts", OPTIONS, ids=str)
@pytest.mark.parametrize("m,k", [(4095, 5120), (257, 14336), (13, 200), (129, 1000)])
def test_gpu_launch_options(m, k, opts):
    from jetrl.kernels.quantize_dual import launch_quantize_dual

    x = make_input(m, k, torch.bfloat16, "wide-range", seed=m + k, device="cuda")
    _check(launch_quantize_dual(x, "deepgemm", "t.x", **opts), x, "deepgemm", f"{opts} {m=} {k=}")
    K.check_nonfinite()


@gpu
def test_gpu_nonfinite_flag():
    K.reset_nonfinite()
    x = torch.randn(300, 256, device="cuda", dtype=torch.bfloat16)
    x[299, 3] = float("nan")
    K.quantize_dual(x, name="layers.5.mlp.down_proj:grad_output")
    with pytest.raises(quant.NonFiniteError, match=r"jetrl::quantize_dual on layers\.5\.mlp\.down_proj:grad_output"):
        K.check_nonfinite()
