"""jetrl's per-step metrics inside verl 0.9.1's V1 trainer loop (`jetrl.verl.metrics` defines them).

verl's ``PPOTrainer.fit`` (``verl/trainer/ppo/v1/trainer_base.py``) builds one ``metrics`` dict per step
and hands it to its loggers. Two of its hooks carry jetrl's numbers into that dict:

- ``_compute_old_log_prob(batch, metrics)``: verl recomputes the trainer's ``old_log_probs`` there and
  logs ``training/rollout_probs_diff_*`` from the same batch. `JetrlStepMetrics` lets verl do that, then
  reads ``response_mask``, ``old_log_probs`` and ``rollout_log_probs`` of the batch from TransferQueue and
  adds ``mismatch/*`` (`batch_mismatch_metrics`) to the same ``metrics``. verl's own
  ``rollout_corr/*`` (``algorithm.rollout_correction``) are computed later in ``_compute_advantage``,
  untouched. ``actor_rollout_ref.rollout.calculate_log_probs=false`` raises `MissingLogProbsError`
  naming the key (the entrypoint refuses that setting before Ray starts); with
  ``algorithm.rollout_correction.bypass_mode=true`` verl recomputes nothing (``old_log_probs`` *is*
  ``rollout_log_probs``), so there is no trainer/rollout difference to measure and ``mismatch/*`` is
  absent from such runs (a warning says so once).
- ``on_step_end``: verl syncs the weights there (``update_weights``, timed as ``timing_raw
  ["update_weights"]``), and ``fit`` then merges ``_consume_sync_metrics()`` -- the trainer's
  ``_pending_sync_metrics`` -- into the step's metrics. For rollout ``jetrl_vllm`` the mixin asks every
  vLLM server of the trainer's replicas for its workers' reports (``JetrlvLLMHttpServer.jetrl_sync_reports``),
  checks that each worker installed a new sync, and stashes `sync_metrics` there. Stock rollouts (the
  ``bf16`` and ``naive-fp8-rollout`` baselines) have no jetrl sync report: ``sync/*`` is absent there.

`JetrlTaskRunner` is verl's ``TaskRunnerV1`` running the trainer class of ``trainer.v1.trainer_mode``
with this mixin in front (`jetrl_trainer_class`); ``python -m jetrl.verl`` passes it to ``run_ppo``.
Nothing in verl is patched: these are subclasses.
"""

from __future__ import annotations

import logging
from pprint import pprint

import ray

from jetrl.verl.adapter import PPOTrainer, TaskRunnerV1Class, configure_verl_logging, get_trainer_cls, tq
from jetrl.verl.metrics import MISMATCH_FIELDS, MissingLogProbsError, batch_mismatch_metrics, sync_metrics
from jetrl.verl.worker import ROLLOUT_NAME

__all__ = ["JetrlStepMetrics", "JetrlTaskRunner", "collect_sync_reports", "jetrl_trainer_class"]

_log = logging.getLogger(__name__)


def collect_sync_reports(servers) -> list:
    """Every rollout worker's last sync report, from the `JetrlvLLMHttpServer` Ray actors `servers`."""
    per_server = ray.get([s.jetrl_sync_reports.remote() for s in servers])
    return [r for reports in per_server for r in reports]


