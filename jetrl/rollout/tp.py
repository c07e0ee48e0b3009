"""Tensor-parallel slicing of a weight-sync payload: each rank of a TP vLLM engine gets its slice of the
trainer's FP8 bytes and 128x128 scales, cut on block boundaries, never re-quantized.

vLLM's Megatron-style layout (``vllm/model_executor/layers/linear.py``, ``vocab_parallel_embedding.py``),
for a `tp_size`-way engine and rank `r`:

- column-parallel Linears (``q_proj k_proj v_proj`` -> fused ``qkv_proj``, ``gate_proj up_proj`` ->
  ``gate_up_proj``): the weight ``[N, K]`` is split along N; rank r holds rows
  ``[r * N / tp, (r + 1) * N / tp)`` of every part, and its fused parameter stacks those slices in the
  ``packed_modules_mapping`` order (`jetrl.rollout.sync.plan_sync` does the stacking from the sliced
  payload). q is split by attention heads, k / v by key-value heads (GQA): each rank holds
  ``num_key_value_heads / tp`` of them. vLLM replicates kv heads when ``num_key_value_heads < tp``;
  that is refused here (a replicated head would be sent tp / kv times and placed by a second rule).
  A column-parallel bias is split like its rows.
- row-parallel Linears (``o_proj``, ``down_proj``): split along K; rank r holds columns
  ``[r * K / tp, (r + 1) * K / tp)``. The bias stays whole on every rank (vLLM adds it on rank 0 only).
- vocabulary embeddings / lm_head: vLLM pads the vocab to a multiple of ``vocab_padding`` (its
  ``DEFAULT_VOCAB_PADDING_SIZE``, from `jetrl.rollout.adapter`) and splits the padded rows evenly; rank r
  receives the real rows ``[r * P / tp, min((r + 1) * P / tp, vocab))`` (none for a shard of padding only).
- everything else that is 1-D (norms, Qwen3's ``q_norm`` / ``k_norm``): whole on every rank. Any other
  tensor (an MoE router or expert, an unknown 2-D weight) is refused, naming it: no rule, no guess.

Why slicing is exact. A 128x128 block quantization (NUMERICS.md section 1) gives each block its own
scale from its own values. When a slice starts and ends on multiples of 128 (rows for column-parallel,
columns for row-parallel), every block lies wholly inside one rank's slice, so the slice's bytes are
``q[a:b]`` and its scales are the scale grid's rows (or columns) ``[a / 128, b / 128)``: exactly what
quantizing the sliced weight would give, and ``dequant(slice) == slice(dequant)``. A boundary off a
multiple of 128 would cut a block whose one scale both ranks need: refused, naming the layer and its
dims (`tp_dims` makes the same check from a model's config before anything starts).
"""

from __future__ import annotations

from dataclasses import dataclass

from jetrl.recipe import BLOCK
from jetrl.rollout.sync import tensor_digests

__all__ = [
    "COLUMN_PARALLEL",
    "ROW_PARALLEL",
    "VOCAB_PARALLEL",
    "TPShapeError",
    "TPLayout",
    "TPRank",
    "tp_dims",
    "tp_slice",
    "tp_slice_payload",
    "payload_digests",
]

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
"""HF Linear names vLLM splits along N (output rows)."""
ROW_PARALLEL = ("o_proj", "down_proj")
"""HF Linear names vLLM splits along K (input columns)."""
VOCAB_PARALLEL = ("embed_tokens", "lm_head")
"""HF module names of the vocabulary-parallel embedding and head."""


class TPShapeError(ValueError):
    """A model's shapes do not allow the requested tensor-parallel split of its FP8 weights."""


