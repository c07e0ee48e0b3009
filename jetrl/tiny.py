"""A tiny Qwen3-architecture model and a character tokenizer, built from nothing (no downloads).

Used by the CPU tests, the demo trainer and the lint to exercise the whole FP8 path end to end:
every projection's N and K is a multiple of 128 (hidden 256, intermediate 512, 2 query heads and
1 KV head of head_dim 128), so each Linear takes the 128x128 weight blocks without padding and
vLLM's fused `qkv_proj` ([q; k; v] = 256 + 128 + 128 rows) and `gate_up_proj` (512 + 512 rows)
split on block boundaries.

| Linear | N | K |
|---|---|---|
| q_proj / o_proj | 256 | 256 |
| k_proj / v_proj | 128 | 256 |
| gate_proj / up_proj | 512 | 256 |
| down_proj | 256 | 512 |

The tokenizer maps one character to one token (digits, ``+ - * =``, space, ASCII letters, a few
punctuation marks) plus ``<pad>``, ``<s>``, ``</s>``. `CharTokenizer.save` writes it as an HF
fast tokenizer (``tokenizer.json`` built with the `tokenizers` library, ``tokenizer_config.json``)
that `transformers.AutoTokenizer` and vLLM load offline; its ids equal `CharTokenizer.encode`'s.

``CharTokenizer(chat=True)`` is the same vocabulary with four tokens appended (so every other id is
unchanged): ``"\n"``, ``<unk>``, ``<|im_start|>`` and ``<|im_end|>``, a ChatML ``chat_template`` and
``<|im_end|>`` as its end of sequence. verl treats a ``qwen3`` checkpoint as a ChatML model (its rollout
needs ``<|im_end|>``, a single-token ``"\n"`` and an unknown-token entry); this is the tokenizer of the
tiny model a verl run trains (`tiny_qwen3_config(chat=True)`, ``jetrl warmup --format chat``).
"""

from __future__ import annotations

import json
import os
import string
from pathlib import Path

import torch

