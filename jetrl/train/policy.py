"""The trainer's side of the policy: token batches, log-probs under the model, and the optimizer.

Batches. A sample is ``prompt_ids + response_ids``; a batch right-pads samples to one length ``L`` and
scores position ``t`` (predicting token ``t + 1``), so every token-level tensor is ``[N, L - 1]`` with
``mask[i, t] = 1`` exactly where token ``t + 1`` of sample ``i`` is a response token. The rollout
engine's per-token log-probs are laid out the same way, so `jetrl.train.algo` compares them directly.

Micro-batches. `micro_batches` splits a mini-batch's rows into forward/backward chunks: a fixed number
of sequences each, or (with a token budget) sorted by length and packed so that each chunk's padded
size ``n_seqs * longest`` stays within the budget. `TokenBatch.trim` then cuts a chunk to the width of
its longest sequence, so short sequences are not computed at the width of the longest in the batch.

Mixed precision (Megatron style). The model computes in BF16 (the rollout engine's dtype, so that a
BF16 recipe's trainer and engine see the same weights); `MixedPrecisionAdamW` keeps an fp32 master
copy of every trainable parameter and its AdamW state, accumulates gradients in fp32 ``main_grad``
buffers (a `jetrl.linear.JetFP8Linear` writes its FP8 wgrad there directly; every other parameter's
BF16 gradient is added by a post-accumulate hook), steps the masters and copies them back into the
BF16 parameters. The copy is an in-place write, so each JetFP8Linear re-quantizes its weight once per
optimizer step (its cache key is the parameter's version counter).

Attention (``model.attn_implementation: sdpa_causal``, `use_causal_sdpa`). Rows are right-padded, so a
causal mask alone keeps each row's padding away from its real tokens: the model can attend with SDPA's
``is_causal`` kernels and no mask at all. transformers' own SDPA path hands SDPA a 4D mask for padded rows
under CUDA-graph capture (its mask skipping is off while it traces), which sends SDPA to its masked
memory-efficient kernels: on an H200 at a Llama-3.1-8B micro-batch (4 x 2064) one layer's attention takes
9.7 ms forward+backward that way and 2.4 ms through the causal FlashAttention kernel
(``scripts/bench_attention.py``), so ``sdpa_causal`` is the default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from .algo import entropy_from_logits, token_logprobs, token_logprobs_and_entropy

__all__ = [
    "CAUSAL_SDPA",
    "TokenBatch",
    "make_batch",
    "micro_batches",
    "forward_logprobs",
    "use_causal_sdpa",
    "MixedPrecisionAdamW",
]

CAUSAL_SDPA = "jetrl_causal_sdpa"
"""The transformers attention implementation `use_causal_sdpa` registers."""


@dataclass
class TokenBatch:
    input_ids: torch.Tensor
    """[N, L] int64, right-padded."""
    attention_mask: torch.Tensor
    """[N, L] int64, 1 on real tokens."""
    targets: torch.Tensor
    """[N, L-1]: ``input_ids[:, 1:]``."""
    mask: torch.Tensor
    """[N, L-1] float32, 1 where the target is a response token."""
    rollout_logp: torch.Tensor
    """[N, L-1] float32, the engine's log-prob of each response token (0 elsewhere)."""
    response_len: torch.Tensor
    """[N] int64."""

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, idx: torch.Tensor | list[int]) -> TokenBatch:
        idx = torch.as_tensor(idx, dtype=torch.long)
        return TokenBatch(*(getattr(self, f)[idx] for f in self.__dataclass_fields__))

    def trim(self, width: int | None = None) -> TokenBatch:
        """The same rows cut to the width ``w`` of their longest sequence (``attention_mask.sum(1).max()``):
        input_ids and attention_mask ``[N, L] -> [N, w]``; targets, mask and rollout_logp
        ``[N, L-1] -> [N, w-1]``; response_len ``[N]`` unchanged. Padding is on the right, so every
        real token, mask entry and log-prob is kept; position ``t < w-1`` of the result is position
        ``t`` of this batch (write results back with ``full[rows, :w-1] = part``).

        ``width``: that longest length when the caller knows it from host-side lengths, which spares
        reading it from the (device) mask: a device sync before every micro-batch's forward."""
        w = int(self.attention_mask.sum(dim=1).max()) if width is None else width
        return TokenBatch(
            self.input_ids[:, :w],
            self.attention_mask[:, :w],
            self.targets[:, : w - 1],
            self.mask[:, : w - 1],
            self.rollout_logp[:, : w - 1],
            self.response_len,
        )


