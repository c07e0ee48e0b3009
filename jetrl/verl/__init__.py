"""jetrl on verl 0.9.1: the FP8 FSDP engine, the byte-verified vLLM worker extension, the entrypoint.

- `jetrl.verl.adapter`: every ``import verl...`` of jetrl.
- `jetrl.verl.engine`: `JetrlFSDPEngine` (vendor ``jetrl`` of verl's FSDP language-model engine).
- `jetrl.verl.worker`: `JetrlWorkerExtension`, its vLLM server and replica (rollout name ``jetrl_vllm``).
- `jetrl.verl.plugin`: registers both; verl imports it in every process (``external_lib`` /
  ``VERL_USE_EXTERNAL_MODULES``).
- `jetrl.verl.metrics`: the per-step mismatch and sync metrics.
- `jetrl.verl.trainer`: verl's V1 task runner and trainers with those metrics in each step's log.
- ``python -m jetrl.verl``: verl's ``ppo_trainer`` config plus the ``jetrl:`` section.

Importing this package imports ``verl`` (the package only, first): verl's ``__init__`` imports the modules of
``VERL_USE_EXTERNAL_MODULES`` (`jetrl.verl.plugin` in jetrl's Ray workers), and the plugin needs
`jetrl.verl.adapter` complete. Were the adapter a process's first verl import (Ray unpickling the task runner,
vLLM loading the worker extension by name), the plugin would run in the middle of the adapter's own
``import verl`` and find none of its names; importing verl here, before any jetrl.verl module, rules that out.
"""

import verl  # noqa: F401  (see above: before any jetrl.verl module)
