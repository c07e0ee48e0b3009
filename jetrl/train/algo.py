"""GRPO and DAPO as pure functions over tensors (no model, no engine, no config objects).

Everything here takes and returns tensors or floats so that the local trainer and a verl worker can
share it. Layout conventions:

- A rollout batch holds ``B`` prompts with ``G`` samples each, flattened group-major: row ``i`` belongs
  to prompt ``i // G``. Scores are ``[B*G]``.
- Token-level tensors are ``[N, T]`` over response positions with a 0/1 ``mask`` ``[N, T]`` (1 on real
  response tokens, 0 on padding).

GRPO (Shao et al. 2024): the advantage of a sample is its reward standardized within its group,
``A = (r - mean_g) / (std_g + eps)`` (``std`` unbiased, as verl's ``compute_grpo_outcome_advantage``),
broadcast to all its tokens, and the PPO clipped surrogate is averaged per sequence then over sequences
(``seq-mean-token-mean``). With ``norm_by_std=False`` the advantage is only centred (Dr. GRPO).

DAPO (Yu et al. 2025) changes four things, each a separate function or option here:

1. Clip-higher: the ratio is clipped to ``[1 - clip_low, 1 + clip_high]`` with ``clip_high > clip_low``
   (0.2 / 0.28), so low-probability tokens can grow (against entropy collapse).
2. Dynamic sampling: groups whose rewards are all equal carry zero advantage and no gradient; they are
   dropped and more prompts sampled until the batch is full (`groups_with_signal`).
3. Token-level loss aggregation: the surrogate is averaged over all tokens of the batch
   (``token-mean``), so long responses weigh per token, not per sequence.
4. Overlong reward shaping: a soft length penalty in the last ``buffer_len`` tokens before the
   response budget (`overlong_penalty`).

Trainer/rollout mismatch (``../shared/NUMERICS.md`` section 5): for each response token,
``d = logp_trainer - logp_rollout`` where ``logp_trainer`` is the trainer's log-prob with the weights
the rollout engine sampled from. `mismatch_metrics` reports ``mean |d|``, ``max |d|`` and the
importance ratio ``exp(d)``; `truncated_is_weights` gives the truncated importance-sampling correction
(TIS, ``min(exp(d), cap)``) that off-policy setups such as a naive FP8 rollout need and Jet-RL's
unified flow is meant to make unnecessary.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "LOSS_AGG_MODES",
    "group_advantages",
    "groups_with_signal",
    "overlong_penalty",
    "token_logprobs",
    "entropy_from_logits",
    "masked_sum",
    "masked_mean",
    "aggregate_loss",
    "policy_loss",
    "truncated_is_weights",
    "KL_TYPES",
    "kl_penalty",
    "mismatch_metrics",
    "pass_at_k",
]

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
"""``token-mean``: sum over all tokens / number of tokens (DAPO). ``seq-mean-token-mean``: per
sequence token mean, then mean over sequences (GRPO). ``seq-mean-token-sum``: per sequence token sum,
then mean over sequences."""

KL_TYPES = ("k1", "abs", "k2", "k3")
"""Per-token estimators of KL(policy || reference) from sampled tokens, ``d = logp - ref_logp``:
``k1`` = d (unbiased, high variance, can be negative), ``abs`` = ``|d|``, ``k2`` = ``d^2 / 2``,
``k3`` = ``exp(-d) - 1 + d`` (unbiased, non-negative, low variance; verl's ``low_var_kl``, GRPO's KL
term), clamped to [-10, 10] as verl does so one wild token cannot dominate the loss."""


def _check_groups(scores: torch.Tensor, group_size: int, name: str) -> torch.Tensor:
    if scores.dim() != 1:
        raise ValueError(f"{name}: expected a 1-D [B*G] tensor, got shape {tuple(scores.shape)}")
    if group_size < 1 or scores.numel() % group_size:
        raise ValueError(f"{name}: {scores.numel()} scores do not split into groups of group_size={group_size}")
    return scores.reshape(-1, group_size)


def group_advantages(
    scores: torch.Tensor, group_size: int, *, norm_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO outcome advantages: ``(r - group mean) / (group std + eps)`` per sample.

    Input: scores ``[B*G]`` (group-major). Output: ``[B*G]`` float32. A group of one sample gets
    advantage 0 (mean 0, std 1 by convention, as verl). ``std`` is the unbiased estimate.
    """
    g = _check_groups(scores, group_size, "group_advantages").to(torch.float32)
    if group_size == 1:
        return torch.zeros_like(g).reshape(-1)
    mean = g.mean(dim=1, keepdim=True)
    adv = g - mean
    if norm_by_std:
        denom = g.std(dim=1, keepdim=True) + eps
        # a group of equal rewards is centred to exactly 0; keep it 0 even with eps=0
        adv = torch.where(denom > 0, adv / torch.where(denom > 0, denom, 1.0), torch.zeros_like(adv))
    return adv.reshape(-1)