def make_batch(
    prompts: list[list[int]], responses: list[list[int]], response_logprobs: list[list[float]], pad_id: int
) -> TokenBatch:
    """Pack samples (token ids and the engine's per-token log-probs) into a `TokenBatch`."""
    if not (len(prompts) == len(responses) == len(response_logprobs)) or not prompts:
        raise ValueError(
            f"make_batch: {len(prompts)} prompts, {len(responses)} responses, {len(response_logprobs)} logprob lists"
        )
    n = len(prompts)
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses, strict=True)]
    seq = max(lengths)
    ids = torch.full((n, seq), pad_id, dtype=torch.long)
    attn = torch.zeros((n, seq), dtype=torch.long)
    mask = torch.zeros((n, seq - 1), dtype=torch.float32)
    rlp = torch.zeros((n, seq - 1), dtype=torch.float32)
    for i, (p, r, lp) in enumerate(zip(prompts, responses, response_logprobs, strict=True)):
        if len(lp) != len(r):
            raise ValueError(f"make_batch: sample {i} has {len(r)} response tokens but {len(lp)} log-probs")
        if not p:
            raise ValueError(f"make_batch: sample {i} has an empty prompt")
        ids[i, : len(p) + len(r)] = torch.tensor(p + r, dtype=torch.long)
        attn[i, : len(p) + len(r)] = 1
        if r:
            mask[i, len(p) - 1 : len(p) - 1 + len(r)] = 1.0
            rlp[i, len(p) - 1 : len(p) - 1 + len(r)] = torch.tensor(lp, dtype=torch.float32)
    return TokenBatch(ids, attn, ids[:, 1:].clone(), mask, rlp, torch.tensor([len(r) for r in responses]))


