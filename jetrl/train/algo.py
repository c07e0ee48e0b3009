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

Same algorithm as verl 0.9.1 (``verl.trainer.ppo.core_algos``), so the local trainer and the verl path
train alike; ``tests/verl_integration/test_algo_parity.py`` compares these functions with verl's on identical inputs,
bitwise. Taken from verl:

- Dual-clip PPO (Ye et al. 2020, verl's ``clip_ratio_c``, default 3; DAPO recipes use 10): for a
  negative advantage the per-token loss is also capped at ``-A * clip_ratio_c``, so a token whose ratio
  exploded cannot push an arbitrarily large negative update.
- The log-ratio ``logp - old_logp`` (and, for the k3 KL, ``ref_logp - logp``) is clamped to
  ``[-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP] = [-20, 20]`` before ``exp``, so ratios stay finite
  (``exp(20) = 4.9e8``) and a clamped token gets no gradient instead of ``0 * inf = NaN``.
- verl's five loss aggregation modes (`LOSS_AGG_MODES`), its KL kinds and names (`KL_TYPES`, incl.
  the ``+`` straight-through variants), GRPO's outcome advantage with ``norm_adv_by_std_in_grpo`` and
  ``epsilon`` (`group_advantages`).

Deliberate differences (each pinned by a test):

