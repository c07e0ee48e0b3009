"""Stock vLLM FP8: settings -> rollout graph -> findings, against the captured jetrl-unified training graph.

Each violating setup perturbs one stock setting (an env var, the checkpoint's quantization_config, an
online method, the TP size, the KV cache dtype) from the compatible baseline; none starts an engine.
"""

from __future__ import annotations

import pytest

from jetrl.lint import lint
from jetrl.lint.builders import capture_training
from jetrl.lint.stock_vllm import StockConfigError, StockVllmSettings, build_stock_rollout_graph
from jetrl.recipe import Granularity, QuantSpec, Recipe, RecipeError, ScaleFormat

from .conftest import BLOCK_FP8_CONFIG, COMPATIBLE_ENV, fp8_export


def _stock(ckpt, env=COMPATIBLE_ENV, quant_config=BLOCK_FP8_CONFIG, **kw) -> StockVllmSettings:
    return StockVllmSettings.from_environment(ckpt, env=env, quant_config=quant_config, **kw)


def _lint(ckpt, training, settings, recipe="jetrl-unified"):
    return lint(ckpt, recipe, "stock-vllm", stock=settings, training=training)


def _only(report, code):
    found = [f for f in report.findings if f.code == code]
    assert found, f"no {code} finding in:\n{report.table()}"
    return found


def test_settings_read_vllm_defaults_and_scale_fmt(tiny_ckpt):
    s = StockVllmSettings.from_environment(tiny_ckpt, env={}, quant_config=BLOCK_FP8_CONFIG)
    assert s.deep_gemm_e8m0 and s.flashinfer_blockscale and s.pow2  # vLLM's defaults
    assert "(default)" in s.origins["deep_gemm_e8m0"]
    ue8m0 = {**BLOCK_FP8_CONFIG, "scale_fmt": "ue8m0"}
    s = StockVllmSettings.from_environment(tiny_ckpt, env={}, quant_config=ue8m0)
    assert s.pow2 and "scale_fmt=ue8m0" in s.origins["deep_gemm_e8m0"]
    s = StockVllmSettings.from_environment(tiny_ckpt, env={"VLLM_USE_DEEP_GEMM_E8M0": "0"}, quant_config=ue8m0)
    assert not s.pow2  # an explicit 0 wins over scale_fmt (vllm/transformers_utils/config.py)
    with pytest.raises(StockConfigError, match="VLLM_USE_DEEP_GEMM_E8M0"):
        StockVllmSettings.from_environment(tiny_ckpt, env={"VLLM_USE_DEEP_GEMM_E8M0": "yes"})
    with pytest.raises(StockConfigError, match="weight_block_size"):
        _stock(tiny_ckpt, quant_config={**BLOCK_FP8_CONFIG, "weight_block_size": [64, 64]})


def test_compatible_stock_setup_is_consistent(tiny_ckpt, unified_training):
    report = _lint(tiny_ckpt, unified_training, _stock(tiny_ckpt))
    assert report.ok and report.findings == [], report.table()
    assert report.rollout_summary["n_quantized_linears"] == report.training_summary["n_quantized_linears"] == 14


def test_default_env_pow2_scales_on_the_rollout_side_only(tiny_ckpt, unified_training):
    report = _lint(tiny_ckpt, unified_training, _stock(tiny_ckpt, env={"VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER": "0"}))
    assert not report.ok
    found = _only(report, "precision-mismatch")
    assert {f.tensor for f in found} == {"x", "w"}
    for f in found:
        assert "scale_format fp32 vs pow2" in f.message
        assert f.fix.startswith("export VLLM_USE_DEEP_GEMM_E8M0=0")
        # first layer first, named on both sides (vLLM's fused Linear, the HF projection)
        assert (f.rollout_module, f.training_module) == (
            "model.layers.0.self_attn.qkv_proj",
            "model.layers.0.self_attn.q_proj",
        )
        assert len(f.also) == 13


def test_flashinfer_small_batch_quantizer_is_flagged(tiny_ckpt, unified_training):
    env = {"VLLM_USE_DEEP_GEMM_E8M0": "0"}  # FlashInfer left at vLLM's default (on)
    report = _lint(tiny_ckpt, unified_training, _stock(tiny_ckpt, env=env))
    (f,) = _only(report, "precision-mismatch")
    assert f.tensor == "x[M<32]" and "(for M<32)" in f.message and "flashinfer" in f.message
    assert "division x/s vs x*(1/s)" in f.message
    assert f.fix.startswith("export VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER=0")


def test_naive_per_tensor_rollout_against_fp8_training(tiny_ckpt, unified_training):
    report = _lint(tiny_ckpt, unified_training, _stock(tiny_ckpt, quant_config=None, quantization="fp8_per_tensor"))
    found = _only(report, "precision-mismatch")
    labels = {f.tensor: f.found for f in found}
    assert "per-tensor" in labels["w"] and "per-token" in labels["x"]
    assert all("granularity" in f.message and "fp8_per_tensor" in f.fix for f in found)


def test_reciprocal_quantizer_of_online_per_block(tiny_ckpt, unified_training):
    report = _lint(tiny_ckpt, unified_training, _stock(tiny_ckpt, quant_config=None, quantization="fp8_per_block"))
    (f,) = _only(report, "precision-mismatch")
    assert f.tensor == "w" and "division x/s vs x*(1/s)" in f.message and "fp8_per_block" in f.fix