@dataclass(frozen=True)
class TPLayout:
    """The model facts a tensor-parallel split depends on (from the HF config)."""

    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int

    @classmethod
    def from_hf_config(cls, hf: dict) -> TPLayout:
        """From a ``config.json`` dict (a multimodal config's ``text_config`` is used when present);
        `TPShapeError` names a missing key."""
        hf = hf.get("text_config", hf)
        try:
            heads = hf["num_attention_heads"]
            return cls(
                num_attention_heads=heads,
                num_key_value_heads=hf.get("num_key_value_heads") or heads,
                head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
                hidden_size=hf["hidden_size"],
                intermediate_size=hf["intermediate_size"],
            )
        except KeyError as e:
            raise TPShapeError(f"model config: missing {e.args[0]!r}, needed for the tensor-parallel split") from e

    def full_dims(self) -> dict[str, int]:
        """Every TP-split dimension, named by the Linears it belongs to."""
        return {
            "num_attention_heads*head_dim (q_proj N, o_proj K)": self.num_attention_heads * self.head_dim,
            "num_key_value_heads*head_dim (k_proj/v_proj N)": self.num_key_value_heads * self.head_dim,
            "intermediate_size (gate_proj/up_proj N, down_proj K)": self.intermediate_size,
        }


@dataclass(frozen=True)
class TPRank:
    """One worker of a tensor-parallel engine (`jetrl.rollout.adapter.model_tensor_parallel` reads it)."""

    size: int
    rank: int
    layout: TPLayout
    vocab_padding: int
    """vLLM pads the vocabulary to a multiple of this before splitting it (``DEFAULT_VOCAB_PADDING_SIZE``)."""

    def slice_payload(self, payload: dict) -> dict:
        """`tp_slice_payload` for this worker (the payload itself when the engine is not tensor parallel)."""
        if self.size == 1:
            return payload
        return tp_slice_payload(payload, self.size, self.rank, self.layout, vocab_padding=self.vocab_padding)


