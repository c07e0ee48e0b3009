"""jetrl.kernels.rmsnorm_quant / rmsnorm_backward.

Contracts: (q, s) are BITWISE quantize_1x128 of the kernel's own y; y and rstd match the eager HF
numerics within dtype-paired tolerances (the fp32 variance reduction order and the rsqrt
implementation differ between Triton and torch); the backward matches its fp32 reference within
tolerances, and that reference matches float64 autograd of the HF forward.

CPU (Triton interpreter, subprocess): scales bitwise and the clamped pre-cast values bitwise via the
bytes ml_dtypes' correct cast makes of them; y bitwise for fp32/fp16 against the HF formula applied
with the kernel's rstd. NOT checked on CPU: the kernel's ``.to(tl.float8e4nv)`` (wrong for a few %
of values in the interpreter, NUMERICS.md section 3), and bf16 rounding: the interpreter's
fp32 -> bf16 cast truncates instead of rounding to nearest even, so bf16 y and bf16 gradients are
only checked within 1-2 ulp on CPU. On the GPU (sm_90) all of it runs compiled.
"""

from __future__ import annotations

import pytest
import torch
from kernels_cases import (
    DTYPES,
    GPU_SHAPES,
    INTERP_SHAPES,
    ULP,
    assert_bitwise,
    assert_close_ulps,
    e4m3_bytes_of,
    make_input,
    run_interpreted,
)

import jetrl.kernels as K
from jetrl import quant
from jetrl.testing.numerics import has_sm90

EPS = 1e-6
KINDS = ("randn", "zero-group")  # a zero group; whole zero rows come from the zero column block


def _weight(k: int, dtype: torch.dtype, device="cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(k)
    return (1.0 + 0.2 * torch.randn(k, generator=g)).to(dtype).to(device)


def _check_backward(dx, dw, dx_ref, dw_ref, args, ulps: float, ctx: str) -> None:
    """Gradients within `ulps` of their dtype, plus an absolute floor proportional to the magnitudes
    being reduced (the fp32 reduction order differs; dx and dweight both come from cancelling sums)."""
    dy, x, _, rstd = args
    rt = max(ulps * ULP[dx.dtype], 2.0**-16)
    torch.testing.assert_close(
        dx.float(),
        dx_ref.float(),
        rtol=rt,
        atol=2.0**-16 * float(dx_ref.float().abs().max()),
        msg=lambda m_: f"dx {ctx}: {m_}",
    )
    abs_sum = (dy.float().abs() * (x.float() * rstd[:, None]).abs()).sum(0)
    tol = (2 * ulps * ULP[dw.dtype] + 2.0**-20) * abs_sum + rt * dw_ref.float().abs()
    err = (dw.float() - dw_ref.float()).abs()
    assert bool((err <= tol).all()), (
        f"dw {ctx}: max err {float(err.max()):.3e}, worst err/tol {float((err / tol).max()):.2f}"
    )


def _hf_rmsnorm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    mod = Qwen3RMSNorm(x.shape[-1], eps=EPS).to(device=x.device, dtype=w.dtype)
    with torch.no_grad():
        mod.weight.copy_(w)
        return mod(x)


@pytest.mark.parametrize("d", ["bf16", "fp32"])
def test_reference_is_hf_qwen3_rmsnorm(d):
    x = make_input(13, 300, DTYPES[d], "randn")
    w = _weight(300, DTYPES[d])
    y, q, s, rstd = K.rmsnorm_quant(x, w, EPS, name="t.x")
    assert_bitwise("y vs HF Qwen3RMSNorm", y.float(), _hf_rmsnorm(x, w).float())
    q_ref, s_ref = quant.quantize_1x128(y)
    assert_bitwise("q", q, q_ref)
    assert_bitwise("s", s, s_ref)
    assert rstd.shape == (13,) and rstd.dtype == torch.float32


def test_reference_backward_matches_float64_autograd():
    x = make_input(13, 300, torch.float32, "randn")
    w = _weight(300, torch.float32)
    dy = make_input(13, 300, torch.float32, "randn", seed=5)
    _, _, _, rstd = K.rmsnorm_quant(x, w, EPS)
    dx, dw = K.rmsnorm_backward(dy, x, w, rstd)
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    y64 = w64 * (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS))
    y64.backward(dy.double())
    torch.testing.assert_close(dx.double(), x64.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dw.double(), w64.grad, rtol=1e-5, atol=1e-5)


