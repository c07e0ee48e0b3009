"""JetFP8Linear on the emulated backend: numerics of fprop/dgrad/wgrad, the exact quantized
reference, rollout parity with linear_fp8, pre-quantized inputs, the weight cache, main_grad, and
what is saved for backward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from jetrl import quant
from jetrl.gemm import linear_fp8
from jetrl.linear import (
    JetFP8Linear,
    attach_quantized,
    invalidate_fp8_caches,
    invalidate_on_step,
    quantized_of,
    refresh_fp8_weights_,
    set_fp8_weight_caching,
)
from jetrl.recipe import QuantSpec, Recipe, RecipeError
from jetrl.testing.numerics import fp8_weights_alive, has_sm90, sqnr_db

UNIFIED = Recipe.from_name("jetrl-unified")
# (tokens, in_features, out_features): hostile token counts, K not a multiple of 256
SHAPES = [(1, 128, 256), (13, 256, 384), (130, 384, 128)]
IDS = [f"M{m}-K{k}-N{n}" for m, k, n in SHAPES]


def _layer(k, n, bias=False, seed=0, dtype=torch.bfloat16, recipe=UNIFIED):
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias).to(dtype)
    return JetFP8Linear.from_linear(lin, recipe=recipe, backend="emulated", layer_name="test.proj")


def _inputs(m, k, n, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    if m > 3:
        x[3] *= 300.0  # one token with a very different range
    dy = torch.randn(m, n, generator=g).to(torch.bfloat16)
    return x, dy


@pytest.mark.parametrize("m,k,n", SHAPES, ids=IDS)
def test_fwd_dgrad_wgrad_vs_float64(m, k, n):
    layer = _layer(k, n, bias=True)
    x, dy = _inputs(m, k, n)
    x.requires_grad_(True)
    y = layer(x.view(1, m, k))
    y.backward(dy.view(1, m, n))
    x64 = x.detach().double().requires_grad_(True)
    w64 = layer.weight.detach().double().requires_grad_(True)
    b64 = layer.bias.detach().double().requires_grad_(True)
    y64 = x64 @ w64.t() + b64
    y64.backward(dy.double())
    for what, ref, got in (
        ("fprop", y64, y.view(m, n)),
        ("dgrad", x64.grad, x.grad),
        ("wgrad", w64.grad, layer.weight.grad),
        ("bias", b64.grad, layer.bias.grad),
    ):
        s = sqnr_db(ref, got)
        assert torch.isfinite(got).all() and s >= 25, f"{what} {m=} {k=} {n=} sqnr={s:.1f} dB"
    assert y.dtype == x.grad.dtype == torch.bfloat16 and layer.weight.grad.dtype == torch.bfloat16


def _deq_reference(x, w, dy):
    """Dequantize-then-float64 reference of the three passes (the FP8 recipe with exact arithmetic)."""
    xq, xs = quant.quantize_1x128(x)
    wq, ws = quant.quantize_128x128(w)
    xd, wd = quant.dequantize_1x128(xq, xs).double(), quant.dequantize_128x128(wq, ws).double()
    y = xd @ wd.t()
    dyq, dys = quant.quantize_1x128(dy)
    dx = quant.dequantize_1x128(dyq, dys).double() @ wd
    dyt = quant.dequantize_128x1(*quant.quantize_128x1(dy)).double()
    xt = quant.dequantize_128x1(*quant.quantize_128x1(x)).double()  # the spec's 128x1 X (saved as such in fp8)
    dw = dyt.t() @ xt
    return y, dx, dw


@pytest.mark.parametrize("m,k,n", SHAPES, ids=IDS)
def test_autograd_matches_dequantized_reference(m, k, n):
    layer = _layer(k, n, dtype=torch.float32)
    x, dy = _inputs(m, k, n, seed=5)
    x.requires_grad_(True)
    layer(x).backward(dy)
    y_ref, dx_ref, dw_ref = _deq_reference(x.detach(), layer.weight.detach(), dy)
    y = layer(x.detach())

    # The emulated GEMM rounds an exact float64 sum once; the reference dequantizes to fp32 first (one
    # more rounding per element, ~1e-7 relative). Within one bf16 ulp (outputs) / fp32 noise (dW).
    def close(got, ref, rtol):
        torch.testing.assert_close(got.double(), ref, rtol=rtol, atol=1e-6 * float(ref.abs().max()))

    close(y, y_ref.to(torch.bfloat16).double(), 8e-3)
    close(x.grad, dx_ref.to(torch.bfloat16).double(), 8e-3)
    close(layer.weight.grad, dw_ref, 1e-5)


def test_forward_is_linear_fp8_bitwise():
    layer = _layer(256, 384, bias=True)
    x, _ = _inputs(7, 256, 384)
    q, s = layer.fp8_weight()
    assert q.dtype == quant.FP8_DTYPE and tuple(s.shape) == (3, 2)
    want = linear_fp8(x, q, s, layer.bias, backend="emulated", name="rollout")
    assert torch.equal(layer(x), want)
    with torch.no_grad():
        assert torch.equal(layer(x), want)


def test_pre_quantized_input_is_used_and_checked():
    layer = _layer(256, 128)
    x, _ = _inputs(4, 256, 128)
    plain = layer(x)
    q, s = quant.quantize_1x128(x)
    attach_quantized(x, q, s)
    assert quantized_of(x) is not None
    assert torch.equal(layer(x), plain)  # same bytes -> same output
    attach_quantized(x, torch.zeros_like(q), s)  # bytes that differ from x's: proves they are used
    assert layer(x).abs().max() == 0
    x.mul_(1.0)  # an in-place change bumps the version: the attachment is stale
    assert quantized_of(x) is None and torch.equal(layer(x), plain)
    assert quantized_of(x.clone()) is None
    with pytest.raises(ValueError, match="do not match"):
        attach_quantized(x, q[:2], s[:2])


def test_shared_quantization_saves_one_copy():
    """q/k/v reading one attached tensor save the same fp8 storage for backward."""
    layers = [_layer(256, 128, seed=i) for i in range(3)]
    x, _ = _inputs(8, 256, 128)
    x.requires_grad_(True)
    h = x * 1.0
    attach_quantized(h, *quant.quantize_1x128(h.detach()))
    ptrs = set()

    def pack(t):
        if t.dtype == quant.FP8_DTYPE:
            ptrs.add(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = sum(layer(h).float().sum() for layer in layers)
    out.backward()
    assert len(ptrs) == 1 and x.grad is not None


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda p: torch.optim.SGD(p, lr=0.1, foreach=False),
        lambda p: torch.optim.SGD(p, lr=0.1, foreach=True),
        lambda p: torch.optim.AdamW(p, lr=1e-2),
    ],
    ids=["sgd", "sgd-foreach", "adamw"],
)
def test_weight_cache_requantized_once_per_step(make_opt):
    layer = _layer(256, 256, dtype=torch.float32)
    opt = make_opt(layer.parameters())
    x, _ = _inputs(16, 256, 256)
    for step in range(3):
        for _ in range(2):  # two micro-batches: one quantization
            layer(x).float().square().mean().backward()
        assert layer.weight_quantizations == step + 1
        q_before = layer.fp8_weight()[0].clone()
        opt.step()
        opt.zero_grad()
        assert not torch.equal(layer.fp8_weight()[0], q_before), "cache not invalidated by optimizer.step()"
        assert layer.weight_quantizations == step + 2  # counts the next step's (only) quantization


def test_refresh_requantizes_into_the_same_tensors():
    """What CUDA graphs need: after an optimizer step the cached operands (fprop's bytes and dgrad's
    transposed bytes) are updated in place, and a later forward reuses them without quantizing again."""
    layer = _layer(256, 384)
    x, _ = _inputs(64, 256, 384)
    layer(x.requires_grad_()).float().sum().backward()  # the cache, with the transpose
    _, q, s, q_t, s_t = layer._cache
    ptrs = [t.data_ptr() for t in (q, s, q_t, s_t)]
    with torch.no_grad():
        layer.weight.mul_(-1.5)
    assert refresh_fp8_weights_(layer) == 1
    want = quant.quantize_128x128(layer.weight.detach())
    _, q2, s2, qt2, st2 = layer._cache
    assert (q2, s2, qt2, st2) == (q, s, q_t, s_t) and [t.data_ptr() for t in (q2, s2, qt2, st2)] == ptrs
    assert torch.equal(q.view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(s, want[1])
    assert torch.equal(q_t.view(torch.uint8), want[0].t().contiguous().view(torch.uint8)) and torch.equal(
        s_t, want[1].t()
    )
    n = layer.weight_quantizations
    layer(x).float().sum().backward()
    refresh_fp8_weights_(layer)  # current: nothing to do
    assert layer.weight_quantizations == n and layer._cache[1] is q


def test_invalidation_for_data_writes():
    layer = _layer(128, 128, dtype=torch.float32)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    handle = invalidate_on_step(opt, layer)
    q0 = layer.fp8_weight()[0].clone()
    layer.weight.data.mul_(2.0)  # bypasses the version counter
    assert torch.equal(layer.fp8_weight()[0], q0)  # documented: stale until invalidated
    assert invalidate_fp8_caches(layer) == 1
    assert torch.equal(layer.fp8_weight()[1], quant.quantize_128x128(layer.weight.detach())[1])
    layer.weight.data.mul_(0.5)
    opt.step()  # no grads: the step changes nothing, the hook still invalidates
    assert torch.equal(layer.fp8_weight()[1], quant.quantize_128x128(layer.weight.detach())[1])
    handle.remove()


def test_weight_caching_off_keeps_no_fp8_weight_and_gives_the_same_bits():
    """What FSDP needs (`jetrl.verl.engine`): no FP8 copy of the weight outlives a forward or waits for the
    backward (which quantizes the weight again for dgrad), a write that bypasses the version counter is seen at
    once, and outputs and gradients are those of the cached path bit for bit."""
    layer, ref = _layer(256, 384), _layer(256, 384)
    x, dy = _inputs(64, 256, 384)
    assert set_fp8_weight_caching(layer, False) == 1 and not layer.cache_weight
    for _ in range(2):
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        before = {id(t): t for t in fp8_weights_alive(layer)}  # e.g. ref's cache; held so no id is reused
        ya = layer(xa)
        assert layer._cache is None and fp8_weights_alive(layer, exclude=before) == [], "an FP8 weight waits"
        invalidate_fp8_caches(ref)
        before = {id(t): t for t in fp8_weights_alive(ref)}
        yb = ref(xb)
        assert fp8_weights_alive(ref, exclude=before) != []  # the cached path keeps its bytes (the check sees them)
        del before
        ya.backward(dy)
        yb.backward(dy)
        assert torch.equal(ya, yb) and torch.equal(xa.grad, xb.grad) and torch.equal(layer.weight.grad, ref.weight.grad)
    assert layer.weight_quantizations == 4 and ref.weight_quantizations == 2 and layer._cache is None
    layer.weight.data.mul_(2.0)  # bypasses the version counter: nothing cached to go stale
    assert torch.equal(layer.fp8_weight()[1], quant.quantize_128x128(layer.weight.detach())[1])
    with pytest.raises(RuntimeError, match=r"test\.proj: refresh_fp8_weight_ needs the FP8 weight cache"):
        refresh_fp8_weights_(layer)
    set_fp8_weight_caching(layer, True)
    layer.fp8_weight()
    assert layer._cache is not None


def test_main_grad_accumulates_in_fp32():
    layer = _layer(256, 128)
    layer.weight.main_grad = torch.zeros(128, 256, dtype=torch.float32)
    x, dy = _inputs(32, 256, 128)
    layer(x).backward(dy)
    first = layer.weight.main_grad.clone()
    layer(x).backward(dy)
    assert layer.weight.grad is None
    torch.testing.assert_close(layer.weight.main_grad, 2 * first, rtol=1e-6, atol=1e-6)
    ref = dy.double().t() @ x.double()
    assert sqnr_db(ref, first) >= 25


@pytest.mark.parametrize("fp8_saved", [True, False], ids=["fp8-saved", "bf16-saved"])
def test_saved_activation_bytes(fp8_saved):
    recipe = UNIFIED.replace(save_activations_fp8=fp8_saved)
    layer = _layer(512, 256, recipe=recipe)
    x = torch.randn(64, 512, dtype=torch.bfloat16, requires_grad=True)
    nbytes = []

    def pack(t):
        if t is not layer.weight:
            nbytes.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer(x)
    y.float().sum().backward()
    # fp8: wgrad's operand X^T [512, 64] e4m3 + its scales [512, ceil(64/128)] fp32
    want = 64 * 512 + 512 * 1 * 4 if fp8_saved else 64 * 512 * 2
    assert sum(nbytes) == want, f"{fp8_saved=} saved {sum(nbytes)} bytes, want {want}"


def test_fp8_saved_wgrad_is_the_spec_operand():
    """Saving the activation in fp8 changes no gradient bit: what is saved is wgrad's 128x1 operand
    quantized from the BF16 X (the spec), not a requantization of the 1x128 bytes."""
    grads = []
    for fp8_saved in (True, False):
        layer = _layer(384, 256, recipe=UNIFIED.replace(save_activations_fp8=fp8_saved))
        x, dy = _inputs(200, 384, 256, seed=3)
        x.requires_grad_(True)
        layer(x).backward(dy)
        grads.append((x.grad, layer.weight.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_no_grad_forward_saves_and_transposes_nothing(mode, monkeypatch):
    """Without grad mode (the old-log-prob and ref passes) no backward can follow: neither the transposed
    weight nor the wgrad operand (X^T quantized along tokens) is made, although the weight requires grad;
    the output is the grad-mode forward's, bit for bit."""
    import jetrl.linear as lin

    made = []
    real = lin.transpose_quantize
    monkeypatch.setattr(lin, "transpose_quantize", lambda x, **kw: made.append(kw["name"]) or real(x, **kw))
    layer = _layer(256, 128)
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    with getattr(torch, mode)():
        y = layer(x)
    assert made == [] and layer._cache[3] is None
    y_grad = layer(x)
    assert made == [f"{layer.layer_name}:input"]  # with grad mode the wgrad operand is made (and saved)
    assert torch.equal(y, y_grad)


