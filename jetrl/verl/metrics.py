"""jetrl's per-step metrics for verl runs, beside verl's own (NUMERICS.md section 5 has the vocabulary).

verl logs ``training/rollout_probs_diff_{max,mean,std}``, which is |p_rollout - p_trainer| in
*probability* space (``verl/utils/debug/metrics.py``): a token at p = 1e-3 whose log-prob is off by
0.5 shows there as 6e-4. jetrl's mismatch is in log space, over response tokens only:

- ``mismatch/logp_abs_diff_mean`` / ``_max``: mean / max of |logp_trainer - logp_rollout| per token, where
  logp_trainer is verl's recomputed ``old_log_probs`` and logp_rollout vLLM's ``rollout_log_probs``.
- ``mismatch/is_ratio_mean`` / ``_max``: mean / max of the per-token importance ratio
  exp(logp_trainer - logp_rollout) (1 when on-policy; what TIS would clip).
- ``mismatch/logp_equal_share``: share of those tokens whose two log-probs are the same number (1.0 is
  bitwise on-policy: the goal of ``jetrl.numerics=strict``).
- ``mismatch/tokens``: response tokens measured.

And of each weight sync of the ``jetrl-unified`` recipe, from every rollout worker's report
(`jetrl.verl.worker.JetrlWorkerExtension.jetrl_sync_report`, a `jetrl.rollout.sync.SyncReport` plus counts):

- ``sync/bytes``: payload bytes one rollout replica installed (fp8 bytes + scales + BF16 tensors: each
  worker's, summed over the tensor-parallel ranks of a replica; workers of the same TP rank must agree,
  else an error), ``sync/tp_ranks``: tensor-parallel ranks reporting, ``sync/seconds``: the trainer's wall
  time of verl's ``update_weights`` (export, transport, install; verl logs the same as ``timing_s/update_weights``),
  ``sync/install_seconds``: the slowest worker's copy + verification, ``sync/arrival_digests``: tensors
  whose digest was compared on arrival with the trainer's, ``sync/digests``: tensors digest-compared in
  the engine's memory after the copy (both summed over workers), ``sync/digests_equal``: 1.0 (a mismatch
  raises `WeightSyncError` in the sync instead), ``sync/workers``: rollout workers reporting.
- With tensor parallelism (more than one TP rank reporting), per rank r: ``sync/tp<r>/bytes`` (the slice
  rank r installed), ``sync/tp<r>/install_seconds`` (its slowest worker) and ``sync/tp<r>/digests``
  (tensors digest-compared on its workers): `is_metric_key` knows these names.

Positions outside ``response_mask`` are never read, whatever they hold (padding may be inf or NaN).
"""

from __future__ import annotations

import re

import torch

__all__ = [
    "METRIC_KEYS",
    "MISMATCH_FIELDS",
    "MissingLogProbsError",
    "batch_mismatch_metrics",
    "is_metric_key",
    "mismatch_metrics",
    "sync_metrics",
]

METRIC_KEYS = (
    "mismatch/logp_abs_diff_mean",
    "mismatch/logp_abs_diff_max",
    "mismatch/is_ratio_mean",
    "mismatch/is_ratio_max",
    "mismatch/logp_equal_share",
    "mismatch/tokens",
    "sync/bytes",
    "sync/seconds",
    "sync/install_seconds",
    "sync/arrival_digests",
    "sync/digests",
    "sync/digests_equal",
    "sync/workers",
    "sync/tp_ranks",
)

_PER_RANK_KEY = re.compile(r"sync/tp\d+/(bytes|install_seconds|digests)")
"""The per-tensor-parallel-rank sync metrics (module docstring)."""

MISMATCH_FIELDS = ("response_mask", "old_log_probs", "rollout_log_probs")
"""The verl batch fields `batch_mismatch_metrics` reads."""


def is_metric_key(key: str) -> bool:
    """Whether `key` is one of jetrl's step metrics: `METRIC_KEYS`, or a per-rank ``sync/tp<r>/...`` one."""
    return key in METRIC_KEYS or _PER_RANK_KEY.fullmatch(key) is not None


class MissingLogProbsError(ValueError):
    """A verl batch lacks a log-prob field the mismatch metrics need (the message names it and the fix)."""


