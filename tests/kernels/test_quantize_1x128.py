"""jetrl.kernels.quantize_1x128 against its reference (jetrl.quant.quantize_1x128).

CPU (Triton interpreter, subprocess): scales are compared bit for bit, and so are the clamped
pre-cast fp32 values ``clamp(x / s)`` (the kernel writes them to a test-only buffer) via the e4m3
bytes a correct cast (ml_dtypes) makes of them. NOT checked on CPU: the kernel's own
``.to(tl.float8e4nv)`` instruction — the interpreter's fp8 cast is wrong for a few % of values
(NUMERICS.md section 3) — so its e4m3 output bytes are only checked on the GPU.
GPU (sm_90): e4m3 bytes and scales bitwise equal to the reference, both scale layouts.
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
from jetrl.testing.numerics import has_sm90

LAYOUTS = ("row", "deepgemm")


def _want_strides(m: int, g: int, layout: str) -> tuple[int, int]:
    return (g, 1) if layout == "row" else (1, -(-m // 4) * 4)


# ---------------------------------------------------------------- CPU: public API = reference


@pytest.mark.parametrize("layout", LAYOUTS)
def test_cpu_public_api_is_reference(layout):
    x = make_input(13, 300, torch.bfloat16, "wide-range")
    q, s = K.quantize_1x128(x, scale_layout=layout, name="t.x")
    q_ref, s_ref = quant.quantize_1x128(x)
    assert_bitwise("q", q, q_ref)
    assert_bitwise("s", s, s_ref)
    assert s.stride() == _want_strides(13, 3, layout)
    qo, so = torch.ops.jetrl.quantize_1x128(x, layout, "t.x")
    assert_bitwise("op q", qo, q_ref)
    assert_bitwise("op s", so, s_ref)


def test_cpu_rejects_bad_input():
    x = torch.randn(4, 256)
    x[2, 7] = float("nan")
    with pytest.raises(quant.NonFiniteError, match="layer3.mlp:input"):
        K.quantize_1x128(x, name="layer3.mlp:input")
    with pytest.raises(ValueError, match="scale_layout"):
        K.quantize_1x128(torch.randn(4, 256), scale_layout="col")
    with pytest.raises(ValueError, match="2-D"):
        K.quantize_1x128(torch.randn(2, 4, 256))
    with pytest.raises(TypeError, match="dtype"):
        K.quantize_1x128(torch.randn(4, 256).to(torch.float64))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fake_impl_shapes_and_strides(layout):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, s = K.quantize_1x128(torch.empty(13, 300, dtype=torch.bfloat16), scale_layout=layout)
    assert q.dtype == torch.float8_e4m3fn and tuple(q.shape) == (13, 300)
    assert tuple(s.shape) == (13, 3) and s.stride() == _want_strides(13, 3, layout)


# ---------------------------------------------------------------- CPU: Triton interpreter

_INTERP = [(m, k, d, kind, lay) for (m, k) in INTERP_SHAPES for d in DTYPES for kind in KINDS for lay in LAYOUTS]


@pytest.fixture(scope="module")
def interp_results():
    calls = []
    for m, k, d, kind, lay in _INTERP:
        x = make_input(m, k, DTYPES[d], kind, seed=m + k)
        calls.append(("quantize_1x128", "launch_quantize_1x128", (x, lay, "t.x", torch.empty(m, k)), {}))
    bad = torch.randn(5, 200)
    bad[3, 150] = float("inf")
    calls.append(("quantize_1x128", "launch_quantize_1x128", (bad, "row", "model.layers.0.mlp:input"), {}))
    return run_interpreted(calls)


@pytest.mark.parametrize("case", range(len(_INTERP)), ids=[f"M{m}-K{k}-{d}-{kd}-{ly}" for m, k, d, kd, ly in _INTERP])
def test_interpreter_scales_and_precast(interp_results, case):
    m, k, d, kind, lay = _INTERP[case]
    r = interp_results[case]
    x, _, _, pre = r["args"]
    q, s = r["out"]
    q_ref, s_ref = quant.quantize_1x128(x)
    ctx = f"{m=} {k=} {d} {kind} {lay}"
    assert r["nonfinite"] is None
    assert s.stride() == _want_strides(m, s.shape[1], lay), ctx
    assert_bitwise("scales", s, s_ref, ctx)
    assert_bitwise("bytes(ml_dtypes cast of pre-cast)", e4m3_bytes_of(pre), q_ref.view(torch.uint8), ctx)
    assert q.shape == q_ref.shape and q.dtype == torch.float8_e4m3fn


def test_interpreter_nonfinite_flag_names_op_and_tensor(interp_results):
    msg = interp_results[-1]["nonfinite"]
    assert msg is not None and "jetrl::quantize_1x128" in msg and "model.layers.0.mlp:input" in msg, msg
    assert all(r["nonfinite"] is None for r in interp_results[:-1])


# ---------------------------------------------------------------- GPU: bitwise on sm_90

gpu = pytest.mark.skipif(not has_sm90(), reason="needs an sm_90 GPU to run the compiled Triton kernel")


@gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("m,k", GPU_SHAPES)
def test_gpu_bitwise(m, k, kind):
    for d, dtype in DTYPES.items():
        x = make_input(m, k, dtype, kind, seed=m * 7 + k, device="cuda")
        q_ref, s_ref = quant.quantize_1x128(x)
        for lay in LAYOUTS:
            q, s = K.quantize_1x128(x, scale_layout=lay)
            ctx = f"{m=} {k=} {d} {kind} {lay}"
            assert s.stride() == _want_strides(m, s.shape[1], lay), ctx
            assert_bitwise("bytes", q, q_ref, ctx)
            assert_bitwise("scales", s, s_ref, ctx)
    K.check_nonfinite()


@gpu
def test_gpu_nonfinite_flag():
    K.reset_nonfinite()
    x = torch.randn(300, 512, device="cuda", dtype=torch.bfloat16)
    K.quantize_1x128(x, name="ok")
    K.check_nonfinite()
    x[299, 511] = float("nan")
    K.quantize_1x128(x, name="model.layers.7.mlp.down_proj:input")
    with pytest.raises(quant.NonFiniteError, match=r"jetrl::quantize_1x128 on model\.layers\.7\.mlp\.down_proj:input"):
        K.check_nonfinite()
    K.check_nonfinite()  # cleared
