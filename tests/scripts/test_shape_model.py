"""scripts/shape_model.py: the shipped model shapes with fewer layers, and the chat tokenizer padded to the
model's vocabulary (every id decodes), written offline and loaded back with transformers."""

from __future__ import annotations

import json

import pytest
from scripts_cases import SCRIPTS, load_script

from jetrl.tiny import CharTokenizer

SMALL = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 2, "num_key_value_heads": 1}
"""Shrinks a shape for a CPU test (head_dim and the architecture stay)."""


@pytest.fixture(scope="module")
def sm():
    return load_script("shape_model")


def test_every_shipped_model_is_a_shape(sm):
    assert set(sm.SHAPES) == {"qwen3-0.6b", "llama3.1-8b", "qwen2.5-7b", "qwen3-8b-base"}


@pytest.mark.parametrize("shape", ["llama3.1-8b", "qwen2.5-7b", "qwen3-8b-base"])
def test_shape_is_the_shipped_config_with_fewer_layers_and_the_tokenizer_s_ids(sm, shape):
    shipped = json.loads((SCRIPTS.parent / "recipes" / "models" / shape / "config.json").read_text())
    cfg = sm.shape_config(shape, None, chat=True)
    assert cfg.model_type == shipped["model_type"] and cfg.num_hidden_layers == sm.DEFAULT_LAYERS
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size"):
        assert getattr(cfg, key) == shipped[key], key
    assert cfg.tie_word_embeddings == shipped.get("tie_word_embeddings", False)
    if shape == "llama3.1-8b":
        assert cfg.rope_scaling["rope_type"] == "llama3"
    tok = CharTokenizer(chat=True)
    assert (cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id) == (tok.pad_id, tok.bos_id, tok.eos_id)
    assert sm.shape_config(shape, shipped["num_hidden_layers"]).num_hidden_layers == shipped["num_hidden_layers"]


@pytest.mark.parametrize(
    ("shape", "layers", "match"),
    [("llama3.1-8b", 33, "has 32 decoder layers"), ("qwen3-0.6b", 0, ">= 1"), ("gpt2", None, "choose one of")],
)
def test_bad_shapes_are_named(sm, shape, layers, match):
    with pytest.raises(ValueError, match=match):
        sm.shape_config(shape, layers)


def test_padded_chat_tokenizer_keeps_every_id_and_decodes_the_fillers():
    base, padded = CharTokenizer(chat=True), CharTokenizer(chat=True, size=1000)
    assert len(padded) == 1000 and padded.vocab[: len(base)] == base.vocab
    assert padded.encode_chat([{"role": "user", "content": "1+2"}]) == base.encode_chat(
        [{"role": "user", "content": "1+2"}]
    )
    assert padded.encode('"$x"', add_bos=False) == [padded.vocab.index(c) for c in '"$x"']  # all ASCII punctuation
    assert padded.decode([5, 999]) == base.decode([5]) + padded.vocab[999] and padded.vocab[999].startswith("<|fill_")
    with pytest.raises(ValueError, match="size=10 is below"):
        CharTokenizer(chat=True, size=10)


@pytest.mark.parametrize("shape", ["llama3.1-8b", "qwen2.5-7b", "qwen3-8b-base"])
def test_written_model_loads_offline_with_its_architecture_and_every_id_decodes(sm, shape, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = sm.write_shape_model(tmp_path / shape, shape, 1, chat=True, device="cpu", vocab_size=1024, **SMALL)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    assert model.config.model_type == sm.shape_config(shape, 1).model_type and model.config.num_hidden_layers == 1
    hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
    assert len(hf) == model.config.vocab_size == 1024
    tok = CharTokenizer(chat=True, size=1024)
    assert hf.decode([1023, 5]) == tok.decode([1023, 5])
    messages = [{"role": "user", "content": 'What is $3 + 4$? Answer after "####".'}]
    ids = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids == tok.encode_chat(messages)  # also for Qwen2Tokenizer, which transformers forces on qwen2
    assert hf.eos_token == "<|im_end|>" and hf.eos_token_id == model.config.eos_token_id
    assert hf.model_max_length == model.config.max_position_embeddings


def test_a_reusable_model_dir_is_written_once_at_a_fixed_path(sm, monkeypatch, tmp_path):
    """vLLM's compile cache keys on the model path: a benchmark's model keeps one path and is written once; a
    folder left half-written (no marker) is written again."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    writes = []

    def write(d):
        writes.append(d.name)
        (d / "config.json").write_text("{}")

    first = sm.reusable_model_dir("m-l2-s0", write)
    assert first == tmp_path / "jetrl-bench-models" / "m-l2-s0" and (first / "config.json").is_file()
    assert sm.reusable_model_dir("m-l2-s0", write) == first and len(writes) == 1
    (first / ".complete").unlink()  # as if a run had died while writing
    assert sm.reusable_model_dir("m-l2-s0", write) == first and len(writes) == 2
    assert sorted(p.name for p in first.parent.iterdir()) == ["m-l2-s0"]  # no partial folder left