def test_errors_name_the_layer():
    layer = _layer(256, 128)
    with pytest.raises(ValueError, match="test.proj: input has 128 features, expected 256"):
        layer(torch.randn(2, 128))
    with pytest.raises(ValueError, match="test.proj: input is on meta but the weight is on cpu"):
        layer(torch.randn(2, 256, device="meta"))
    with pytest.raises(RecipeError, match="does not train in FP8"):
        JetFP8Linear(256, 128, recipe="bf16", backend="emulated")
    bad = torch.randn(2, 256)
    bad[0, 0] = float("inf")
    with pytest.raises(quant.NonFiniteError, match="test.proj:input"):
        layer(bad)
    x = torch.randn(2, 256, requires_grad=True)
    y = layer(x)
    with pytest.raises(quant.NonFiniteError, match="test.proj:grad_output"):
        y.backward(torch.full_like(y, float("nan")))
    with pytest.raises(ValueError, match="unknown GEMM backend"):
        JetFP8Linear(256, 128, backend="cublas")


def test_parameter_names_and_fp32_master_weights():
    lin = nn.Linear(256, 128)
    names = [n for n, _ in lin.named_parameters()]
    layer = JetFP8Linear.from_linear(lin, recipe=UNIFIED, backend="emulated")
    assert [n for n, _ in layer.named_parameters()] == names and layer.weight is lin.weight
    x = torch.randn(3, 256, dtype=torch.bfloat16, requires_grad=True)
    layer(x).float().sum().backward()
    assert layer.weight.grad.dtype == torch.float32 and x.grad.dtype == torch.bfloat16
    assert "backend=emulated" in repr(layer)