__all__ = [
    "CharTokenizer",
    "TINY_DEFAULTS",
    "tiny_qwen3_config",
    "build_tiny_model",
    "save_checkpoint",
    "save_tiny_checkpoint",
]

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
NEWLINE, UNK, IM_START, IM_END = "\n", "<unk>", "<|im_start|>", "<|im_end|>"
CHAT_EXTRA = (NEWLINE, UNK, IM_START, IM_END)
"""Appended to the vocabulary by ``CharTokenizer(chat=True)``, in this order."""
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""ChatML without a system turn or thinking block (what `CharTokenizer.encode_chat` produces)."""
_CHARS = string.digits + "+-*=" + " " + string.ascii_lowercase + string.ascii_uppercase + ".,:;?!()"
_MORE_CHARS = [c for c in string.punctuation if c not in _CHARS]

TINY_DEFAULTS: dict = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 128,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "initializer_range": 0.1,  # logits std ~1.6 at init: peaked enough that quantization shows in logp
}
"""Qwen3Config fields of the tiny model (vocab and special-token ids come from `CharTokenizer`)."""


class CharTokenizer:
    """One token per character. Ids: 0 ``<pad>``, 1 ``<s>``, 2 ``</s>``, then `_CHARS` in order; with
    `chat`, then `CHAT_EXTRA` (end of sequence ``<|im_end|>``).

    With `size` (the tokenizer of a random-weight model whose embedding has more rows than there are
    characters): then the rest of ASCII's punctuation (`_MORE_CHARS`, so real datasets' prompts encode), then
    filler tokens ``<|fill_N|>`` (no text encodes to them) up to `size` entries, so every sampled id decodes;
    saved as a byte-level BPE without merges (same ids), which tokenizer classes that rebuild a byte-level BPE
    from the vocabulary (transformers' ``Qwen2Tokenizer``, forced for ``model_type`` qwen2) load unchanged."""

    def __init__(self, chat: bool = False, size: int | None = None) -> None:
        self.chat = chat
        self.byte_level = size is not None
        self.vocab: list[str] = [PAD, BOS, EOS, *_CHARS, *(CHAT_EXTRA if chat else ())]
        if size is not None:
            self.vocab += _MORE_CHARS
            if size < len(self.vocab):
                raise ValueError(f"CharTokenizer: size={size} is below the {len(self.vocab)} tokens it needs")
            self.vocab += [f"<|fill_{i}|>" for i in range(size - len(self.vocab))]
        self._ids = {tok: i for i, tok in enumerate(self.vocab)}
        self._special = {PAD, BOS, EOS, UNK, IM_START, IM_END} & set(self.vocab)
        self.pad_id, self.bos_id = 0, 1
        self.eos_token = IM_END if chat else EOS
        self.eos_id = self._ids[self.eos_token]
        self.pad_token, self.bos_token = PAD, BOS

    def __len__(self) -> int:
        return len(self.vocab)

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str, *, add_bos: bool = True, add_eos: bool = False) -> list[int]:
        """Token ids of `text`; raises ValueError naming any character outside the vocabulary."""
        bad = sorted({c for c in text if c not in self._ids or c in self._special})
        if bad:
            chars = _CHARS + (NEWLINE if self.chat else "")
            raise ValueError(f"CharTokenizer.encode: characters {bad!r} are not in the vocabulary {chars!r}")
        ids = [self._ids[c] for c in text]
        return ([self.bos_id] if add_bos else []) + ids + ([self.eos_id] if add_eos else [])

    def encode_chat(self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True) -> list[int]:
        """Ids of `messages` rendered with `CHAT_TEMPLATE` (no ``<s>``: verl and vLLM tokenize a rendered chat
        without special tokens); equal to the saved HF tokenizer's ``apply_chat_template(..., tokenize=True)``."""
        if not self.chat:
            raise ValueError("CharTokenizer.encode_chat: this tokenizer has no chat template (use chat=True)")
        start, end, nl = self._ids[IM_START], self._ids[IM_END], self._ids[NEWLINE]
        ids: list[int] = []
        for i, m in enumerate(messages):
            if set(m) != {"role", "content"}:
                raise ValueError(f"CharTokenizer.encode_chat: message {i} needs exactly 'role' and 'content', got {m}")
            ids += [start, *self.encode(m["role"], add_bos=False), nl]
            ids += [*self.encode(m["content"], add_bos=False), end, nl]
        if add_generation_prompt:
            ids += [start, *self.encode("assistant", add_bos=False), nl]
        return ids

    def decode(self, ids, *, skip_special: bool = True) -> str:
        """Text of `ids`; special tokens dropped unless `skip_special=False`."""
        out = []
        for i in ids:
            i = int(i)
            if not 0 <= i < len(self.vocab):
                raise ValueError(f"CharTokenizer.decode: id {i} outside [0, {len(self.vocab)})")
            if skip_special and self.vocab[i] in self._special:
                continue
            out.append(self.vocab[i])
        return "".join(out)

    def to_hf_tokenizer_json(self) -> str:
        """The ``tokenizer.json`` text of an equivalent `tokenizers` fast tokenizer."""
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

        if self.byte_level:  # one byte per character: each is its own token, as no merge joins two
            from transformers.convert_slow_tokenizer import bytes_to_unicode

            b2u = bytes_to_unicode()
            vocab = {(t if t in self._special or len(t) > 1 else b2u[ord(t)]): i for t, i in self._ids.items()}
            tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK if self.chat else None))
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
            tok.decoder = decoders.ByteLevel()
        else:
            tok = Tokenizer(models.WordLevel(vocab=dict(self._ids), unk_token=UNK if self.chat else None))
            # every character is its own pre-token (space and newline included): WordLevel sees single characters
            tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
            tok.decoder = decoders.Fuse()
        specials = [t for t in self.vocab if t in self._special]
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, self.bos_id)]
        )
        return tok.to_str(pretty=True)

    def save(self, path: str | os.PathLike, model_max_length: int = TINY_DEFAULTS["max_position_embeddings"]) -> None:
        """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json`` into `path`."""
        p = Path(path)
        p.mkdir(parents=True, exist_ok=True)
        (p / "tokenizer.json").write_text(self.to_hf_tokenizer_json())
        specials = {"bos_token": BOS, "eos_token": self.eos_token, "pad_token": PAD}
        if self.chat:
            specials["unk_token"] = UNK
        cfg = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "unk_token": None,
            **specials,
            "add_bos_token": True,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": model_max_length,
        }
        if self.chat:
            cfg["chat_template"] = CHAT_TEMPLATE
        (p / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
        (p / "special_tokens_map.json").write_text(json.dumps(specials, indent=2))


def tiny_qwen3_config(chat: bool = False, **overrides):
    """`transformers.Qwen3Config` of the tiny model (vocabulary of ``CharTokenizer(chat)``); `overrides`
    replace `TINY_DEFAULTS` fields.

    Raises ValueError if an override breaks the multiple-of-128 rule for some projection."""
    from transformers import Qwen3Config

    tok = CharTokenizer(chat)
    kw = {
        **TINY_DEFAULTS,
        "architectures": ["Qwen3ForCausalLM"],  # what build_tiny_model builds (a saved checkpoint says so too)
        "vocab_size": tok.vocab_size,
        "pad_token_id": tok.pad_id,
        "bos_token_id": tok.bos_id,
        "eos_token_id": tok.eos_id,
        **overrides,
    }
    h, i, d = kw["hidden_size"], kw["intermediate_size"], kw["head_dim"]
    dims = {
        "hidden_size": h,
        "intermediate_size": i,
        "q_proj N (num_attention_heads*head_dim)": kw["num_attention_heads"] * d,
        "k_proj N (num_key_value_heads*head_dim)": kw["num_key_value_heads"] * d,
    }
    bad = {k: v for k, v in dims.items() if v % 128}
    if bad:
        raise ValueError(f"tiny_qwen3_config: every projection N and K must be a multiple of 128; got {bad}")
    cfg = Qwen3Config(**kw)
    cfg.dtype = torch.bfloat16
    return cfg


def build_tiny_model(seed: int, chat: bool = False, **overrides):
    """A randomly initialised `Qwen3ForCausalLM` (bf16, eval mode) from `tiny_qwen3_config(chat, **overrides)`.

    Deterministic in `seed` (the global torch RNG is forked, not disturbed)."""
    from transformers import Qwen3ForCausalLM

    cfg = tiny_qwen3_config(chat, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(cfg)
    # `.to(bf16)` would also round the fp32 RoPE frequencies, which `from_pretrained(dtype=bf16)` keeps
    # in fp32: an in-memory model would then differ from the same weights loaded from disk
    rope = {n: b.clone() for n, b in model.named_buffers() if n.endswith("inv_freq")}
    model = model.to(torch.bfloat16)
    for n, b in rope.items():
        owner, _, leaf = n.rpartition(".")
        model.get_submodule(owner).register_buffer(leaf, b, persistent=False)
        if hasattr(model.get_submodule(owner), "original_inv_freq"):
            model.get_submodule(owner).original_inv_freq = b.clone()
    return model.eval()


def save_checkpoint(model, tokenizer: CharTokenizer, path: str | os.PathLike) -> Path:
    """Write an HF checkpoint dir: config.json, model.safetensors (bf16), generation_config.json and
    the tokenizer files (``model_max_length`` the model's ``max_position_embeddings``). Returns the path."""
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    bad = [n for n, t in model.state_dict().items() if t.is_floating_point() and t.dtype != torch.bfloat16]
    if bad:
        raise ValueError(f"save_checkpoint: expected bf16 weights, found other dtypes in {bad[:5]}")
    model.config.dtype = torch.bfloat16
    model.save_pretrained(p, safe_serialization=True)
    tokenizer.save(p, model_max_length=model.config.max_position_embeddings)
    return p


def save_tiny_checkpoint(path: str | os.PathLike, seed: int = 0, chat: bool = False, **overrides) -> Path:
    """`build_tiny_model(seed, chat, **overrides)` + `CharTokenizer(chat)` written with `save_checkpoint`."""
    return save_checkpoint(build_tiny_model(seed, chat, **overrides), CharTokenizer(chat), path)