def test_autograd_routes_to_backward_op():
    x = make_input(5, 256, torch.float32, "randn").requires_grad_()
    w = _weight(256, torch.float32).requires_grad_()
    y, q, s, rstd = K.rmsnorm_quant(x, w, EPS)
    dy = torch.randn_like(y)
    y.backward(dy)
    dx, dw = K.rmsnorm_backward(dy, x.detach(), w.detach(), rstd)
    assert_bitwise("dx", x.grad, dx)
    assert_bitwise("dw", w.grad, dw)


def test_cpu_rejects_bad_input():
    x = torch.randn(4, 256)
    x[1, 3] = float("inf")
    with pytest.raises(quant.NonFiniteError, match="layers.0.post_attention_layernorm"):
        K.rmsnorm_quant(x, torch.ones(256), EPS, name="layers.0.post_attention_layernorm")
    with pytest.raises(ValueError, match="weight"):
        K.rmsnorm_quant(torch.randn(4, 256), torch.ones(255), EPS)
    with pytest.raises(ValueError, match="rstd"):
        K.rmsnorm_backward(torch.randn(4, 256), torch.randn(4, 256), torch.ones(256), torch.ones(3))
    from jetrl.kernels.rmsnorm_quant import launch_rmsnorm_quant

    with pytest.raises(AssertionError, match=r"unknown launch options \['blockm'\]"):  # a typo is not ignored
        launch_rmsnorm_quant(torch.randn(4, 256), torch.ones(256), EPS, blockm=64)


def test_fake_impl_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        y, q, s, rstd = K.rmsnorm_quant(torch.empty(13, 300, dtype=torch.bfloat16), torch.empty(300), EPS)
    assert [tuple(t.shape) for t in (y, q, s, rstd)] == [(13, 300), (13, 300), (13, 3), (13,)]
    assert y.dtype == torch.bfloat16 and q.dtype == torch.float8_e4m3fn


# (2, 5000): K > 4096 takes the two-pass chunked path
_INTERP = [(m, k, d, kind) for (m, k) in INTERP_SHAPES + [(3, 1000), (2, 5000)] for d in DTYPES for kind in KINDS]


@pytest.fixture(scope="module")
def interp_results():
    calls = []
    for m, k, d, kind in _INTERP:
        x = make_input(m, k, DTYPES[d], kind, seed=m + k)
        w = _weight(k, DTYPES[d])
        layout = "deepgemm" if kind == "randn" else "row"
        calls.append(("rmsnorm_quant", "launch_rmsnorm_quant", (x, w, EPS, layout, "t.x", torch.empty(m, k)), {}))
        dy = make_input(m, k, DTYPES[d], "randn", seed=7)
        rstd = K.torch_rmsnorm_quant(x, w, EPS)[3]
        calls.append(("rmsnorm_quant", "launch_rmsnorm_backward", (dy, x, w, rstd), {"num_programs": 3}))
    for m, k, d in _INTERP_ADD:
        x, r = _add_operands(m, k, DTYPES[d])
        w = _weight(k, DTYPES[d])
        calls.append(("rmsnorm_quant", "launch_add_rmsnorm_quant", (x, r, w, EPS, "deepgemm", "t.x"), {}))
        calls.append(("rmsnorm_quant", "launch_rmsnorm_quant", (r + x, w, EPS, "deepgemm", "t.x"), {}))
    bad = torch.randn(3, 300)
    bad[2, 299] = float("nan")
    calls.append(
        ("rmsnorm_quant", "launch_rmsnorm_quant", (bad, torch.ones(300), EPS, "row", "layers.9.input_layernorm"), {})
    )
    return run_interpreted(calls)


# residual + x then the norm in one kernel: the register path and the chunked one (K > 4096), each dtype
_INTERP_ADD = [(m, k, d) for (m, k) in [(13, 300), (2, 5000)] for d in DTYPES]