def mismatch_metrics(trainer_logp: torch.Tensor, rollout_logp: torch.Tensor, response_mask: torch.Tensor) -> dict:
    """Log-space trainer/rollout mismatch over the response tokens of a ``[batch, response_len]`` batch."""
    if trainer_logp.shape != rollout_logp.shape or trainer_logp.shape != response_mask.shape:
        raise ValueError(
            f"mismatch_metrics: shapes differ: trainer {tuple(trainer_logp.shape)}, rollout "
            f"{tuple(rollout_logp.shape)}, response_mask {tuple(response_mask.shape)}"
        )
    mask = response_mask.bool()
    n = int(mask.sum())
    if n == 0:
        raise ValueError("mismatch_metrics: the response mask selects no token")
    d = trainer_logp.double()[mask] - rollout_logp.double()[mask]
    if not torch.isfinite(d).all():
        bad = int((~torch.isfinite(d)).sum())
        raise ValueError(f"mismatch_metrics: {bad} of {n} response tokens have a non-finite log-prob difference")
    ratio = d.exp()
    return {
        "mismatch/logp_abs_diff_mean": float(d.abs().mean()),
        "mismatch/logp_abs_diff_max": float(d.abs().max()),
        "mismatch/is_ratio_mean": float(ratio.mean()),
        "mismatch/is_ratio_max": float(ratio.max()),
        "mismatch/logp_equal_share": float((d == 0).double().mean()),
        "mismatch/tokens": n,
    }


def batch_mismatch_metrics(data) -> dict:
    """`mismatch_metrics` of one verl batch: trainer ``old_log_probs`` against vLLM's ``rollout_log_probs``
    over ``response_mask``.

    `data` is what verl 0.9.1's V1 trainer holds: a TensorDict of jagged per-sample tensors as TransferQueue
    returns it (``kv_batch_get``), a padded TensorDict, or a `DataProto` (its ``.batch``). Jagged batches
    are padded the way verl pads them before its own ``calculate_debug_metrics`` (``to_padded_tensor``).
    Raises `MissingLogProbsError` naming the field when one is absent."""
    batch = getattr(data, "batch", data)
    keys = set(batch.keys())
    missing = [k for k in MISMATCH_FIELDS if k not in keys]
    if "rollout_log_probs" in missing:
        raise MissingLogProbsError(
            "the verl batch has no 'rollout_log_probs' (vLLM's per-token log-probs of the sampled tokens), which "
            "jetrl's mismatch metrics compare with the trainer's 'old_log_probs': set "
            "actor_rollout_ref.rollout.calculate_log_probs=true"
        )
    if missing:
        raise MissingLogProbsError(
            f"the verl batch has no {missing[0]!r}: jetrl's mismatch metrics read {list(MISMATCH_FIELDS)} after verl's "
            "old-log-prob step"
        )
    if any(batch.get(k).is_nested for k in MISMATCH_FIELDS):
        batch = batch.select(*MISMATCH_FIELDS).to_padded_tensor()
    return mismatch_metrics(batch["old_log_probs"], batch["rollout_log_probs"], batch["response_mask"])


def sync_metrics(reports: list, seconds: float | None = None) -> dict:
    """One weight sync's metrics (module docstring) from every rollout worker's report (a
    `SyncReport.to_dict` with ``n_arrival_digests``) and the trainer's wall time of the sync."""
    if not reports:
        raise ValueError("sync_metrics: no rollout worker reported a weight sync")
    missing = [i for i, r in enumerate(reports) if r is None]
    if missing:
        raise ValueError(
            f"sync_metrics: rollout worker {missing[0]} has installed no jetrl weight sync ({len(missing)} of "
            f"{len(reports)} workers): its engine does not run a jetrl quantization method"
        )
    by_rank: dict[int, list[dict]] = {}
    for r in reports:
        by_rank.setdefault(int(r.get("tp_rank", 0)), []).append(r)
    rank_bytes = {rank: sorted({int(r["bytes"]) for r in rs}) for rank, rs in sorted(by_rank.items())}
    differ = {rank: b for rank, b in rank_bytes.items() if len(b) != 1}
    if differ:
        raise ValueError(
            "sync_metrics: rollout workers of the same tensor-parallel rank installed different payloads: bytes by "
            f"rank {differ}"
        )
    out = {
        "sync/bytes": sum(b for (b,) in rank_bytes.values()),
        "sync/tp_ranks": len(by_rank),
        "sync/install_seconds": max(float(r["seconds"]) for r in reports),
        "sync/arrival_digests": sum(int(r["n_arrival_digests"]) for r in reports),
        "sync/digests": sum(int(r["n_digests"]) for r in reports),
        "sync/digests_equal": 1.0 if all(r["digests_equal"] for r in reports) else 0.0,
        "sync/workers": len(reports),
    }
    if len(by_rank) > 1:
        for rank, rs in sorted(by_rank.items()):
            out[f"sync/tp{rank}/bytes"] = rank_bytes[rank][0]
            out[f"sync/tp{rank}/install_seconds"] = max(float(r["seconds"]) for r in rs)
            out[f"sync/tp{rank}/digests"] = sum(int(r["n_digests"]) for r in rs)
    if seconds is not None:
        out["sync/seconds"] = float(seconds)
    return out