def micro_batches(lengths: list[int], idx: list[int], *, max_seqs: int, max_tokens: int | None) -> list[list[int]]:
    """Split the rows `idx` of a batch into micro-batches (one forward/backward each).

    `lengths[i]` is row ``i``'s real length (prompt + response tokens; indexed by row, so `idx` may be
    any subset). With ``max_tokens=None``: consecutive chunks of `max_seqs` rows in the order of `idx`.
    With a budget: the rows sorted by length, longest first (ties by row index), packed greedily so
    that a micro-batch has at most `max_seqs` rows and ``n_rows * longest <= max_tokens`` (its padded
    size once trimmed, see `TokenBatch.trim`). Deterministic. Raises ValueError (naming
    ``algo.micro_batch_tokens``) if one sequence alone is longer than the budget.
    """
    if max_seqs < 1:
        raise ValueError(f"micro_batches: max_seqs={max_seqs} must be >= 1")
    if max_tokens is None:
        return [idx[i : i + max_seqs] for i in range(0, len(idx), max_seqs)]
    out: list[list[int]] = []
    cur: list[int] = []
    for i in sorted(idx, key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        if n > max_tokens:
            raise ValueError(
                f"algo.micro_batch_tokens: row {i} is a sequence of {n} tokens (prompt + response), longer than "
                f"the budget of {max_tokens} tokens per micro-batch; raise algo.micro_batch_tokens to >= {n}"
            )
        # rows come longest first, so cur[0] is the longest of the current micro-batch
        if cur and (len(cur) == max_seqs or (len(cur) + 1) * lengths[cur[0]] > max_tokens):
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    return out


_OTHER_ATTN = "set model.attn_implementation to 'sdpa' or 'eager' (transformers' masked attention)"


def _causal_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' attention-function contract: q ``[B, H, S, D]``, k/v ``[B, Hkv, S, D]`` -> ``[B, S, H, D]``;
    the mask is not read (`use_causal_sdpa`)."""
    name = f"{CAUSAL_SDPA} (layer {getattr(module, 'layer_idx', '?')})"
    if dropout:
        raise ValueError(f"{name}: dropout={dropout}; the trainer attends without dropout")
    if kwargs.get("sliding_window") is not None:
        raise ValueError(f"{name}: a sliding window of {kwargs['sliding_window']}; causal SDPA attends to every key")
    for arg in ("softcap", "s_aux"):  # Gemma's logit soft-capping, gpt-oss's attention sinks
        if kwargs.get(arg) is not None:
            raise ValueError(f"{name}: the model passes {arg}, which causal SDPA cannot apply; {_OTHER_ATTN}")
    if query.shape[2] != key.shape[2]:
        raise ValueError(f"{name}: {query.shape[2]} queries over {key.shape[2]} keys (no KV cache in training)")
    out = torch.nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        is_causal=True,
        scale=scaling if scaling is not None else module.scaling,
        enable_gqa=key.shape[1] != query.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


def _no_mask(*args, **kwargs) -> None:
    return None


def use_causal_sdpa(model: nn.Module) -> None:
    """Make a loaded transformers decoder attend with causal SDPA and no mask, in place (module docstring):
    for right-padded rows (`make_batch`, `TokenBatch`) every real token's attention is the masked one, the
    padding's own outputs are read by no target. No mask is built, in eager mode or under graph capture.
    Raises ValueError naming the layer where a model needs more than a causal mask (sliding window)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    cfg = model.config
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", False):
        raise ValueError(
            f"model.attn_implementation='sdpa_causal': {type(model).__name__} uses sliding windows; {_OTHER_ATTN}"
        )
    # registration happens here, in the set-up that asks for it, not at import
    AttentionInterface.register(CAUSAL_SDPA, _causal_sdpa)
    AttentionMaskInterface.register(CAUSAL_SDPA, _no_mask)
    model.set_attn_implementation(CAUSAL_SDPA)


def forward_logprobs(
    model: nn.Module, batch: TokenBatch, *, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs ``[N, L-1]`` of the batch's targets (and entropies) under ``logits / T``; by the
    model's ``_jetrl_token_logprobs`` where it has one (strict numerics: `jetrl.rollout.engine_strict`)."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits[:, :-1]
    if temperature != 1.0:
        logits = logits.float() / temperature
    strict = getattr(model, "_jetrl_token_logprobs", None)
    if with_entropy and strict is None:
        return token_logprobs_and_entropy(logits, batch.targets)
    logp = (strict or token_logprobs)(logits, batch.targets)
    return logp, entropy_from_logits(logits) if with_entropy else None


class MixedPrecisionAdamW:
    """AdamW on fp32 masters of BF16 model parameters, with fp32 gradient accumulation (see module doc)."""

    def __init__(
        self,
        model: nn.Module,
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        grad_clip: float = 0.0,
        lr_warmup_steps: int = 0,
    ):
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("MixedPrecisionAdamW: the model has no trainable parameter")
        self.masters = [p.detach().to(torch.float32).clone().requires_grad_(True) for p in self.params]
        self.base_lr, self.grad_clip, self.lr_warmup_steps = lr, grad_clip, lr_warmup_steps
        self.opt = torch.optim.AdamW(self.masters, lr=lr, betas=betas, weight_decay=weight_decay)
        self.steps = 0
        self._hooks = []
        for p in self.params:
            p.main_grad = torch.zeros_like(p, dtype=torch.float32)
            self._hooks.append(p.register_post_accumulate_grad_hook(self._accumulate))

    @staticmethod
    def _accumulate(p: torch.Tensor) -> None:
        if p.grad is None:  # a JetFP8Linear weight: its wgrad went into main_grad directly
            return
        p.main_grad.add_(p.grad.to(torch.float32))
        p.grad = None

    def zero_grad(self) -> None:
        for p in self.params:
            p.main_grad.zero_()
            p.grad = None

    def lr(self) -> float:
        if self.lr_warmup_steps and self.steps < self.lr_warmup_steps:
            return self.base_lr * (self.steps + 1) / self.lr_warmup_steps
        return self.base_lr

    @torch.no_grad()
    def step(self) -> float:
        """One optimizer step from the accumulated gradients; returns the global grad norm (pre-clip).
        Raises FloatingPointError on a non-finite gradient norm (nothing is updated then)."""
        for m, p in zip(self.masters, self.params, strict=True):
            m.grad = p.main_grad
        norm_t = torch.nn.utils.get_total_norm([m.grad for m in self.masters])
        norm = float(norm_t)
        if not math.isfinite(norm):
            raise FloatingPointError(f"MixedPrecisionAdamW: non-finite gradient norm {norm}; step skipped")
        if self.grad_clip > 0:
            torch.nn.utils.clip_grads_with_norm_(self.masters, self.grad_clip, norm_t)
        for g in self.opt.param_groups:
            g["lr"] = self.lr()
        self.opt.step()
        for m, p in zip(self.masters, self.params, strict=True):
            p.copy_(m)  # in place: bumps the version counter, so FP8 weight caches re-quantize
            m.grad = None
        self.steps += 1
        self.zero_grad()
        return norm

    def state_dict(self) -> dict:
        return {
            "masters": [m.detach().clone() for m in self.masters],
            "opt": self.opt.state_dict(),
            "steps": self.steps,
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        masters = state["masters"]
        if len(masters) != len(self.masters):
            raise ValueError(f"optimizer state has {len(masters)} masters, the model {len(self.masters)} parameters")
        for i, (m, src, p) in enumerate(zip(self.masters, masters, self.params, strict=True)):
            if m.shape != src.shape:
                raise ValueError(f"optimizer state: master {i} has shape {tuple(src.shape)}, want {tuple(m.shape)}")
            m.copy_(src)
            p.copy_(m)
        self.opt.load_state_dict(state["opt"])
        self.steps = int(state["steps"])
