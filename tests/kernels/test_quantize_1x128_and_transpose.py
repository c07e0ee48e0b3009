"""jetrl.kernels.quantize_1x128_and_transpose against its reference (quantize_1x128 and
transpose_quantize of the same dY, i.e. jetrl.quant.quantize_1x128 and quantize_128x1).

CPU (Triton interpreter, subprocess): both scale tensors bitwise, and both sets of clamped pre-cast
fp32 values (test-only buffers) bitwise via the e4m3 bytes ml_dtypes' correct cast makes of them.
NOT checked on CPU: the kernel's ``.to(tl.float8e4nv)`` instructions (the interpreter's fp8 cast is
wrong for a few % of values, NUMERICS.md section 3); the bytes are checked on the GPU.
GPU (sm_90): q, s, q_t, s_t bitwise equal to the reference, both scale layouts.
"""

from __future__ import annotations

import importlib

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
from jetrl.testing.numerics import has_sm90

tq = importlib.import_module("jetrl.kernels.transpose_quantize")


def _strides(m: int, g: int, layout: str) -> tuple[int, int]:
    return (g, 1) if layout == "row" else (1, -(-m // 4) * 4)


@pytest.mark.parametrize("layout", ("row", "deepgemm"))
def test_cpu_public_api_is_reference(layout):
    x = make_input(130, 300, torch.bfloat16, "wide-range")
    q, s, q_t, s_t = K.quantize_1x128_and_transpose(x, scale_layout=layout, name="t.dy")
    q_ref, s_ref = quant.quantize_1x128(x)
    qt_ref, st_ref = quant.quantize_128x1(x)
    for n, got, want in (("q", q, q_ref), ("s", s, s_ref), ("q_t", q_t, qt_ref), ("s_t", s_t, st_ref)):
        assert_bitwise(n, got, want)
    assert s.stride() == _strides(130, 3, layout)
    outs = torch.ops.jetrl.quantize_1x128_and_transpose(x, layout, "t.dy")
    assert_bitwise("op q_t", outs[2], qt_ref)


def test_cpu_rejects_bad_input():
    x = torch.randn(4, 256)
    x[3, 255] = float("inf")
    with pytest.raises(quant.NonFiniteError, match="layers.4.mlp.down_proj:grad_output"):
        K.quantize_1x128_and_transpose(x, name="layers.4.mlp.down_proj:grad_output")
    with pytest.raises(ValueError, match="scale_layout"):
        K.quantize_1x128_and_transpose(torch.randn(4, 256), scale_layout="col")


def test_fake_impl_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, s, q_t, s_t = K.quantize_1x128_and_transpose(torch.empty(300, 129, dtype=torch.bfloat16))
    assert [tuple(t.shape) for t in (q, s, q_t, s_t)] == [(300, 129), (300, 2), (129, 300), (129, 3)]
    assert s.stride() == _strides(300, 2, "deepgemm") and q_t.dtype == torch.float8_e4m3fn


# every dtype and kind on the small shapes; non-default tiles on a shape with partial token groups
_INTERP = [(m, k, d, kind, {}) for (m, k) in INTERP_SHAPES for d in DTYPES for kind in KINDS] + [
    (300, 129, "bf16", "wide-range", cfg) for cfg in tq.DUAL_SWEEP_CONFIGS
]


@pytest.fixture(scope="module")
def interp_results():
    calls = []
    for i, (m, k, d, kind, cfg) in enumerate(_INTERP):
        x = make_input(m, k, DTYPES[d], kind, seed=m + k)
        lay = ("row", "deepgemm")[i % 2]
        args = (x, lay, "t.dy", torch.empty(m, k), torch.empty(k, m))
        calls.append(("transpose_quantize", "launch_quantize_1x128_and_transpose", args, cfg))
    bad = torch.randn(200, 5)
    bad[150, 3] = float("nan")
    calls.append(("transpose_quantize", "launch_quantize_1x128_and_transpose", (bad, "row", "layers.2.o_proj:dy"), {}))
    return run_interpreted(calls)


@pytest.mark.parametrize(
    "case", range(len(_INTERP)), ids=[f"M{m}-K{k}-{d}-{kd}-{c or 'default'}" for m, k, d, kd, c in _INTERP]
)
def test_interpreter_scales_and_precast(interp_results, case):
    m, k, d, kind, cfg = _INTERP[case]
    r = interp_results[case]
    x, lay, _, pre, pre_t = r["args"]
    q, s, q_t, s_t = r["out"]
    ctx = f"{m=} {k=} {d} {kind} {lay} {cfg}"
    assert r["nonfinite"] is None
    q_ref, s_ref = quant.quantize_1x128(x)
    qt_ref, st_ref = quant.quantize_128x1(x)
    assert s.stride() == _strides(m, s.shape[1], lay), ctx
    assert_bitwise("scales", s, s_ref, ctx)
    assert_bitwise("scales_t", s_t, st_ref, ctx)
    assert_bitwise("bytes(ml_dtypes cast of pre-cast)", e4m3_bytes_of(pre), q_ref.view(torch.uint8), ctx)
    assert_bitwise("bytes_t(ml_dtypes cast of pre-cast)", e4m3_bytes_of(pre_t), qt_ref.view(torch.uint8), ctx)
    assert q.shape == (m, k) and q_t.shape == (k, m)


def test_interpreter_nonfinite_flag_names_op_and_tensor(interp_results):
    msg = interp_results[-1]["nonfinite"]
    assert msg is not None and "jetrl::quantize_1x128_and_transpose" in msg and "layers.2.o_proj:dy" in msg, msg


gpu = pytest.mark.skipif(not has_sm90(), reason="needs an sm_90 GPU to run the compiled Triton kernel")


@gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("m,k", GPU_SHAPES)
def test_gpu_bitwise(m, k, kind):
    for d, dtype in DTYPES.items():
        x = make_input(m, k, dtype, kind, seed=m * 5 + k, device="cuda")
        q_ref, s_ref = quant.quantize_1x128(x)
        qt_ref, st_ref = quant.quantize_128x1(x)
        for lay in ("row", "deepgemm"):
            for cfg in [{}] + ([] if lay == "row" else tq.DUAL_SWEEP_CONFIGS):
                q, s, q_t, s_t = tq.launch_quantize_1x128_and_transpose(x, lay, "dy", **cfg)
                ctx = f"{m=} {k=} {d} {kind} {lay} {cfg}"
                assert s.stride() == _strides(m, s.shape[1], lay), ctx
                assert_bitwise("bytes", q, q_ref, ctx)
                assert_bitwise("scales", s, s_ref, ctx)
                assert_bitwise("bytes_t", q_t, qt_ref, ctx)
                assert_bitwise("scales_t", s_t, st_ref, ctx)
    K.check_nonfinite()


@gpu
def test_gpu_nonfinite_flag():
    K.reset_nonfinite()
    x = torch.randn(300, 512, device="cuda", dtype=torch.bfloat16)
    x[299, 0] = float("-inf")
    K.quantize_1x128_and_transpose(x, name="layers.5.mlp.up_proj:grad_output")
    with pytest.raises(
        quant.NonFiniteError, match=r"jetrl::quantize_1x128_and_transpose on layers\.5\.mlp\.up_proj:grad_output"
    ):
        K.check_nonfinite()
