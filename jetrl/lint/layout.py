"""The module layout of a decoder-only checkpoint, read from its ``config.json`` (no weights loaded).

The stock-vLLM builder needs the Linear shapes and module paths without starting an engine; this
module derives them for the dense Llama-family architectures vLLM and HF lay out the same way
(Qwen3, Qwen2, Llama, Mistral): per layer ``input_layernorm``, ``self_attn.{q,k,v,o}_proj`` (+
``q_norm``/``k_norm`` on Qwen3), ``post_attention_layernorm``, ``mlp.{gate,up,down}_proj`` and
``mlp.act_fn``; then ``model.norm`` and ``lm_head``. Paths are HF paths (the canonical names of the
precision graph). vLLM fuses ``q/k/v`` into ``qkv_proj`` and ``gate/up`` into ``gate_up_proj``
(`FUSED_LINEARS`); tensor parallelism splits column-parallel Linears along N and row-parallel ones
along K.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["LinearShape", "ModelLayout", "FUSED_LINEARS", "LayoutError", "read_config"]

FUSED_LINEARS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
"""vLLM's fused Linear -> the HF projections it concatenates along N (vLLM's packed_modules_mapping)."""

_SUPPORTED = ("qwen3", "qwen2", "llama", "mistral")


class LayoutError(ValueError):
    """The checkpoint's config cannot be laid out (unsupported architecture, missing field)."""


@dataclass(frozen=True)
class LinearShape:
    """One HF Linear: ``y[M, N] = x[M, K] @ W[N, K]^T``; `parallel` is vLLM's TP style."""

    module: str
    n: int
    k: int
    parallel: str
    """"column" (split along N), "row" (split along K) or "replicated" (lm_head: vocab-parallel)."""


def read_config(model_path: str | Path) -> dict[str, Any]:
    """The checkpoint's ``config.json`` as a dict; raises LayoutError naming the path if absent."""
    p = Path(model_path) / "config.json"
    if not p.is_file():
        raise LayoutError(f"{model_path}: no config.json (expected an HF checkpoint directory)")
    return json.loads(p.read_text())


@dataclass(frozen=True)
class ModelLayout:
    model_type: str
    num_layers: int
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    qk_norm: bool

    @staticmethod
    def from_config(cfg: dict[str, Any]) -> ModelLayout:
        mt = cfg.get("model_type", "")
        if mt not in _SUPPORTED:
            raise LayoutError(f"model_type {mt!r} is not supported by the lint's layout; supported: {_SUPPORTED}")
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            return ModelLayout(
                model_type=mt,
                num_layers=int(cfg["num_hidden_layers"]),
                hidden=hidden,
                intermediate=int(cfg["intermediate_size"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                vocab=int(cfg["vocab_size"]),
                qk_norm=mt == "qwen3",
            )
        except KeyError as e:
            raise LayoutError(f"config.json of a {mt} model lacks the field {e.args[0]!r}") from None

    def layer_prefix(self, i: int) -> str:
        return f"model.layers.{i}"

    def layer_linears(self, i: int) -> list[LinearShape]:
        p = self.layer_prefix(i)
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return [
            LinearShape(f"{p}.self_attn.q_proj", q, self.hidden, "column"),
            LinearShape(f"{p}.self_attn.k_proj", kv, self.hidden, "column"),
            LinearShape(f"{p}.self_attn.v_proj", kv, self.hidden, "column"),
            LinearShape(f"{p}.self_attn.o_proj", self.hidden, q, "row"),
            LinearShape(f"{p}.mlp.gate_proj", self.intermediate, self.hidden, "column"),
            LinearShape(f"{p}.mlp.up_proj", self.intermediate, self.hidden, "column"),
            LinearShape(f"{p}.mlp.down_proj", self.hidden, self.intermediate, "row"),
        ]

    def lm_head(self) -> LinearShape:
        return LinearShape("lm_head", self.vocab, self.hidden, "replicated")

    def tp_shard(self, lin: LinearShape, tp: int) -> int:
        """Size of one TP shard along the split dim (N for column-, K for row-parallel), as vLLM
        shards it: heads are split whole; KV heads are replicated when fewer than `tp`."""
        if tp == 1 or lin.parallel == "replicated":
            return lin.n if lin.parallel != "row" else lin.k
        leaf = lin.module.rsplit(".", 1)[-1]
        if leaf in ("k_proj", "v_proj"):
            if self.num_kv_heads >= tp:
                if self.num_kv_heads % tp:
                    raise LayoutError(f"{lin.module}: {self.num_kv_heads} KV heads do not split over TP={tp}")
                return self.num_kv_heads // tp * self.head_dim
            return self.head_dim  # vLLM replicates each KV head over tp / num_kv_heads ranks
        if leaf in ("q_proj", "o_proj"):
            if self.num_heads % tp:
                raise LayoutError(f"{lin.module}: {self.num_heads} attention heads do not split over TP={tp}")
            return self.num_heads // tp * self.head_dim
        full = lin.n if lin.parallel == "column" else lin.k
        if full % tp:
            raise LayoutError(f"{lin.module}: dim {full} does not split over TP={tp}")
        return full // tp
