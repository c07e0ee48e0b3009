"""jetrl's per-step metrics for verl runs, beside verl's own (NUMERICS.md section 5 has the vocabulary).

verl logs ``training/rollout_probs_diff_{max,mean,std}``, which is |p_rollout - p_trainer| in
*probability* space (``verl/utils/debug/metrics.py``): a token at p = 1e-3 whose log-prob is off by
0.5 shows there as 6e-4. jetrl's mismatch is in log space, over response tokens only:

- ``mismatch/logp_abs_diff_mean`` / ``_max``: mean / max of |logp_trainer - logp_rollout| per token, where
  logp_trainer is verl's recomputed ``old_log_probs`` and logp_rollout vLLM's ``rollout_log_probs``.
- ``mismatch/is_ratio_mean`` / ``_max``: mean / max of the per-token importance ratio
  exp(logp_trainer - logp_rollout) (1 when on-policy; what TIS would clip).
- ``mismatch/tokens``: response tokens measured.

And of each weight sync (trainer side: `jetrl.verl.engine` stream stats; rollout side: the worker's
`jetrl.rollout.sync.SyncReport`):

- ``sync/bytes``: payload bytes streamed (fp8 bytes + scales + BF16 tensors), ``sync/seconds``: export
  and send time on the trainer, ``sync/install_seconds``: copy + verification in the engine,
  ``sync/digests``: tensors digest-compared, ``sync/digests_equal``: 1.0 (a mismatch raises instead).

Positions outside ``response_mask`` are never read, whatever they hold (padding may be inf or NaN).
"""

from __future__ import annotations

import torch

__all__ = ["METRIC_KEYS", "mismatch_metrics", "sync_metrics"]

METRIC_KEYS = (
    "mismatch/logp_abs_diff_mean",
    "mismatch/logp_abs_diff_max",
    "mismatch/is_ratio_mean",
    "mismatch/is_ratio_max",
    "mismatch/tokens",
    "sync/bytes",
    "sync/seconds",
    "sync/install_seconds",
    "sync/digests",
    "sync/digests_equal",
)


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
        "mismatch/tokens": n,
    }


def sync_metrics(export_stats: dict, install_report: dict | None = None) -> dict:
    """One sync's metrics from the engine's ``jetrl_last_export`` and the worker's report (``to_dict``)."""
    out = {"sync/bytes": int(export_stats["bytes"]), "sync/seconds": float(export_stats["seconds"])}
    if install_report is not None:
        if install_report["bytes"] != export_stats["bytes"]:
            raise ValueError(
                f"sync_metrics: the trainer streamed {export_stats['bytes']} bytes but the engine installed "
                f"{install_report['bytes']}"
            )
        out["sync/install_seconds"] = float(install_report["seconds"])
        out["sync/digests"] = int(install_report["n_digests"])
        out["sync/digests_equal"] = 1.0 if install_report["digests_equal"] else 0.0
    return out
