"""verl 0.9.1's own loader (`verl.trainer.ppo.reward.get_custom_reward_fn`) accepts jetrl/tasks/reward.py by path."""

from __future__ import annotations

from pathlib import Path

import pytest

verl = pytest.importorskip("verl", reason="needs verl (the verl test environment installs verl==0.9.1)")

import jetrl.tasks  # noqa: E402

REWARD_FILE = Path(jetrl.tasks.__file__).parent / "reward.py"


def _fn(**reward_kwargs):
    from omegaconf import OmegaConf
    from verl.trainer.ppo.reward import get_custom_reward_fn

    cfg = OmegaConf.create(
        {
            "reward": {
                "custom_reward_function": {
                    "path": str(REWARD_FILE),
                    "name": "compute_score",
                    "reward_kwargs": reward_kwargs,
                }
            }
        }
    )
    return get_custom_reward_fn(cfg)


def test_verl_loads_reward_by_path():
    fn = _fn()
    # the reward managers call it with keywords (data_source, solution_str, ground_truth, extra_info)
    kw = {"extra_info": {"split": "test", "index": 3}}
    assert fn(data_source="openai/gsm8k", solution_str="#### 12", ground_truth="12", **kw) == {"score": 1.0, "acc": 1.0}
    out = fn(data_source="math", solution_str="\\boxed{\\frac{3}{6}}", ground_truth="\\frac12", **kw)
    assert out["score"] == 1.0 and out["acc"] == 1.0
    assert fn(data_source="jetrl/arithmetic", solution_str="4", ground_truth="5", **kw)["score"] == 0.0
    with pytest.raises(KeyError, match="no scorer for data_source 'nope'"):
        fn(data_source="nope", solution_str="", ground_truth="1", **kw)


def test_verl_reward_kwargs_reach_the_scorer():
    # custom_reward_function.reward_kwargs.method=flexible selects GSM8K's flexible extraction
    strict, flexible = _fn(), _fn(method="flexible")
    args = {"data_source": "openai/gsm8k", "solution_str": "The answer is 12.", "ground_truth": "12"}
    assert strict(**args)["acc"] == 0.0 and flexible(**args)["acc"] == 1.0