@pytest.mark.skipif(not has_sm90(), reason="needs an sm_90 GPU for DeepGEMM and cuBLASLt block scaling")
@pytest.mark.parametrize("backend", ["deepgemm", "torch-blockwise"])
def test_gpu_linear_matches_emulated(backend):
    """The three passes of the GPU backends against the emulated backend on the same inputs (hostile
    rows included: an all-zero token, a token 1e4x larger), and rollout parity with linear_fp8."""
    torch.manual_seed(0)
    lin = nn.Linear(4096, 6144, bias=False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1000, 4096, device="cuda", dtype=torch.bfloat16)
    x[3] = 0
    x[5] *= 1e4
    dy = torch.randn(1000, 6144, device="cuda", dtype=torch.bfloat16)
    grads = {}
    for be in (backend, "emulated"):
        layer = JetFP8Linear.from_linear(lin, recipe=UNIFIED, backend=be, layer_name=f"gpu.{be}")
        xi = x.clone().requires_grad_(True)
        lin.weight.grad = None
        y = layer(xi)
        y.backward(dy)
        grads[be] = (y.detach(), xi.grad, lin.weight.grad.clone())
        if be == backend:
            assert torch.equal(y, linear_fp8(x, *layer.fp8_weight(), backend=be))
    for what, got, ref in zip(("fprop", "dgrad", "wgrad"), grads[backend], grads["emulated"], strict=True):
        assert torch.isfinite(got).all(), f"{backend} {what}: non-finite"
        s = sqnr_db(ref, got)
        assert s >= 35, f"{backend} {what} vs emulated: sqnr={s:.1f} dB"


@pytest.mark.parametrize(
    "field,spec",
    [
        ("train_activation", QuantSpec("1x128", scale_format="pow2")),
        ("train_grad_output", QuantSpec("1x128", division="x*(1/s)")),
        ("train_wgrad", QuantSpec("128x1", eps=1e-4)),
    ],
    ids=["pow2-activation", "reciprocal-dgrad", "eps-wgrad"],
)
def test_unsupported_training_spec_is_refused_not_ignored(field, spec):
    recipe = Recipe.from_name("jetrl-unified").replace(**{field: spec})
    with pytest.raises(RecipeError, match=rf"model\.layers\.0\.mlp\.up_proj: .*sets {field}="):
        JetFP8Linear(256, 256, recipe=recipe, backend="emulated", layer_name="model.layers.0.mlp.up_proj")