- Masked (padding) positions never reach the arithmetic: every token-level input is replaced by 0
  where ``mask`` is 0 before it is used, so NaN, inf or 1e30 there changes neither the loss nor any
  gradient (the gradient at a masked position is exactly 0). verl only filters the token-mean sum:
  its ``seq-mean-*`` modes multiply by the mask (``NaN * 0 = NaN``), and garbage advantages or IS
  weights there give NaN gradients even in token-mean (``0 * NaN`` in the product's backward). On
  finite inputs the results are bitwise verl's.
- An empty selection raises (`masked_mean`, `aggregate_loss`) instead of verl's silent
  ``0 / (0 + 1e-8)`` or ``0 / 0``.
- A group of one sample gets advantage 0 (verl: ``r / (1 + eps)``, mean 0 and std 1 by convention), and
  a group of equal rewards gets 0 even with ``eps = 0`` (verl: ``0 / 0 = NaN``).
- ``clip_ratio_c=None`` turns dual-clip off (verl always applies it and asserts ``clip_ratio_c > 1``).
- The ``+`` (straight-through) KL kinds are written so that their value and gradient stay finite where
  verl's ``0.5 * d**2`` overflows to inf (``|d| > 2.6e19``, which then gives NaN); elsewhere bitwise verl's.
- Single process: no ``dp_size`` factor; `aggregate_loss`'s ``num_tokens`` / ``num_seqs`` are verl's
  ``batch_num_tokens`` / ``global_batch_size`` (the mini-batch's totals).

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
    "token_logprobs_and_entropy",
    "masked_sum",
    "masked_mean",
    "aggregate_loss",
    "policy_loss",
    "truncated_is_weights",
    "LOG_RATIO_CLAMP",
    "CLIP_RATIO_C",
    "KL_TYPES",
    "kl_penalty",
    "mismatch_metrics",
    "pass_at_k",
]

LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
"""verl's loss aggregation modes (`aggregate_loss`), over response tokens only:

- ``token-mean``: sum over all tokens / number of tokens (DAPO).
- ``token-sum``: sum over all tokens.
- ``seq-mean-token-mean``: per sequence token mean, then mean over sequences (GRPO).
- ``seq-mean-token-sum``: per sequence token sum, then mean over sequences.
- ``seq-mean-token-sum-norm``: ``seq-mean-token-sum`` divided by a constant ``loss_scale_factor``
  (Dr. GRPO; verl's default is the response width of the tensor, ``mask.shape[-1]``).

A sequence without response tokens does not count in the default number of sequences (verl)."""

_KL_BASE = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")
KL_TYPES = _KL_BASE + tuple(k + "+" for k in _KL_BASE)
"""verl's per-token estimators of KL(policy || reference) from sampled tokens (`kl_penalty`), with
``d = logp - ref_logp``: ``k1`` (alias ``kl``) = ``d`` (unbiased, high variance, can be negative),
``abs`` = ``|d|``, ``k2`` (alias ``mse``) = ``d^2 / 2``, ``k3`` (alias ``low_var_kl``, GRPO's KL term) =
``exp(c) - c - 1`` with ``c = clamp(-d, -20, 20)`` (unbiased, non-negative, low variance), clamped to
[-10, 10] so one wild token cannot dominate the loss. A trailing ``+`` (``k3+``) keeps the value of
the estimator but takes the gradient of ``k2`` (straight-through; k2's gradient is the unbiased KL
gradient)."""

LOG_RATIO_CLAMP = 20.0
"""verl clamps log-ratios to ``[-20, 20]`` before ``exp`` (PPO ratio, k3 KL)."""

CLIP_RATIO_C = 3.0
"""verl's default dual-clip bound ``clip_ratio_c``."""


def _zero_masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` with 0 wherever ``mask`` is 0: whatever sits at padding positions (NaN, inf, 1e30) is not
    used, and no gradient reaches it (``torch.where``'s backward is 0 on the unselected side)."""
    return torch.where(mask.to(torch.bool), x, torch.zeros((), dtype=x.dtype, device=x.device))


def _check_groups(scores: torch.Tensor, group_size: int, name: str) -> torch.Tensor:
    if scores.dim() != 1:
        raise ValueError(f"{name}: expected a 1-D [B*G] tensor, got shape {tuple(scores.shape)}")
    if group_size < 1 or scores.numel() % group_size:
        raise ValueError(f"{name}: {scores.numel()} scores do not split into groups of group_size={group_size}")
    return scores.reshape(-1, group_size)


def group_advantages(
    scores: torch.Tensor, group_size: int, *, norm_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO outcome advantages: ``(r - group mean) / (group std + eps)`` per sample (verl's
    ``compute_grpo_outcome_advantage`` with ``epsilon=eps``, ``norm_adv_by_std_in_grpo=norm_by_std``;
    ``norm_by_std=False`` only centres, Dr. GRPO). ``std`` is the unbiased estimate.

    Input: scores ``[B*G]`` (group-major; verl's scores are its token-level rewards summed over the
    response). Output: ``[B*G]`` float32, one per sequence (verl broadcasts it over the response mask).
    Deliberately unlike verl: a group of one sample gets advantage 0, as ``r - mean`` is 0 for it (verl:
    mean 0 and std 1 by convention, i.e. ``r / (1 + eps)``), and a group of equal rewards gets exactly
    0 even with ``eps = 0`` (verl: ``0 / 0 = NaN``).
    """
    if eps < 0 or not math.isfinite(eps):
        raise ValueError(f"group_advantages: eps={eps} must be finite and >= 0")
    g = _check_groups(scores, group_size, "group_advantages").to(torch.float32)
    if group_size == 1:
        return torch.zeros_like(g).reshape(-1)
    # Each group reduced as a 1-D tensor, as verl does: torch's CPU std of a 1-D tensor and its std along
    # dim 1 of [B, G] round differently (~1 in 10 groups by an ulp or more), so one batched reduction
    # would not give verl's advantages bit for bit. B small reductions cost microseconds each.
    rows = g.unbind(0)
    mean = torch.stack([r.mean() for r in rows]).unsqueeze(1)
    adv = g - mean
    if norm_by_std:
        denom = torch.stack([r.std() for r in rows]).unsqueeze(1) + eps
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


def _log_softmax32(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.to(torch.float32), dim=-1)


def _gather_targets(lp: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def _entropy_of(lp: torch.Tensor) -> torch.Tensor:
    return -(lp.exp() * lp).sum(dim=-1)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Log-probability of `targets` under ``softmax(logits)``, computed in float32.

    Input: logits ``[..., V]``, targets ``[...]`` int64. Output: ``[...]`` float32.
    """
    return _gather_targets(_log_softmax32(logits), targets)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of ``softmax(logits)`` over the last dim, in float32. Output: ``logits.shape[:-1]``."""
    return _entropy_of(_log_softmax32(logits))


def token_logprobs_and_entropy(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_logprobs` and `entropy_from_logits` from ONE float32 log-softmax, bit for bit the same values,
    without the second cast + log-softmax over ``[tokens, V]`` (at a 128k vocabulary, by arithmetic ~19 of
    the ~63 GB of memory traffic of the old-log-prob pass's log-probs and entropy per 8B-class micro-batch)."""
    lp = _log_softmax32(logits)
    return _gather_targets(lp, targets), _entropy_of(lp)


def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of `x` where ``mask`` is 1 (masked positions are ignored, whatever they hold)."""
    return (_zero_masked(x, mask) * mask.to(x.dtype)).sum()


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `x` where ``mask`` is 1; raises on an empty mask (a batch with no response tokens) where
    verl's ``masked_mean`` returns ``0 / (0 + 1e-8)``."""
    n = mask.sum()
    if float(n) == 0:
        raise ValueError("masked_mean: mask selects no element (no response tokens in the batch)")
    return masked_sum(x, mask) / n


def aggregate_loss(
    loss: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss ``[N, T]`` to a scalar (see `LOSS_AGG_MODES`), as verl's ``agg_loss``.

    `num_tokens` / `num_seqs` override the denominators so that micro-batches of one mini-batch sum to
    the mini-batch's loss (pass the mini-batch's totals, verl's ``batch_num_tokens`` and
    ``global_batch_size``); the defaults are this tensor's own response tokens and its sequences that
    have at least one. `loss_scale_factor` is the divisor of ``seq-mean-token-sum-norm`` (default
    ``T = mask.shape[-1]``, as verl; pass a constant when micro-batches differ in width). Values at
    masked positions are ignored (0 gradient), unlike verl's ``seq-mean-*`` modes where NaN there leaks.
    """
    if loss.shape != mask.shape or loss.dim() != 2:
        raise ValueError(f"aggregate_loss: loss {tuple(loss.shape)} and mask {tuple(mask.shape)} must be equal [N, T]")
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"aggregate_loss: unknown mode {mode!r}; choose one of {LOSS_AGG_MODES}")
    m = mask.to(loss.dtype)
    masked = _zero_masked(loss, mask) * m
    if mode in ("token-mean", "token-sum"):
        total = masked.sum()
        if mode == "token-sum":
            return total
        denom = float(m.sum()) if num_tokens is None else float(num_tokens)
        if denom <= 0:
            raise ValueError(f"aggregate_loss: token-mean over {denom:g} response tokens (empty mask or num_tokens)")
        return total / denom
    per_seq = masked.sum(dim=1)
    tokens = m.sum(dim=1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / tokens.clamp_min(1.0)  # a row without tokens sums to 0: it adds 0
    denom = float((tokens > 0).sum()) if num_seqs is None else float(num_seqs)
    if denom <= 0:
        raise ValueError(f"aggregate_loss: {mode} over {denom:g} sequences (no row has a response token, or num_seqs)")
    out = per_seq.sum() / denom
    if mode == "seq-mean-token-sum-norm":
        scale = float(mask.shape[-1]) if loss_scale_factor is None else float(loss_scale_factor)
        if not scale > 0:
            raise ValueError(f"aggregate_loss: loss_scale_factor={loss_scale_factor} must be > 0")
        out = out / scale
    return out


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    loss_agg: str,
    clip_ratio_c: float | None = CLIP_RATIO_C,
    is_weights: torch.Tensor | None = None,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate with asymmetric (clip-higher) bounds and dual-clip, as verl's ``vanilla``
    policy loss (``compute_policy_loss_vanilla``).

    ``ratio = exp(clamp(logp - old_logp, -20, 20))``; per token ``L = max(-A * ratio, -A * clip(ratio,
    1 - clip_low, 1 + clip_high))``, and for ``A < 0`` also ``L = min(L, -A * clip_ratio_c)`` (dual-clip;
    ``None`` = off); optionally times detached importance weights (TIS); reduced by `aggregate_loss`.
    Inputs at masked positions are replaced by 0 first (see the module docstring).

    Input: logp, old_logp, mask ``[N, T]``; advantages ``[N]`` (one per sequence) or ``[N, T]``.
    Output: (scalar loss with grad through `logp`, stats): ``clip_frac`` = fraction of response tokens
    whose clipped term was the active one (verl's ``pg_clipfrac``), ``clip_frac_lower`` = fraction where
    the dual-clip bound was (``pg_clipfrac_lower``), ``ratio_mean`` / ``ratio_max``, ``approx_kl`` (mean
    of the clamped ``old_logp - logp``, verl's ``ppo_kl``).
    """
    if not (0.0 <= clip_low < 1.0) or clip_high < 0.0:
        raise ValueError(f"policy_loss: clip_low={clip_low} must be in [0, 1) and clip_high={clip_high} >= 0")
    if clip_ratio_c is not None and not clip_ratio_c > 1.0:
        raise ValueError(f"policy_loss: clip_ratio_c={clip_ratio_c} must be > 1 (the dual-clip bound) or None (off)")
    if logp.shape != old_logp.shape or logp.shape != mask.shape:
        raise ValueError(
            f"policy_loss: logp {tuple(logp.shape)}, old_logp {tuple(old_logp.shape)}, mask {tuple(mask.shape)} differ"
        )
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    if advantages.shape not in ((logp.shape[0], 1), logp.shape):
        raise ValueError(
            f"policy_loss: advantages {tuple(advantages.shape)} fit neither [N] nor logp {tuple(logp.shape)}"
        )
    mask_f = mask.to(torch.float32)
    adv = _zero_masked(advantages.to(torch.float32).expand_as(logp), mask)
    log_ratio = _zero_masked(logp, mask) - _zero_masked(old_logp.detach(), mask)
    log_ratio = torch.clamp(log_ratio, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    pg = torch.maximum(pg_unclipped, pg_clipped)
    lower = torch.zeros_like(pg)
    if clip_ratio_c is not None:
        pg_dual = -adv * clip_ratio_c
        with torch.no_grad():
            lower = (torch.gt(pg, pg_dual) & (adv < 0)).to(torch.float32)
        pg = torch.where(adv < 0, torch.minimum(pg_dual, pg), pg)
    if is_weights is not None:
        if is_weights.shape != logp.shape:
            raise ValueError(f"policy_loss: is_weights {tuple(is_weights.shape)} and logp {tuple(logp.shape)} differ")
        pg = pg * _zero_masked(is_weights.detach().to(pg.dtype), mask)
    loss = aggregate_loss(
        pg, mask_f, loss_agg, num_tokens=num_tokens, num_seqs=num_seqs, loss_scale_factor=loss_scale_factor
    )
    with torch.no_grad():
        clipped = torch.gt(pg_clipped, pg_unclipped).to(torch.float32)
        stats = {
            "clip_frac": float(masked_mean(clipped, mask_f)),
            "clip_frac_lower": float(masked_mean(lower, mask_f)),
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


def kl_penalty(
    logp: torch.Tensor, ref_logp: torch.Tensor, kind: str, *, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-token KL(policy || reference) estimate ``[N, T]`` (see `KL_TYPES`), differentiable in `logp`,
    as verl's ``kl_penalty`` (``actor.kl_loss_type``).

    GRPO's loss adds ``kl_coef * aggregate_loss(kl_penalty(logp, ref_logp, "k3", mask=mask), mask, ...)``;
    the reference is the policy at RL start and gets no gradient. With `mask`, both inputs are 0 at
    masked positions (so is the estimate), whatever they held, and no gradient reaches those positions.
    """
    if logp.shape != ref_logp.shape:
        raise ValueError(f"kl_penalty: logp {tuple(logp.shape)} and ref_logp {tuple(ref_logp.shape)} differ")
    if kind not in KL_TYPES:
        raise ValueError(f"kl_penalty: unknown kind {kind!r}; choose one of {KL_TYPES}")
    ref_logp = ref_logp.detach()
    if mask is not None:
        if mask.shape != logp.shape:
            raise ValueError(f"kl_penalty: mask {tuple(mask.shape)} and logp {tuple(logp.shape)} differ")
        logp, ref_logp = _zero_masked(logp, mask), _zero_masked(ref_logp, mask)
    base = kind.removesuffix("+")
    if base in ("k1", "kl"):
        value = logp - ref_logp
    elif base == "abs":
        value = (logp - ref_logp).abs()
    elif base in ("k2", "mse"):
        return 0.5 * (logp - ref_logp).square()  # k2's own gradient: "+" changes nothing
    else:  # k3 / low_var_kl
        c = torch.clamp(ref_logp - logp, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
        value = torch.clamp(torch.exp(c) - c - 1, min=-10.0, max=10.0)
    if not kind.endswith("+"):
        return value
    # straight-through: the value of `value`, the gradient of k2 (d(d^2/2)/dlogp = d). verl writes it as
    # k2 - k2.detach() + value.detach(), which overflows (inf - inf) for |d| > 2.6e19; this form does not.
    d = (logp - ref_logp).detach()
    return value.detach() + d * (logp - logp.detach())


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
