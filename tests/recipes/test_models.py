"""recipes/models/*/config.json: the three paper models' shapes go through the FP8 path.

For each model (one decoder layer at the real widths; the vocabulary shrunk to 2048 rows, since the
embeddings and lm_head stay BF16 by the recipe and only cost memory here): `convert_model` converts
the seven projections under DeepGEMM's shape rule, every converted Linear's N and K are multiples of
128 (the 128x128 weight blocks), `export_fp8_weights` gives [N, K] e4m3 bytes with a [N/128, K/128]
scale grid, and the weight sync's planner places the trainer's payload onto the parameter layout vLLM
builds for the architecture (its own ``packed_modules_mapping``: fused ``qkv_proj`` / ``gate_up_proj``),
including Qwen2.5's q/k/v biases, the GQA head counts, and tied as well as untied embeddings. A width
that does not suit the blocks is refused naming the Linear, or kept BF16 with the reason when the
recipe allows it."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch

from jetrl.convert import ConversionError, convert_model, export_fp8_weights
from jetrl.gemm.deepgemm import DeepGemmBackend
from jetrl.gemm.emulated import EmulatedBackend
from jetrl.lint.layout import FUSED_LINEARS, ModelLayout, read_config
from jetrl.recipe import BLOCK, Recipe
from jetrl.rollout.adapter import ParamInfo
from jetrl.rollout.sync import plan_sync, trainer_payload

transformers = pytest.importorskip("transformers")

MODELS_DIR = Path(__file__).resolve().parents[2] / "recipes" / "models"
MODELS = ["llama3.1-8b", "qwen2.5-7b", "qwen3-8b-base"]
VLLM_CLASS = {
    "LlamaForCausalLM": "vllm.model_executor.models.llama",
    "Qwen2ForCausalLM": "vllm.model_executor.models.qwen2",
    "Qwen3ForCausalLM": "vllm.model_executor.models.qwen3",
}
SMALL_VOCAB = 2048


class BlockRuleBackend(EmulatedBackend):
    """Emulated FP8 numerics under DeepGEMM's shape rule (so shape refusals show on CPU)."""

    name = "emulated+deepgemm-shape-rule"
    needs_block_multiples = DeepGemmBackend.needs_block_multiples


def hf_config(model: str, **overrides):
    cfg = transformers.AutoConfig.from_pretrained(MODELS_DIR / model)
    for k, v in {"num_hidden_layers": 1, "vocab_size": SMALL_VOCAB, **overrides}.items():
        setattr(cfg, k, v)
    return cfg


def build(cfg) -> torch.nn.Module:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


def vllm_packed(arch: str) -> dict[str, list[str]]:
    """vLLM's own fused-module mapping for the architecture (needs vLLM importable)."""
    pytest.importorskip("vllm")
    cls = getattr(importlib.import_module(VLLM_CLASS[arch]), arch)
    return {k: list(v) for k, v in cls.packed_modules_mapping.items()}


