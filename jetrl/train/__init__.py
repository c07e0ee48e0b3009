"""The local on-policy RL trainer: GRPO / DAPO with vLLM rollouts, FP8 training and a verified weight sync.

Pieces (each usable alone; the algorithm and the task are pure functions a verl worker can import):

- `jetrl.train.algo`: group advantages, dynamic-sampling filter, overlong penalty, clipped surrogate with
  clip-higher and dual-clip, verl's loss aggregation modes and KL kinds (bitwise verl 0.9.1's
  ``core_algos`` on finite inputs), truncated IS weights, trainer/rollout mismatch metrics, pass@k.
- `jetrl.train.task`: the synthetic arithmetic task and its verifiable reward (`compute_score` has verl's
  reward-function signature).
- `jetrl.train.config`: frozen dataclasses loaded from YAML/JSON; `jetrl.train.checks`: what cannot run here.
- `jetrl.train.policy`: token batches, log-probs under the model, mixed-precision AdamW (fp32 masters).
- `jetrl.train.trainer`: the loop (`Trainer(cfg).run()`); `jetrl.train.cli`: ``jetrl train CONFIG``.
- `jetrl.train.metrics` / `checkpoint` / `progress` / `plots`: outputs of a run.

Nothing heavy is imported here; import the submodule you need.
"""