def _add_operands(m: int, k: int, dtype: torch.dtype, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(x, residual): x a column slice of a wider buffer (a row stride of its own, as vLLM's outputs can have),
    the residual larger, so the bf16 sums round (and tie) often."""
    x = make_input(m, k + 64, dtype, "randn", seed=m * k, device=device)[:, 32 : 32 + k]
    r = (8 * make_input(m, k, dtype, "randn", seed=m + k + 1)).to(device)
    return x, r


@pytest.mark.parametrize("case", range(len(_INTERP)), ids=[f"M{m}-K{k}-{d}-{kd}" for m, k, d, kd in _INTERP])
def test_interpreter_forward(interp_results, case):
    m, k, d, kind = _INTERP[case]
    ctx = f"{m=} {k=} {d} {kind}"
    r = interp_results[2 * case]
    x, w, _, _, _, pre = r["args"]
    y, q, s, rstd = r["out"]
    assert r["nonfinite"] is None
    _, _, _, rstd_ref = K.torch_rmsnorm_quant(x, w, EPS)
    torch.testing.assert_close(rstd, rstd_ref, rtol=4e-7, atol=0, msg=lambda m_: f"rstd {ctx}: {m_}")
    # y from the kernel's own rstd with the HF formula
    y_want = (w * (x.float() * rstd[:, None]).to(x.dtype)).to(x.dtype)
    if x.dtype == torch.bfloat16:
        assert_close_ulps("y (bf16: interpreter truncates)", y, y_want, 2.0, ctx)
    else:
        assert_bitwise("y", y.float(), y_want.float(), ctx)
    q_ref, s_ref = quant.quantize_1x128(y)
    assert_bitwise("scales", s, s_ref, ctx)
    assert_bitwise("bytes(ml_dtypes cast of pre-cast)", e4m3_bytes_of(pre), q_ref.view(torch.uint8), ctx)


@pytest.mark.parametrize("case", range(len(_INTERP)), ids=[f"M{m}-K{k}-{d}-{kd}" for m, k, d, kd in _INTERP])
def test_interpreter_backward(interp_results, case):
    m, k, d, kind = _INTERP[case]
    r = interp_results[2 * case + 1]
    dx, dw = r["out"]
    dx_ref, dw_ref = K.torch_rmsnorm_backward(*r["args"])
    _check_backward(dx, dw, dx_ref, dw_ref, r["args"], 2.0, f"{m=} {k=} {d} {kind}")


@pytest.mark.parametrize("case", range(len(_INTERP_ADD)), ids=[f"M{m}-K{k}-{d}" for m, k, d in _INTERP_ADD])
def test_interpreter_add_is_rmsnorm_quant_of_the_torch_sum(interp_results, case):
    """The fused add writes eager torch's ``residual + x`` bit for bit (bf16 too: it rounds through the fp32
    bits, so the interpreter's truncating cast does not reach it), and its y / q / s are `rmsnorm_quant`'s of
    that sum, bit for bit (the same interpreter computed both)."""
    m, k, d = _INTERP_ADD[case]
    fused = interp_results[2 * len(_INTERP) + 2 * case]
    plain = interp_results[2 * len(_INTERP) + 2 * case + 1]
    x, r = fused["args"][:2]
    y, q, s, total = fused["out"]
    ctx = f"{m=} {k=} {d}"
    assert fused["nonfinite"] is None
    assert_bitwise("residual + x", total, r + x, ctx)
    for what, got, want in zip(("y", "q", "s"), (y, q, s), plain["out"][:3], strict=True):
        assert_bitwise(what, got, want, ctx)
    assert s.stride() == plain["out"][2].stride()


def test_add_rmsnorm_quant_reference_and_errors():
    x, r = _add_operands(13, 300, torch.bfloat16)
    w = _weight(300, torch.bfloat16)
    y, q, s, total = K.add_rmsnorm_quant(x, r, w, EPS, name="layers.1.input_layernorm")
    assert_bitwise("total", total, r + x)
    for what, got, want in zip(("y", "q", "s"), (y, q, s), K.rmsnorm_quant(r + x, w, EPS)[:3], strict=True):
        assert_bitwise(what, got, want)
    with pytest.raises(ValueError, match=r"jetrl::add_rmsnorm_quant: residual torch.bfloat16 \(13, 299\)"):
        K.add_rmsnorm_quant(x, r[:, :299], w, EPS, name="layers.1.input_layernorm")
    r[4, 7] = float("inf")
    with pytest.raises(quant.NonFiniteError, match="layers.1.input_layernorm"):
        K.add_rmsnorm_quant(x, r, w, EPS, name="layers.1.input_layernorm")
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        e = torch.empty(13, 300, dtype=torch.bfloat16)
        out = K.add_rmsnorm_quant(e, e, torch.empty(300), EPS, scale_layout="deepgemm")
    assert [tuple(t.shape) for t in out] == [(13, 300), (13, 300), (13, 3), (13, 300)]


def test_interpreter_nonfinite_flag_names_op_and_tensor(interp_results):
    msg = interp_results[-1]["nonfinite"]
    assert msg is not None and "jetrl::rmsnorm_quant" in msg and "layers.9.input_layernorm" in msg, msg


gpu = pytest.mark.skipif(not has_sm90(), reason="needs an sm_90 GPU to run the compiled Triton kernel")


@gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("m,k", GPU_SHAPES)
def test_gpu(m, k, kind):
    for d, dtype in DTYPES.items():
        ctx = f"{m=} {k=} {d} {kind}"
        x = make_input(m, k, dtype, kind, seed=m + 3 * k, device="cuda")
        w = _weight(k, dtype, "cuda")
        y_ref, _, _, rstd_ref = K.torch_rmsnorm_quant(x, w, EPS)
        for layout in ("row", "deepgemm"):
            y, q, s, rstd = K.rmsnorm_quant(x, w, EPS, scale_layout=layout)
            q_ref, s_ref = quant.quantize_1x128(y)
            assert_bitwise("bytes", q, q_ref, f"{ctx} {layout}")
            assert_bitwise("scales", s, s_ref, f"{ctx} {layout}")
        # a 1-ulp rstd difference moves n = (x * rstd).to(dtype) by 1 ulp, which weight * n can
        # turn into 2-3 ulp of y; fp32 y moves with rstd directly
        assert_close_ulps("y", y, y_ref, 8.0 if d == "fp32" else 3.0, ctx)
        torch.testing.assert_close(rstd, rstd_ref, rtol=1e-6, atol=0, msg=lambda m_, c=ctx: f"rstd {c}: {m_}")
        dy = make_input(m, k, dtype, "randn", seed=11, device="cuda")
        dx, dw = K.rmsnorm_backward(dy, x, w, rstd)
        dx_ref, dw_ref = K.torch_rmsnorm_backward(dy, x, w, rstd)
        _check_backward(dx, dw, dx_ref, dw_ref, (dy, x, w, rstd), 1.0, ctx)
    K.check_nonfinite()


@gpu
@pytest.mark.parametrize("m,k", [(256, 4096), (4095, 5120), (1, 14336)])
def test_gpu_add(m, k):
    """On the GPU: the fused add is eager torch's sum bit for bit, and y / q / s are `rmsnorm_quant`'s of it."""
    for d, dtype in DTYPES.items():
        x, r = _add_operands(m, k, dtype, device="cuda")
        w = _weight(k, dtype, "cuda")
        for layout in ("row", "deepgemm"):
            ctx = f"{m=} {k=} {d} {layout}"
            y, q, s, total = K.add_rmsnorm_quant(x, r, w, EPS, scale_layout=layout)
            assert_bitwise("residual + x", total, r + x, ctx)
            y0, q0, s0, _ = K.rmsnorm_quant(r + x, w, EPS, scale_layout=layout)
            assert_bitwise("y", y, y0, ctx)
            assert_bitwise("bytes", q, q0, ctx)
            assert_bitwise("scales", s, s0, ctx)
    K.check_nonfinite()


@gpu
def test_gpu_nonfinite_flag():
    K.reset_nonfinite()
    x = torch.randn(300, 512, device="cuda", dtype=torch.bfloat16)
    x[0, 0] = float("nan")
    K.rmsnorm_quant(x, torch.ones(512, device="cuda", dtype=torch.bfloat16), EPS, name="layers.3.input_layernorm")
    with pytest.raises(quant.NonFiniteError, match=r"jetrl::rmsnorm_quant on layers\.3\.input_layernorm"):
        K.check_nonfinite()