def vllm_param_layout(cfg, packed: dict[str, list[str]]) -> dict[str, ParamInfo]:
    """The parameters vLLM's model holds for `cfg` under the jetrl block-FP8 method at TP=1: fused
    Linears in e4m3 with a 128x128 ``weight_scale_inv`` grid (their biases in BF16), everything else BF16,
    vocab rows padded to 64, no ``lm_head`` of its own when the embeddings are tied."""
    lay = ModelLayout.from_config(cfg.to_dict())
    vocab = -(-cfg.vocab_size // 64) * 64
    info: dict[str, ParamInfo] = {"model.embed_tokens.weight": ParamInfo((vocab, lay.hidden), "bfloat16", True, None)}
    shapes = {lin.module.rsplit(".", 1)[-1]: lin for lin in ModelLayout.layer_linears(lay, 0)}

    def fp8(name: str, n: int, k: int, bias: bool) -> None:
        info[f"{name}.weight"] = ParamInfo((n, k), "float8_e4m3fn", False, "block")
        info[f"{name}.weight_scale_inv"] = ParamInfo((-(-n // BLOCK), -(-k // BLOCK)), "float32", False, "block")
        if bias:
            info[f"{name}.bias"] = ParamInfo((n,), "bfloat16", False, "block")

    for i in range(lay.num_layers):
        p = f"model.layers.{i}"
        attn_bias = cfg.model_type == "qwen2" or bool(getattr(cfg, "attention_bias", False))
        for fused, parts in packed.items():
            owner = "self_attn" if fused == "qkv_proj" else "mlp"
            n = sum(shapes[x].n for x in parts)
            fp8(f"{p}.{owner}.{fused}", n, shapes[parts[0]].k, attn_bias and owner == "self_attn")
        fp8(f"{p}.self_attn.o_proj", shapes["o_proj"].n, shapes["o_proj"].k, False)
        fp8(f"{p}.mlp.down_proj", shapes["down_proj"].n, shapes["down_proj"].k, False)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            info[f"{p}.{norm}.weight"] = ParamInfo((lay.hidden,), "bfloat16", False, None)
        if lay.qk_norm:
            for norm in ("q_norm", "k_norm"):
                info[f"{p}.self_attn.{norm}.weight"] = ParamInfo((lay.head_dim,), "bfloat16", False, None)
    info["model.norm.weight"] = ParamInfo((lay.hidden,), "bfloat16", False, None)
    if not cfg.tie_word_embeddings:
        info["lm_head.weight"] = ParamInfo((vocab, lay.hidden), "bfloat16", True, None)
    return info


@pytest.mark.parametrize("model", MODELS)
def test_config_facts(model):
    cfg = read_config(MODELS_DIR / model)
    lay = ModelLayout.from_config(cfg)
    hf = transformers.AutoConfig.from_pretrained(MODELS_DIR / model)
    assert hf.architectures[0] in VLLM_CLASS and hf.model_type == lay.model_type
    assert lay.num_heads % lay.num_kv_heads == 0 and lay.num_kv_heads < lay.num_heads, "GQA"
    assert lay.num_heads * lay.head_dim == (lay.hidden if model != "qwen3-8b-base" else 4096)
    assert not hf.tie_word_embeddings  # all three 7-8B models keep a separate lm_head
    for lin in lay.layer_linears(0):
        assert lin.n % BLOCK == 0 and lin.k % BLOCK == 0, f"{model} {lin.module}: N={lin.n} K={lin.k}"


LAYOUT_CASES = [(m, False) for m in MODELS] + [("qwen3-8b-base", True)]
"""The three shipped (untied) configs, and Qwen3's with tied embeddings (as its small sizes ship)."""


@pytest.mark.parametrize("model, tied", LAYOUT_CASES, ids=[f"{m}-{'tied' if t else 'untied'}" for m, t in LAYOUT_CASES])
def test_convert_export_and_vllm_layout(model, tied):
    cfg = hf_config(model, tie_word_embeddings=tied)
    net = build(cfg)
    recipe = Recipe.from_name("jetrl-unified")
    report = convert_model(net, recipe, backend=BlockRuleBackend())
    converted = {e.name: e for e in report.entries if e.converted}
    assert len(converted) == 7, str(report)
    for e in converted.values():
        n, k = e.out_features, e.in_features
        assert n % BLOCK == 0 and k % BLOCK == 0, f"{e.name}: {n=} {k=}"
    kept = {e.name: e.reason for e in report.kept()}
    assert list(kept) == ["lm_head"] and "keep_bf16 'lm_head'" in kept["lm_head"]

    fp8 = export_fp8_weights(net)
    assert sorted(fp8) == sorted(f"{n}.weight" for n in converted)
    for name, (q, s) in fp8.items():
        e = converted[name.removesuffix(".weight")]
        assert q.dtype == torch.float8_e4m3fn and tuple(q.shape) == (e.out_features, e.in_features), name
        assert tuple(s.shape) == (e.out_features // BLOCK, e.in_features // BLOCK) and s.dtype == torch.float32, name
    if cfg.model_type == "qwen2":
        biases = [n for n, _ in net.named_parameters() if n.endswith("_proj.bias")]
        assert sorted(b.rsplit(".", 2)[-2] for b in biases) == ["k_proj", "q_proj", "v_proj"]

    packed = vllm_packed(cfg.architectures[0])
    assert packed == {k: list(v) for k, v in FUSED_LINEARS.items()}  # the lint's statement of vLLM's mapping
    layout = vllm_param_layout(cfg, packed)
    payload = trainer_payload(net, recipe)
    placements = plan_sync(payload, layout, packed)  # raises WeightSyncError on any gap or misfit
    kinds = {p.hf_name: p.kind for p in placements}
    assert sum(k == "fp8" for k in kinds.values()) == 7
    lay = ModelLayout.from_config(cfg.to_dict())
    q_rows, kv_rows = lay.num_heads * lay.head_dim, lay.num_kv_heads * lay.head_dim
    rows = {p.hf_name: p.row0 for p in placements}
    assert rows["model.layers.0.self_attn.k_proj.weight"] == q_rows
    assert rows["model.layers.0.self_attn.v_proj.weight"] == q_rows + kv_rows
    assert rows["model.layers.0.mlp.up_proj.weight"] == lay.intermediate
    if cfg.model_type == "qwen2":
        assert kinds["model.layers.0.self_attn.v_proj.bias"] == "bf16"
        assert rows["model.layers.0.self_attn.v_proj.bias"] == q_rows + kv_rows


def test_unsuitable_width_is_refused_or_kept_bf16_with_reason():
    cfg = hf_config("qwen2.5-7b", intermediate_size=18944 + 64)
    net = build(cfg)
    with pytest.raises(ConversionError, match=r"model\.layers\.0\.mlp\.gate_proj: .*multiples of 128"):
        convert_model(net, "jetrl-unified", backend=BlockRuleBackend())
    recipe = Recipe.from_name("jetrl-unified").replace(allow_bf16_fallback_shapes=True)
    report = convert_model(net, recipe, backend=BlockRuleBackend())
    kept = {e.name: e.reason for e in report.kept()}
    assert set(kept) == {"lm_head", *(f"model.layers.0.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj"))}
    assert "out_features=19008" in kept["model.layers.0.mlp.gate_proj"]
    assert "in_features=19008" in kept["model.layers.0.mlp.down_proj"]
    assert len(report.converted_names()) == 4  # q/k/v/o still FP8