def test_eps_mismatch_of_vllm_native_quantizer(tiny_ckpt, unified_training):
    report = _lint(tiny_ckpt, unified_training, _stock(tiny_ckpt, quant_op="native"))
    (f,) = _only(report, "precision-mismatch")
    assert f.tensor == "x" and "eps 1e-10 vs 0.001953125" in f.message
    assert "quant_fp8 custom op" in f.fix


def test_projection_quantized_in_rollout_but_excluded_in_training(tiny_ckpt):
    recipe = Recipe.from_name("jetrl-unified", keep_bf16=(*Recipe.from_name("jetrl-unified").keep_bf16, "down_proj"))
    training = capture_training(tiny_ckpt, recipe, probe=[1, 5, 6, 7])
    report = lint(tiny_ckpt, recipe, "stock-vllm", stock=_stock(tiny_ckpt), training=training)
    found = _only(report, "quantized-one-side")
    assert {f.training_module for f in found} == {"model.layers.0.mlp.down_proj"}
    assert all("model.layers.1.mlp.down_proj" in f.also for f in found)
    assert all("quantized in rollout only" in f.message and "ignored_layers" in f.fix for f in found)
    # and the fix works: listing the layers as ignored makes the setup consistent
    ignored = {**BLOCK_FP8_CONFIG, "ignored_layers": [f"model.layers.{i}.mlp.down_proj" for i in range(2)]}
    report = lint(tiny_ckpt, recipe, "stock-vllm", stock=_stock(tiny_ckpt, quant_config=ignored), training=training)
    assert report.ok, report.table()


def test_mixed_ignored_parts_of_a_fused_layer_are_refused(tiny_ckpt):
    ignored = {**BLOCK_FP8_CONFIG, "ignored_layers": ["model.layers.0.self_attn.k_proj"]}
    with pytest.raises(StockConfigError, match="qkv_proj"):
        build_stock_rollout_graph(tiny_ckpt, _stock(tiny_ckpt, quant_config=ignored))


def test_tp_shard_off_the_128_grid(tmp_path):
    from jetrl.tiny import save_tiny_checkpoint

    ckpt = save_tiny_checkpoint(tmp_path / "i384", seed=1, intermediate_size=384)
    training = capture_training(ckpt, Recipe.from_name("jetrl-unified"), probe=[1, 5, 6, 7])
    report = lint(ckpt, "jetrl-unified", "stock-vllm", stock=_stock(ckpt, tensor_parallel_size=2), training=training)
    found = _only(report, "tp-shard")
    assert {f.rollout_module for f in found} == {"model.layers.0.mlp.gate_up_proj", "model.layers.0.mlp.down_proj"}
    assert all(f.also and f.also[0].startswith("model.layers.1.mlp.") for f in found)
    assert any("gate_proj shard 192" in f.found for f in found)
    assert all("tensor_parallel_size" in f.fix for f in found)
    # TP=1 on the same model is consistent: the shards are the finding, nothing else
    assert lint(ckpt, "jetrl-unified", "stock-vllm", stock=_stock(ckpt), training=training).ok


def test_fp8_kv_cache_is_a_warning_with_the_reason(tiny_ckpt, unified_training):
    report = _lint(tiny_ckpt, unified_training, _stock(tiny_ckpt, kv_cache_dtype="fp8"))
    (f,) = _only(report, "kv-cache-dtype")
    assert f.severity == "warning" and report.ok
    assert "attention is outside the FP8 recipe" in f.message and "log-prob mismatch" in f.message
    assert (f.rollout_module, f.training_module) == ("model.layers.0.self_attn.attn", "model.layers.0.self_attn")
    assert "kv_cache_dtype='auto'" in f.fix


def test_recipe_spec_the_trainer_cannot_implement_is_refused(tiny_ckpt):
    """A training QuantSpec the FP8 Linear does not implement is refused at conversion (never trained
    silently with the default spec), so the lint cannot even capture such a trainer."""
    pow2 = QuantSpec(Granularity.G1x128, scale_format=ScaleFormat.POW2)
    recipe = Recipe.from_name("jetrl-unified").replace(train_activation=pow2, rollout_activation=pow2)
    with pytest.raises(RecipeError, match="sets train_activation=.*pow2"):
        capture_training(tiny_ckpt, recipe, probe=[1, 5, 6, 7])


def test_trainer_fp8_export_served_by_stock_vllm(tiny_ckpt, tmp_path, monkeypatch):
    """The realistic stock flow: the trainer (down_proj kept BF16) exports its FP8 bytes; stock vLLM serves
    the export with its ignored_layers. Consistent with the compatible env, pow2 findings with vLLM's default."""
    base = Recipe.from_name("jetrl-unified")
    recipe = base.replace(keep_bf16=(*base.keep_bf16, "down_proj"))
    served = fp8_export(tiny_ckpt, recipe, tmp_path / "export")
    training = capture_training(tiny_ckpt, recipe, probe=[1, 5, 6, 7])
    for k in ("VLLM_USE_DEEP_GEMM", "VLLM_USE_DEEP_GEMM_E8M0", "VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER"):
        monkeypatch.delenv(k, raising=False)
    for k, v in COMPATIBLE_ENV.items():
        monkeypatch.setenv(k, v)
    report = lint(tiny_ckpt, recipe, "stock-vllm", served_path=served, training=training)
    assert report.ok and report.findings == [], report.table()
    assert report.rollout_summary["n_quantized_linears"] == 12
    monkeypatch.delenv("VLLM_USE_DEEP_GEMM_E8M0")
    report = lint(tiny_ckpt, recipe, "stock-vllm", served_path=served, training=training)
    assert {f.code for f in report.findings} == {"precision-mismatch"}
    assert all("pow2" in f.found for f in report.findings)