def groups_with_signal(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """DAPO dynamic-sampling filter: ``[B]`` bool, True for groups whose scores are not all equal
    (the others have zero advantage and contribute no gradient)."""
    g = _check_groups(scores, group_size, "groups_with_signal")
    return (g.max(dim=1).values - g.min(dim=1).values) > 0


def overlong_penalty(lengths: torch.Tensor, *, max_len: int, buffer_len: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO soft overlong punishment, added to the reward.

    ``0`` for ``L <= max_len - buffer_len``; ``factor * (max_len - buffer_len - L) / buffer_len`` for
    ``max_len - buffer_len < L <= max_len`` (linear from 0 to ``-factor``); ``-factor`` beyond.
    Input: lengths ``[N]`` (response tokens). Output: ``[N]`` float32.
    """
    if buffer_len <= 0 or buffer_len > max_len:
        raise ValueError(f"overlong_penalty: buffer_len={buffer_len} must be in [1, max_len={max_len}]")
    start = max_len - buffer_len
    lengths = lengths.to(torch.float32)
    pen = (start - lengths) / buffer_len
    pen = torch.where(lengths <= start, torch.zeros_like(pen), pen)
    return factor * torch.clamp(pen, min=-1.0)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Log-probability of `targets` under ``softmax(logits)``, computed in float32.

    Input: logits ``[..., V]``, targets ``[...]`` int64. Output: ``[...]`` float32.
    """
    lp = torch.log_softmax(logits.to(torch.float32), dim=-1)
    return lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of ``softmax(logits)`` over the last dim, in float32. Output: ``logits.shape[:-1]``."""
    lp = torch.log_softmax(logits.to(torch.float32), dim=-1)
    return -(lp.exp() * lp).sum(dim=-1)


def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum()


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `x` where ``mask`` is 1; raises on an empty mask (a batch with no response tokens)."""
    n = mask.sum()
    if float(n) == 0:
        raise ValueError("masked_mean: mask selects no element (no response tokens in the batch)")
    return (x * mask).sum() / n


def aggregate_loss(
    loss: torch.Tensor, mask: torch.Tensor, mode: str, *, num_tokens: float | None = None, num_seqs: float | None = None
) -> torch.Tensor:
    """Reduce a per-token loss ``[N, T]`` to a scalar (see `LOSS_AGG_MODES`).

    `num_tokens` / `num_seqs` override the denominators so that micro-batches of one mini-batch sum to
    the mini-batch's loss (pass the mini-batch's totals; the default is this tensor's own).
    """
    if loss.shape != mask.shape or loss.dim() != 2:
        raise ValueError(f"aggregate_loss: loss {tuple(loss.shape)} and mask {tuple(mask.shape)} must be equal [N, T]")
    mask = mask.to(loss.dtype)
    if mode == "token-mean":
        denom = float(mask.sum()) if num_tokens is None else float(num_tokens)
        if denom == 0:
            raise ValueError("aggregate_loss: no response tokens (token-mean over an empty mask)")
        return (loss * mask).sum() / denom
    per_seq = (loss * mask).sum(dim=1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / mask.sum(dim=1).clamp_min(1.0)
    elif mode != "seq-mean-token-sum":
        raise ValueError(f"aggregate_loss: unknown mode {mode!r}; choose one of {LOSS_AGG_MODES}")
    denom = float(loss.shape[0]) if num_seqs is None else float(num_seqs)
    return per_seq.sum() / denom


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    loss_agg: str,
    is_weights: torch.Tensor | None = None,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate with asymmetric (clip-higher) bounds.

    ``ratio = exp(logp - old_logp)``; per token ``max(-A * ratio, -A * clip(ratio, 1 - clip_low,
    1 + clip_high))``, optionally times detached importance weights (TIS), reduced by `aggregate_loss`.

    Input: logp, old_logp, mask ``[N, T]``; advantages ``[N]`` (one per sequence) or ``[N, T]``.
    Output: (scalar loss with grad through `logp`, stats): ``clip_frac`` = fraction of response tokens
    whose clipped term was the active one, ``ratio_mean`` / ``ratio_max``, ``approx_kl`` (mean of
    ``old_logp - logp``).
    """
    if not (0.0 <= clip_low < 1.0) or clip_high < 0.0:
        raise ValueError(f"policy_loss: clip_low={clip_low} must be in [0, 1) and clip_high={clip_high} >= 0")
    if logp.shape != old_logp.shape or logp.shape != mask.shape:
        raise ValueError(
            f"policy_loss: logp {tuple(logp.shape)}, old_logp {tuple(old_logp.shape)}, mask {tuple(mask.shape)} differ"
        )
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    adv = advantages.to(torch.float32).expand_as(logp)
    mask_f = mask.to(torch.float32)
    log_ratio = logp - old_logp.detach()
    ratio = torch.exp(log_ratio)
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    pg = torch.maximum(pg_unclipped, pg_clipped)
    if is_weights is not None:
        pg = pg * is_weights.detach().to(pg.dtype)
    loss = aggregate_loss(pg, mask_f, loss_agg, num_tokens=num_tokens, num_seqs=num_seqs)
    with torch.no_grad():
        clipped = (pg_clipped > pg_unclipped).to(torch.float32)
        stats = {
            "clip_frac": float(masked_mean(clipped, mask_f)),
            "ratio_mean": float(masked_mean(ratio, mask_f)),
            "ratio_max": float(ratio.masked_fill(mask_f == 0, -math.inf).max()),
            "approx_kl": float(masked_mean(-log_ratio, mask_f)),
        }
    return loss, stats


def truncated_is_weights(trainer_logp: torch.Tensor, rollout_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance weights ``min(exp(trainer_logp - rollout_logp), cap)`` (detached), correcting
    for sampling from the rollout engine's distribution instead of the trainer's."""
    if cap <= 0:
        raise ValueError(f"truncated_is_weights: cap={cap} must be > 0")
    return torch.exp(trainer_logp.detach() - rollout_logp.detach()).clamp(max=cap)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL(policy || reference) estimate ``[N, T]`` (see `KL_TYPES`), differentiable in `logp`.

    GRPO's loss adds ``kl_coef * aggregate(kl_penalty(logp, ref_logp, "k3"))``; the reference is the
    policy at RL start and gets no gradient."""
    if logp.shape != ref_logp.shape:
        raise ValueError(f"kl_penalty: logp {tuple(logp.shape)} and ref_logp {tuple(ref_logp.shape)} differ")
    d = logp - ref_logp.detach()
    if kind == "k1":
        return d
    if kind == "abs":
        return d.abs()
    if kind == "k2":
        return 0.5 * d.square()
    if kind == "k3":
        return (torch.exp(-d) - 1.0 + d).clamp(-10.0, 10.0)
    raise ValueError(f"kl_penalty: unknown kind {kind!r}; choose one of {KL_TYPES}")


def mismatch_metrics(trainer_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Trainer/rollout mismatch over response tokens (NUMERICS.md section 5), as metric names.

    ``mismatch/logp_abs_diff_mean`` / ``_max``: ``|logp_rollout - logp_trainer|``;
    ``mismatch/is_ratio_mean`` / ``_min`` / ``_max``: ``exp(logp_trainer - logp_rollout)``;
    ``mismatch/kl_k3``: the k3 estimator of KL(rollout || trainer), ``mean(exp(-d) - 1 + d)`` with
    ``d = logp_rollout - logp_trainer``, evaluated on tokens sampled from the rollout engine.
    """
    if trainer_logp.shape != rollout_logp.shape or trainer_logp.shape != mask.shape:
        raise ValueError(
            f"mismatch_metrics: trainer_logp {tuple(trainer_logp.shape)}, rollout_logp "
            f"{tuple(rollout_logp.shape)} and mask {tuple(mask.shape)} must have one shape"
        )
    m = mask.to(torch.bool)
    if not bool(m.any()):
        raise ValueError("mismatch_metrics: mask selects no response token")
    t = trainer_logp.detach().to(torch.float64)[m]
    r = rollout_logp.detach().to(torch.float64)[m]
    diff = t - r
    ratio = torch.exp(diff)
    d = r - t
    return {
        "mismatch/logp_abs_diff_mean": float(diff.abs().mean()),
        "mismatch/logp_abs_diff_max": float(diff.abs().max()),
        "mismatch/is_ratio_mean": float(ratio.mean()),
        "mismatch/is_ratio_min": float(ratio.min()),
        "mismatch/is_ratio_max": float(ratio.max()),
        "mismatch/kl_k3": float((torch.exp(-d) - 1.0 + d).mean()),
    }


def pass_at_k(correct: torch.Tensor, group_size: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021) averaged over prompts: per group with ``n`` samples of which
    ``c`` are correct, ``1 - C(n - c, k) / C(n, k)``. Input: correct ``[B*G]`` bool/0-1."""
    g = _check_groups(correct, group_size, "pass_at_k")
    if not 1 <= k <= group_size:
        raise ValueError(f"pass_at_k: k={k} must be in [1, group_size={group_size}]")
    n = group_size
    vals = []
    for c in (g > 0).sum(dim=1).tolist():
        vals.append(1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k))
    return sum(vals) / len(vals)
