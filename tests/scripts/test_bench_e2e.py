"""bench_e2e's CPU parts: the model shapes (Llama-3.1-8B from the shipped config, layers stated) and options."""

from __future__ import annotations

import json

import pytest
from scripts_cases import SCRIPTS, load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_e2e")


def test_llama_shape_is_the_shipped_config_with_fewer_layers(bench):
    shipped = json.loads((SCRIPTS.parent / "recipes" / "models" / "llama3.1-8b" / "config.json").read_text())
    cfg = bench.shape_config("llama3.1-8b", None)
    assert type(cfg).__name__ == "LlamaConfig" and cfg.num_hidden_layers == 8
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size"):
        assert getattr(cfg, key) == shipped[key], key
    assert cfg.tie_word_embeddings is False and cfg.rope_scaling["rope_type"] == "llama3"
    assert bench.shape_config("llama3.1-8b", 32).num_hidden_layers == 32
    assert bench.shape_config("qwen3-0.6b", None).num_hidden_layers == 28


@pytest.mark.parametrize(
    ("shape", "layers", "match"),
    [("llama3.1-8b", 33, "has 32 decoder layers"), ("qwen3-0.6b", 0, ">= 1"), ("gpt2", None, "choose one of")],
)
def test_bad_shapes_are_named(bench, shape, layers, match):
    with pytest.raises(ValueError, match=match):
        bench.shape_config(shape, layers)


def test_tiny_takes_no_shape(bench, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--tiny", "--layers", "2"])
    assert "--tiny is its own model" in capsys.readouterr().err