class JetrlStepMetrics:
    """Mixed in before one of verl's V1 ``PPOTrainer`` classes: jetrl's metrics in verl's per-step dict.

    See the module docstring; `jetrl_trainer_class` builds the combined class."""

    _jetrl_sync_indices: list | None = None
    _jetrl_bypass_warned: bool = False

    def _compute_old_log_prob(self, batch, metrics: dict):
        """verl 0.9.1's ``PPOTrainer._compute_old_log_prob``, then ``mismatch/*`` of the same batch."""
        batch = super()._compute_old_log_prob(batch, metrics)
        rc = self.config.algorithm.get("rollout_correction", None)
        if rc and rc.get("bypass_mode", False):
            if not self._jetrl_bypass_warned:
                _log.warning(
                    "algorithm.rollout_correction.bypass_mode=true: verl uses the rollout's log-probs as "
                    "old_log_probs, so jetrl's mismatch/* metrics are not computed in this run"
                )
                self._jetrl_bypass_warned = True
            return batch
        if not self.config.actor_rollout_ref.rollout.calculate_log_probs:
            raise MissingLogProbsError(
                "actor_rollout_ref.rollout.calculate_log_probs=false: the rollout returns no 'rollout_log_probs', "
                "which jetrl's mismatch metrics compare with the trainer's 'old_log_probs' (set it to true)"
            )
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=list(MISMATCH_FIELDS))
        metrics.update(batch_mismatch_metrics(data))
        return batch

    def on_step_end(self):
        """verl's ``on_step_end`` (the weight sync), then ``sync/*`` stashed for ``_consume_sync_metrics``."""
        super().on_step_end()
        if self.config.actor_rollout_ref.rollout.name != ROLLOUT_NAME or "update_weights" not in self.timing_raw:
            return
        servers = [s for r in self.checkpoint_manager.replicas for s in r.servers]
        reports = collect_sync_reports(servers)
        out = sync_metrics(reports, self.timing_raw["update_weights"])
        indices = [r["sync_index"] for r in reports]
        before = self._jetrl_sync_indices
        if before is not None and len(before) == len(indices):
            stale = [i for i, (a, b) in enumerate(zip(before, indices, strict=True)) if b <= a]
            if stale:
                raise RuntimeError(
                    f"jetrl: rollout worker {stale[0]} installed no weight sync in step {self.global_steps}'s "
                    f"update_weights (sync index {indices[stale[0]]}, before {before[stale[0]]})"
                )
        self._jetrl_sync_indices = indices
        pending = dict(getattr(self, "_pending_sync_metrics", None) or {})
        pending.update(out)
        self._pending_sync_metrics = pending


def jetrl_trainer_class(base: type) -> type:
    """``base`` (a verl V1 ``PPOTrainer`` subclass) with `JetrlStepMetrics` in front of it."""
    if not (isinstance(base, type) and issubclass(base, PPOTrainer)):
        raise TypeError(f"jetrl_trainer_class: {base!r} is not a verl V1 PPOTrainer subclass")
    if issubclass(base, JetrlStepMetrics):
        return base
    return type(f"Jetrl{base.__name__}", (JetrlStepMetrics, base), {"__module__": __name__})


class _JetrlTaskRunner(TaskRunnerV1Class):
    def run(self, config):
        """verl 0.9.1's ``TaskRunnerV1.run`` (``verl/trainer/main_ppo.py``), line for line, except that the
        trainer class of ``trainer.v1.trainer_mode`` comes through `jetrl_trainer_class`."""
        from omegaconf import OmegaConf

        configure_verl_logging()
        trainer_cls = jetrl_trainer_class(get_trainer_cls(config.trainer.v1.trainer_mode))
        config.transfer_queue.enable = True
        pprint(OmegaConf.to_container(config, resolve=True))
        OmegaConf.resolve(config)
        self.config = config
        tq.init(config.transfer_queue)
        succeeded = False
        try:
            self.trainer = trainer_cls(config=config)
            self.trainer.init()
            self.init_agent_loop_manager()
            self.trainer.fit(self.agent_loop_manager)
            succeeded = True
        finally:
            try:
                tracking = getattr(self.trainer, "logger", None)
                if tracking is not None:
                    tracking.finish(exit_code=0 if succeeded else 1)
            finally:
                tq.close()


JetrlTaskRunner = ray.remote(_JetrlTaskRunner)
"""``run_ppo(config, task_runner_class=JetrlTaskRunner)``: verl's V1 task runner with `JetrlStepMetrics`."""