def tp_dims(layout: TPLayout, tp_size: int, *, block: int | None = BLOCK) -> dict[str, int]:
    """Per-rank size of every TP-split dimension of `layout` at `tp_size`. Refuses (`TPShapeError` naming
    the dimension) heads that do not split evenly, fewer kv heads than ranks, and -- unless ``block=None``
    (a BF16 rollout) -- a per-rank size that is not a multiple of `block` (128x128 FP8 weights)."""
    if tp_size < 1:
        raise TPShapeError(f"tensor-parallel size {tp_size}: must be >= 1")
    if layout.num_attention_heads % tp_size:
        raise TPShapeError(
            f"num_attention_heads={layout.num_attention_heads} does not split over tensor-parallel size {tp_size}"
        )
    if layout.num_key_value_heads < tp_size or layout.num_key_value_heads % tp_size:
        raise TPShapeError(
            f"num_key_value_heads={layout.num_key_value_heads} does not split over tensor-parallel size {tp_size} "
            "(fewer kv heads than ranks would replicate them, which jetrl's sliced FP8 sync does not do)"
        )
    out = {}
    for name, full in layout.full_dims().items():
        if full % tp_size or (block and (full // tp_size) % block):
            raise TPShapeError(
                f"{name}={full}: {full} / tensor-parallel size {tp_size} = {full / tp_size:g} rows per rank, not a "
                f"multiple of {block}; the 128x128 FP8 weight blocks (and their scales) would be cut between ranks"
            )
        out[name] = full // tp_size
    return out


def _leaf_module(name: str) -> str:
    return name.rpartition(".")[0].rpartition(".")[2]


def _expected_full(layout: TPLayout, leaf: str) -> int:
    if leaf in ("q_proj", "o_proj"):
        return layout.num_attention_heads * layout.head_dim
    if leaf in ("k_proj", "v_proj"):
        return layout.num_key_value_heads * layout.head_dim
    return layout.intermediate_size


def _cut(name: str, full: int, tp_size: int, rank: int, fp8: bool, what: str) -> tuple[int, int]:
    if full % tp_size or (fp8 and (full // tp_size) % BLOCK):
        raise TPShapeError(
            f"{name}: {what}={full} splits into {full / tp_size:g} per rank at tensor-parallel size {tp_size}; "
            f"its FP8 128x128 blocks need a multiple of {BLOCK} per rank"
            if fp8
            else f"{name}: {what}={full} does not split over tensor-parallel size {tp_size}"
        )
    per = full // tp_size
    return rank * per, (rank + 1) * per


def tp_slice(name: str, value, tp_size: int, rank: int, layout: TPLayout, *, vocab_padding: int):
    """Rank `rank`'s part of one payload entry (a tensor, or ``(q e4m3 [N, K], s fp32 [N/128, K/128])``),
    contiguous, as vLLM's rank holds it (module docstring). Raises `TPShapeError` naming the tensor."""
    if not 0 <= rank < tp_size:
        raise TPShapeError(f"tensor-parallel rank {rank} is outside [0, {tp_size})")
    fp8 = isinstance(value, tuple)
    w = value[0] if fp8 else value
    leaf, pname = _leaf_module(name), name.rpartition(".")[2]
    linear = leaf in COLUMN_PARALLEL + ROW_PARALLEL
    if ".experts." in name or (w.dim() >= 2 and not linear and leaf not in VOCAB_PARALLEL):
        raise TPShapeError(f"{name} {tuple(w.shape)}: jetrl has no tensor-parallel rule for this tensor")
    if tp_size == 1 or (w.dim() < 2 and not linear):
        return value  # norms: whole on every rank
    if leaf in VOCAB_PARALLEL:
        if fp8:
            raise TPShapeError(f"{name}: a vocabulary-parallel tensor arrived as fp8 bytes")
        vocab = w.shape[0]
        per = -(-vocab // vocab_padding) * vocab_padding // tp_size
        lo, hi = min(rank * per, vocab), min((rank + 1) * per, vocab)
        return w[lo:hi].contiguous()  # empty for a rank whose shard is all padding
    if leaf in COLUMN_PARALLEL:
        want = _expected_full(layout, leaf)
        if w.shape[0] != want:
            raise TPShapeError(f"{name}: {w.shape[0]} rows, but the model config gives {leaf} N={want}")
        lo, hi = _cut(name, want, tp_size, rank, fp8, f"{leaf} N")
        if fp8:
            return value[0][lo:hi].contiguous(), value[1][lo // BLOCK : hi // BLOCK].contiguous()
        return w[lo:hi].contiguous()
    # row-parallel
    if pname == "bias":
        return w
    want = _expected_full(layout, leaf)
    if w.dim() != 2 or w.shape[1] != want:
        raise TPShapeError(f"{name}: shape {tuple(w.shape)}, but the model config gives {leaf} K={want}")
    lo, hi = _cut(name, want, tp_size, rank, fp8, f"{leaf} K")
    if fp8:
        return value[0][:, lo:hi].contiguous(), value[1][:, lo // BLOCK : hi // BLOCK].contiguous()
    return w[:, lo:hi].contiguous()


def tp_slice_payload(payload: dict, tp_size: int, rank: int, layout: TPLayout, *, vocab_padding: int) -> dict:
    """`tp_slice` of every entry of a sync payload (HF name -> tensor or (q, s)), same names: what rank
    `rank` of a `tp_size`-way engine installs (`jetrl.rollout.sync.install_payload` places the parts into
    its fused ``qkv_proj`` / ``gate_up_proj``). Checks `tp_dims` first, so a model that cannot split fails
    naming the dimension before any tensor is cut."""
    fp8 = any(isinstance(v, tuple) for v in payload.values())
    tp_dims(layout, tp_size, block=BLOCK if fp8 else None)
    return {n: tp_slice(n, v, tp_size, rank, layout, vocab_padding=vocab_padding) for n, v in payload.items()}


def payload_digests(payload: dict) -> dict[str, str]:
    """`jetrl.rollout.sync.tensor_digest` of every tensor of a payload (an fp8 entry's scales under
    ``<name>:scales``): with `tp_slice_payload`, what each rank must hold after its install."""
    flat = {}
    for name, v in payload.items():
        if isinstance(v, tuple):
            flat[name], flat[f"{name}:scales"] = v
        else:
            flat[name] = v
    return tensor_digests(flat)
