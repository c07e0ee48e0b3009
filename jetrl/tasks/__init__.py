"""Tasks and their verifiable rewards, shared by the local trainer and the verl path.

- `jetrl.tasks.arithmetic`: the synthetic arithmetic task of the embedded default (``jetrl/arithmetic``).
- `jetrl.tasks.gsm8k`: GSM8K rows and its ``####`` scorer (strict and flexible extraction).
- `jetrl.tasks.math`: MATH and DeepMath-103K rows, graded by math-verify.
- `jetrl.tasks.reward`: ``compute_score(data_source, solution_str, ground_truth, extra_info=None, **kw)``,
  verl's ``custom_reward_function``, dispatching on ``data_source``.
- `jetrl.tasks.rows`: verl's parquet row schema; `jetrl.tasks.parquet`: reading source files, writing
  ``{train,test}.parquet`` (the ``scripts/data/*.py`` drivers).

Nothing heavy is imported here; import the submodule you need.
"""
