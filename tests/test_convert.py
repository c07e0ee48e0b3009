"""convert_model on a tiny HF Qwen3 (built here, no downloads): what is converted and why, training
through the FP8 Linears, shape refusals, BF16 recipes, name filters and the FP8 weight export."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from jetrl import quant
from jetrl.convert import HF_PROJECTIONS, ConversionError, convert_model, export_fp8_weights
from jetrl.gemm.emulated import EmulatedBackend
from jetrl.linear import JetFP8Linear
from jetrl.recipe import Recipe
from jetrl.testing.numerics import sqnr_db
from jetrl.tiny import CharTokenizer, build_tiny_model

pytest.importorskip("transformers")


VOCAB = CharTokenizer().vocab_size


def tiny_qwen3(seed=0, dtype=torch.bfloat16):
    """The project's tiny Qwen3 (every projection a multiple of 128), in `dtype`."""
    return build_tiny_model(seed).to(dtype)


class StrictBackend(EmulatedBackend):
    """Emulated numerics with DeepGEMM's shape rule (to test refusals on CPU)."""

    name = "strict"

    def check_linear_shape(self, out_features, in_features):
        return None if in_features % 128 == 0 and out_features % 128 == 0 else "K and N must be multiples of 128"


def test_qwen3_report_and_names():
    model = tiny_qwen3()
    names_before = [n for n, _ in model.named_parameters()]
    report = convert_model(model, "jetrl-unified", backend="emulated")
    converted = report.converted_names()
    assert len(converted) == 2 * len(HF_PROJECTIONS)
    assert all(isinstance(model.get_submodule(n), JetFP8Linear) for n in converted)
    kept = {e.name: e.reason for e in report.kept()}
    assert list(kept) == ["lm_head"] and "keep_bf16 'lm_head'" in kept["lm_head"]
    assert [n for n, _ in model.named_parameters()] == names_before
    d = report.to_dict()
    assert (
        d["backend"] == "emulated"
        and len(d["entries"]) == 15
        and "FP8  model.layers.1.mlp.down_proj [256x512]" in str(report)
    )
    q = model.get_submodule("model.layers.0.self_attn.q_proj")
    assert q.layer_name == "model.layers.0.self_attn.q_proj"
    again = convert_model(model, "jetrl-unified", backend="emulated")  # idempotent
    assert again.converted_names() == converted


def test_qwen3_loss_falls_and_tracks_bf16():
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (2, 32))
    losses = {}
    for recipe in ("bf16", "jetrl-unified"):
        model = tiny_qwen3(seed=1, dtype=torch.float32)
        convert_model(model, recipe, backend="emulated")
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        hist = []
        for _ in range(5):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            hist.append(float(loss.detach()))
        losses[recipe] = hist
    fp8, bf16 = losses["jetrl-unified"], losses["bf16"]
    assert fp8[-1] < fp8[0] - 0.5, f"FP8 loss did not fall: {fp8}"
    assert abs(fp8[0] - bf16[0]) < 0.05 and abs(fp8[-1] - bf16[-1]) < 0.25, f"{fp8=} {bf16=}"


def test_bf16_recipe_converts_nothing():
    model = tiny_qwen3()
    report = convert_model(model, Recipe.from_name("bf16"))
    assert report.converted_names() == [] and report.backend is None
    assert all("trains in BF16" in e.reason for e in report.entries)
    assert not any(isinstance(m, JetFP8Linear) for m in model.modules())


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = nn.Module()
        self.mlp.gate = nn.Linear(256, 8, bias=False)  # MoE router
        self.mlp.up_proj = nn.Linear(256, 512, bias=False)
        self.mlp.down_proj = nn.Linear(512, 200, bias=False)  # N not a multiple of 128
        self.score = nn.Linear(256, 256)


def test_shape_refusal_router_and_filters():
    strict = StrictBackend()
    block = _Block()
    with pytest.raises(ConversionError, match=r"mlp\.down_proj: K and N must be multiples of 128"):
        convert_model(block, "jetrl-unified", backend=strict)
    assert not any(isinstance(m, JetFP8Linear) for m in block.modules()), "refusal must leave the model untouched"
    report = convert_model(block, Recipe.from_name("jetrl-unified", allow_bf16_fallback_shapes=True), backend=strict)
    reasons = {e.name: (e.converted, e.reason) for e in report.entries}
    assert reasons["mlp.up_proj"][0] and not reasons["mlp.down_proj"][0]
    assert "shape refused by strict" in reasons["mlp.down_proj"][1]
    assert "keep_bf16 'mlp.gate'" in reasons["mlp.gate"][1]
    assert "not an HF projection" in reasons["score"][1]
    block2 = _Block()
    report2 = convert_model(block2, "jetrl-unified", backend="emulated", name_filter=r"score|up_proj")
    assert report2.converted_names() == ["mlp.up_proj", "score"]
    report3 = convert_model(_Block(), "jetrl-unified", backend="emulated", name_filter=lambda n: n == "score")
    assert report3.converted_names() == ["score"]
    with pytest.raises(TypeError, match="name_filter"):
        convert_model(_Block(), "jetrl-unified", backend="emulated", name_filter=3)


def test_export_fp8_weights():
    model = tiny_qwen3()
    convert_model(model, "jetrl-unified", backend="emulated")
    out = export_fp8_weights(model)
    assert len(out) == 14 and "model.layers.0.self_attn.q_proj.weight" in out
    w = model.get_submodule("model.layers.1.mlp.down_proj").weight
    q, s = out["model.layers.1.mlp.down_proj.weight"]
    q_ref, s_ref = quant.quantize_128x128(w.detach())
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
    assert tuple(s.shape) == (2, 4)


def test_fused_norm_and_swiglu_keep_numerics():
    """fuse=True: the fused RMSNorm / SwiGLU producers hand their bytes to the FP8 Linears; the forward is
    bit-identical to the unfused conversion, and the gradients are as close to BF16 training as unfused
    ones (the fused backward kernels keep fp32 intermediates where autograd rounds to bf16, so the two FP8
    backward passes differ at the FP8 noise level, not more)."""
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    out = {}
    for recipe, fuse in (("bf16", False), ("jetrl-unified", False), ("jetrl-unified", True)):
        model = tiny_qwen3(seed=4)
        names = [n for n, _ in model.named_parameters()]
        report = convert_model(model, recipe, backend="emulated", fuse=fuse)
        assert [n for n, _ in model.named_parameters()] == names
        model(input_ids=ids, labels=ids).loss.backward()
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        out[(recipe, fuse)] = (logits, {n: p.grad for n, p in model.named_parameters()}, report)
    logits, grads, report = out[("jetrl-unified", True)]
    assert report.fused == [
        f"model.layers.{i}.{m}" for i in range(2) for m in ("input_layernorm", "post_attention_layernorm", "mlp")
    ]
    assert torch.equal(logits, out[("jetrl-unified", False)][0]), "fused producers changed the forward"
    ref, unfused = out[("bf16", False)][1], out[("jetrl-unified", False)][1]
    for name, g in grads.items():
        s_fused, s_unfused = sqnr_db(ref[name], g), sqnr_db(ref[name], unfused[name])
        assert s_fused >= s_unfused - 1.5, f"{name}: vs bf16 fused {s_fused:.1f} dB, unfused {s_unfused:.1f} dB"
