"""jetrl.kernels.swiglu_quant / swiglu_backward.

Contracts: (q, s) are BITWISE quantize_1x128 of the kernel's own h; h matches eager
``F.silu(gate) * up`` (HF's act_fn(gate_proj) * up_proj) within 1 ulp of its dtype (Triton's exp vs
torch's); the backward matches its fp32 reference within dtype-paired tolerances, and that
reference matches float64 autograd.

CPU (Triton interpreter, subprocess): scales bitwise, clamped pre-cast values bitwise via the bytes
ml_dtypes' correct cast makes of them, h within tolerance. NOT checked on CPU: the kernel's
``.to(tl.float8e4nv)`` (wrong for a few % of values in the interpreter, NUMERICS.md section 3) and
bf16 rounding (the interpreter's fp32 -> bf16 cast truncates), so bf16 h and gradients are checked
within 2 ulp on CPU and within 1 ulp, compiled, on the GPU (sm_90).
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

KINDS = ("randn", "zero-group", "wide-range")


def _gate_up(m, k, dtype, kind, seed, device="cpu"):
    """gate and up as the two halves of one fused [M, 2K] gate_up output (row stride 2K)."""
    hi = 1 if dtype == torch.float16 else 15  # the product must stay finite
    gu = torch.cat(
        [make_input(m, k, dtype, kind, seed=seed, hi=hi), make_input(m, k, dtype, kind, seed=seed + 1, hi=hi)], 1
    ).to(device)
    return gu[:, :k], gu[:, k:]


def test_cpu_public_api_is_reference():
    g, u = _gate_up(13, 300, torch.bfloat16, "randn", 0)
    h, q, s = K.swiglu_quant(g, u, scale_layout="deepgemm", name="t.h")
    assert_bitwise("h", h.float(), (torch.nn.functional.silu(g) * u).float())
    q_ref, s_ref = quant.quantize_1x128(h)
    assert_bitwise("q", q, q_ref)
    assert_bitwise("s", s, s_ref)
    assert s.stride() == (1, 16)


def test_reference_backward_matches_float64_autograd():
    g, u = _gate_up(13, 300, torch.float32, "randn", 3)
    dh = make_input(13, 300, torch.float32, "randn", seed=9)
    dg, du = K.swiglu_backward(dh, g, u)
    g64, u64 = g.double().requires_grad_(), u.double().requires_grad_()
    (torch.nn.functional.silu(g64) * u64).backward(dh.double())
    torch.testing.assert_close(dg.double(), g64.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(du.double(), u64.grad, rtol=1e-5, atol=1e-6)


def test_autograd_routes_to_backward_op():
    g, u = (t.clone().requires_grad_() for t in _gate_up(5, 256, torch.float32, "randn", 1))
    h, _, _ = K.swiglu_quant(g, u)
    dh = torch.randn_like(h)
    h.backward(dh)
    dg, du = K.swiglu_backward(dh, g.detach(), u.detach())
    assert_bitwise("dgate", g.grad, dg)
    assert_bitwise("dup", u.grad, du)


def test_cpu_rejects_bad_input():
    g, u = torch.randn(4, 256), torch.randn(4, 256)
    u[3, 3] = float("nan")
    with pytest.raises(quant.NonFiniteError, match="layers.2.mlp.down_proj:input"):
        K.swiglu_quant(g, u, name="layers.2.mlp.down_proj:input")
    with pytest.raises(ValueError, match="must match"):
        K.swiglu_quant(torch.randn(4, 256), torch.randn(4, 128))


def test_fake_impl_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        gu = torch.empty(13, 600, dtype=torch.bfloat16)
        h, q, s = K.swiglu_quant(gu[:, :300], gu[:, 300:], scale_layout="deepgemm")
    assert [tuple(t.shape) for t in (h, q, s)] == [(13, 300), (13, 300), (13, 3)] and s.stride() == (1, 16)


_INTERP = [(m, k, d, kind) for (m, k) in INTERP_SHAPES for d in DTYPES for kind in KINDS]


@pytest.fixture(scope="module")
def interp_results():
    calls = []
    for m, k, d, kind in _INTERP:
        g, u = _gate_up(m, k, DTYPES[d], kind, m + k)
        layout = "deepgemm" if kind == "randn" else "row"
        calls.append(("swiglu_quant", "launch_swiglu_quant", (g, u, layout, "t.h", torch.empty(m, k)), {}))
        dh = make_input(m, k, DTYPES[d], "randn", seed=4)
        calls.append(("swiglu_quant", "launch_swiglu_backward", (dh, g, u), {}))
    g, u = torch.randn(3, 300), torch.randn(3, 300)
    g[1, 1] = float("inf")
    calls.append(("swiglu_quant", "launch_swiglu_quant", (g, u, "row", "layers.6.mlp.down_proj:input"), {}))
    return run_interpreted(calls)


@pytest.mark.parametrize("case", range(len(_INTERP)), ids=[f"M{m}-K{k}-{d}-{kd}" for m, k, d, kd in _INTERP])
def test_interpreter(interp_results, case):
    m, k, d, kind = _INTERP[case]
    ctx = f"{m=} {k=} {d} {kind}"
    r = interp_results[2 * case]
    g, u, _, _, pre = r["args"]
    h, q, s = r["out"]
    assert r["nonfinite"] is None
    h_ref = K.torch_swiglu_quant(g, u)[0]
    assert_close_ulps("h", h, h_ref, 2.0 if d == "bf16" else 1.0 if d == "fp16" else 16.0, ctx)
    q_ref, s_ref = quant.quantize_1x128(h)
    assert_bitwise("scales", s, s_ref, ctx)
    assert_bitwise("bytes(ml_dtypes cast of pre-cast)", e4m3_bytes_of(pre), q_ref.view(torch.uint8), ctx)
    r = interp_results[2 * case + 1]
    for got, want, nm in zip(r["out"], K.torch_swiglu_backward(*r["args"]), ("dgate", "dup"), strict=True):
        _close(nm, got, want, 2.0 if d == "bf16" else 16.0 if d == "fp32" else 1.0, ctx)


def _close(name, got, want, ulps, ctx):
    torch.testing.assert_close(
        got.float(),
        want.float(),
        rtol=ulps * ULP[got.dtype],
        atol=ulps * ULP[got.dtype] * float(want.float().abs().max()),  # cancellation in 1 + g(1 - sg)
        msg=lambda m_: f"{name} {ctx}: {m_}",
    )


def test_interpreter_nonfinite_flag_names_op_and_tensor(interp_results):
    msg = interp_results[-1]["nonfinite"]
    assert msg is not None and "jetrl::swiglu_quant" in msg and "layers.6.mlp.down_proj:input" in msg, msg


gpu = pytest.mark.skipif(not has_sm90(), reason="needs an sm_90 GPU to run the compiled Triton kernel")


@gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("m,k", GPU_SHAPES)
def test_gpu(m, k, kind):
    for d, dtype in DTYPES.items():
        ctx = f"{m=} {k=} {d} {kind}"
        g, u = _gate_up(m, k, dtype, kind, m + 2 * k, "cuda")
        h_ref = K.torch_swiglu_quant(g, u)[0]
        for layout in ("row", "deepgemm"):
            h, q, s = K.swiglu_quant(g, u, scale_layout=layout)
            q_ref, s_ref = quant.quantize_1x128(h)
            assert_bitwise("bytes", q, q_ref, f"{ctx} {layout}")
            assert_bitwise("scales", s, s_ref, f"{ctx} {layout}")
        # bf16/fp16: silu may differ by 1 ulp before the rounding to dtype (exp), up * silu then by
        # up to 2. fp32: Triton's exp is exp2(g * log2e); rounding g * log2e costs |g| * 2^-24
        # relative, i.e. up to 88.7 * 2^-24 ~ 45 ulp before exp overflows (measured: ~30 ulp).
        assert_close_ulps("h", h, h_ref, 2.0 if d != "fp32" else 64.0, ctx)
        dh = make_input(m, k, dtype, "randn", seed=13, device="cuda")
        for got, want, nm in zip(
            K.swiglu_backward(dh, g, u), K.torch_swiglu_backward(dh, g, u), ("dg", "du"), strict=True
        ):
            _close(nm, got, want, 1.0 if d != "fp32" else 16.0, ctx)
    K.check_nonfinite()


@gpu
def test_gpu_nonfinite_flag():
    K.reset_nonfinite()
    g = torch.randn(300, 512, device="cuda", dtype=torch.bfloat16)
    u = torch.randn_like(g)
    u[5, 5] = float("inf")
    K.swiglu_quant(g, u, name="layers.1.mlp.down_proj:input")
    with pytest.raises(quant.NonFiniteError, match=r"jetrl::swiglu_quant on layers\.1\.mlp\.down_proj:input"):
        K.check_nonfinite()
