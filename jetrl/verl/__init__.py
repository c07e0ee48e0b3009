"""jetrl on verl 0.9.1: the FP8 FSDP engine, the byte-verified vLLM worker extension, the entrypoint.

- `jetrl.verl.adapter`: every ``import verl...`` of jetrl.
- `jetrl.verl.engine`: `JetrlFSDPEngine` (vendor ``jetrl`` of verl's FSDP language-model engine).
- `jetrl.verl.worker`: `JetrlWorkerExtension`, its vLLM server and replica (rollout name ``jetrl_vllm``).
- `jetrl.verl.plugin`: registers both; verl imports it in every process (``external_lib`` /
  ``VERL_USE_EXTERNAL_MODULES``).
- `jetrl.verl.metrics`: the per-step mismatch and sync metrics.
- `jetrl.verl.trainer`: verl's V1 task runner and trainers with those metrics in each step's log.
- ``python -m jetrl.verl``: verl's ``ppo_trainer`` config plus the ``jetrl:`` section.

Importing this package imports nothing from verl.
"""
