"""The recipe registry, its invariants and its error messages."""

from __future__ import annotations

import dataclasses

import pytest

from jetrl.recipe import RECIPE_NAMES, Division, Granularity, QuantSpec, Recipe, RecipeError, ScaleFormat


def test_named_recipes():
    assert set(RECIPE_NAMES) == {"jetrl-unified", "bf16", "naive-fp8-rollout"}
    uni = Recipe.from_name("jetrl-unified")
    assert uni.train_fp8 and uni.rollout_fp8 and uni.weight_sync == "fp8-bytes"
    assert uni.train_activation == QuantSpec(Granularity.G1x128)
    assert uni.train_weight.granularity is Granularity.G128x128
    assert uni.train_wgrad.granularity is Granularity.G128x1
    assert uni.train_activation.eps == 1e-10 and uni.train_activation.scale_format is ScaleFormat.FP32
    assert uni.rollout_matches_training() == []
    bf16 = Recipe.from_name("bf16")
    assert not bf16.train_fp8 and not bf16.rollout_fp8 and bf16.rollout_matches_training() == []
    naive = Recipe.from_name("naive-fp8-rollout")
    assert not naive.train_fp8 and naive.rollout_weight.granularity is Granularity.PER_TENSOR
    diffs = naive.rollout_matches_training()
    assert len(diffs) == 2 and "per-tensor" in diffs[1] and "bf16" in diffs[1]


def test_recipe_is_frozen():
    uni = Recipe.from_name("jetrl-unified")
    with pytest.raises(dataclasses.FrozenInstanceError):
        uni.fp8_param = True


def test_unknown_name_and_fields():
    with pytest.raises(RecipeError, match=r"unknown recipe 'fp8'.*jetrl-unified"):
        Recipe.from_name("fp8")
    with pytest.raises(RecipeError, match=r"unknown Recipe field\(s\) \['fp8_params'\]"):
        Recipe.from_name("jetrl-unified", fp8_params=True)
    assert Recipe.from_name("jetrl-unified", fp8_param=True).fp8_param


@pytest.mark.parametrize(
    "changes,match",
    [
        ({"train_activation": QuantSpec(Granularity.PER_TOKEN)}, "train_activation must be 1x128"),
        ({"train_weight": QuantSpec(Granularity.G1x128)}, "train_weight must be 128x128"),
        ({"train_wgrad": None}, "dgrad and wgrad run in FP8"),
        ({"train_weight": None}, "both be set or both None"),
        ({"rollout_weight": QuantSpec(Granularity.G128x128, scale_format="pow2")}, "rollout_weight must equal"),
        ({"grad_dtype": "float32"}, "grad_dtype"),
        ({"weight_sync": "nccl"}, "weight_sync"),
    ],
    ids=lambda v: v if isinstance(v, str) else "-".join(v),
)
def test_invalid_combinations(changes, match):
    with pytest.raises(RecipeError, match=match):
        Recipe.from_name("jetrl-unified").replace(**changes)


def test_bf16_recipe_rejects_fp8_only_options():
    with pytest.raises(RecipeError, match="fp8_param needs an FP8 training forward"):
        Recipe.from_name("bf16", fp8_param=True)
    with pytest.raises(RecipeError, match="save_activations_fp8"):
        Recipe.from_name("naive-fp8-rollout", save_activations_fp8=True)


def test_quant_spec_validation_and_labels():
    with pytest.raises(RecipeError, match="float8_e5m2"):
        QuantSpec(Granularity.G1x128, dtype="float8_e5m2")
    with pytest.raises(ValueError):
        QuantSpec("2x64")
    spec = QuantSpec("1x128", scale_format="pow2", division="x*(1/s)")
    assert spec.scale_format is ScaleFormat.POW2 and spec.division is Division.RECIPROCAL
    assert "pow2" in spec.label() and "x*(1/s)" in spec.label()
    assert QuantSpec("1x128") != spec


@pytest.mark.parametrize(
    "name,kept",
    [
        ("model.embed_tokens", True),
        ("lm_head", True),
        ("model.layers.0.input_layernorm", False),
        ("model.norm", True),
        ("model.layers.3.mlp.gate", True),
        ("model.layers.3.mlp.gate_proj", False),
        ("model.layers.3.mlp.router", True),
        ("model.layers.3.self_attn.q_proj", False),
    ],
)
def test_keeps_bf16_matches_whole_components(name, kept):
    assert Recipe.from_name("jetrl-unified").keeps_bf16(name) is kept
