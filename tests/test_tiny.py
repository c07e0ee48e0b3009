"""The tiny Qwen3 model and the character tokenizer: dims, determinism, HF round trips."""

import json

import pytest
import torch

from jetrl.tiny import CharTokenizer, build_tiny_model, save_checkpoint, save_tiny_checkpoint, tiny_qwen3_config

TEXT = "12+ 3*4=Hello, World! (x-y)"


def test_every_projection_is_a_multiple_of_128():
    model = build_tiny_model(0)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "lm_head" not in n}
    assert len(linears) == 7 * model.config.num_hidden_layers
    for name, lin in linears.items():
        assert lin.in_features % 128 == 0 and lin.out_features % 128 == 0, (name, lin.weight.shape)
    assert model.config.tie_word_embeddings is False
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_config_rejects_dims_off_the_128_grid():
    with pytest.raises(ValueError, match="intermediate_size"):
        tiny_qwen3_config(intermediate_size=500)
    with pytest.raises(ValueError, match="q_proj"):
        tiny_qwen3_config(head_dim=64, num_attention_heads=3)


def test_build_is_deterministic_in_seed():
    a, b, c = build_tiny_model(3), build_tiny_model(3), build_tiny_model(4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.layers.0.mlp.up_proj.weight"], sc["model.layers.0.mlp.up_proj.weight"])


def test_char_tokenizer_round_trip_and_errors():
    tok = CharTokenizer()
    ids = tok.encode(TEXT)
    assert ids[0] == tok.bos_id and len(ids) == len(TEXT) + 1
    assert tok.decode(ids) == TEXT
    assert tok.encode("1", add_bos=False, add_eos=True) == [tok._ids["1"], tok.eos_id]
    with pytest.raises(ValueError, match="'#'"):
        tok.encode("a#b")
    with pytest.raises(ValueError, match="id 999"):
        tok.decode([999])


def test_checkpoint_loads_with_transformers_offline(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok = build_tiny_model(1), CharTokenizer()
    save_checkpoint(model, tok, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "qwen3" and cfg["vocab_size"] == len(tok)
    hf_tok = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert hf_tok(TEXT)["input_ids"] == tok.encode(TEXT)
    assert hf_tok.decode(tok.encode(TEXT), skip_special_tokens=True) == TEXT
    assert (hf_tok.pad_token_id, hf_tok.bos_token_id, hf_tok.eos_token_id) == (tok.pad_id, tok.bos_id, tok.eos_id)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True)
    ref = model.state_dict()
    for k, v in loaded.state_dict().items():
        assert v.dtype == torch.bfloat16 and torch.equal(v, ref[k]), k


def test_in_memory_model_equals_the_loaded_checkpoint(tmp_path):
    """build_tiny_model keeps RoPE frequencies in fp32 like from_pretrained, so logits agree bitwise."""
    from transformers import AutoModelForCausalLM

    model = build_tiny_model(0)
    loaded = AutoModelForCausalLM.from_pretrained(save_tiny_checkpoint(tmp_path / "ck", seed=0), dtype=torch.bfloat16)
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    ids = torch.tensor([[1, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)


CHAT = [{"role": "user", "content": "Compute the result. Reply with the number only. 12+7="}]


def test_chat_tokenizer_appends_chatml_tokens_and_keeps_every_other_id():
    plain, chat = CharTokenizer(), CharTokenizer(chat=True)
    assert chat.vocab[: len(plain)] == plain.vocab
    assert chat.vocab[len(plain) :] == ["\n", "<unk>", "<|im_start|>", "<|im_end|>"]
    assert chat.eos_id == chat._ids["<|im_end|>"] and chat.eos_token == "<|im_end|>"
    assert chat.encode(TEXT) == plain.encode(TEXT)
    assert chat.encode("a\nb", add_bos=False) == [chat._ids["a"], chat._ids["\n"], chat._ids["b"]]
    with pytest.raises(ValueError, match="'<', '>'"):  # text is characters: special tokens are not spelled
        chat.encode("<|im_end|>")
    with pytest.raises(ValueError, match="no chat template"):
        plain.encode_chat(CHAT)
    with pytest.raises(ValueError, match="message 0"):
        chat.encode_chat([{"role": "user", "content": "1", "name": "x"}])
    ids = chat.encode_chat(CHAT)
    assert chat.decode(ids) == "user\n" + CHAT[0]["content"] + "\nassistant\n"
    assert chat.decode(ids, skip_special=False).startswith("<|im_start|>user\n")
    assert tiny_qwen3_config(chat=True).vocab_size == len(chat)
    assert tiny_qwen3_config(chat=True).eos_token_id == chat.eos_id


def test_chat_checkpoint_renders_like_encode_chat_and_has_what_verl_needs(tmp_path):
    """The saved HF tokenizer's chat template gives `encode_chat`'s ids both ways verl tokenizes (rendered text
    without special tokens; apply_chat_template with tokenize=True), and it has what verl's qwen3 (ChatML)
    rollout requires: a single-token newline, ``<|im_end|>`` and an unknown-token entry."""
    from transformers import AutoTokenizer

    tok = CharTokenizer(chat=True)
    save_tiny_checkpoint(tmp_path, seed=0, chat=True)
    hf = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    text = hf.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\n" + CHAT[0]["content"] + "<|im_end|>\n<|im_start|>assistant\n"
    assert hf(text, add_special_tokens=False)["input_ids"] == tok.encode_chat(CHAT)
    out = hf.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    assert list(out["input_ids"] if hasattr(out, "keys") else out) == tok.encode_chat(CHAT)
    assert hf.encode("\n", add_special_tokens=False) == [tok._ids["\n"]]
    assert hf.convert_tokens_to_ids("<|im_end|>") == tok.eos_id == hf.eos_token_id
    assert hf.unk_token_id == tok._ids["<unk>"] and hf.convert_tokens_to_ids("<|not_a_token|>") == hf.unk_token_id
    gen = json.loads((tmp_path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tok.eos_id
