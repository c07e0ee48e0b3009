"""jetrl's verl metrics: log-space mismatch over response tokens, garbage at masked positions ignored (the
sync metrics and the per-step hook: test_verl_step_metrics.py)."""

import math

import pytest
import torch

from jetrl.verl.metrics import METRIC_KEYS, mismatch_metrics


def test_mismatch_is_log_space_over_response_tokens_only():
    trainer = torch.tensor([[-1.0, -2.0, float("nan")], [-0.5, float("-inf"), 7.0]])
    rollout = torch.tensor([[-1.5, -2.0, 3.0], [-0.25, float("inf"), float("nan")]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    m = mismatch_metrics(trainer, rollout, mask)
    diffs = [0.5, 0.0, -0.25]
    assert m["mismatch/tokens"] == 3
    assert m["mismatch/logp_abs_diff_mean"] == pytest.approx(0.25, abs=1e-12)
    assert m["mismatch/logp_abs_diff_max"] == pytest.approx(0.5, abs=1e-12)
    assert m["mismatch/is_ratio_mean"] == pytest.approx(sum(math.exp(d) for d in diffs) / 3, abs=1e-12)
    assert m["mismatch/is_ratio_max"] == pytest.approx(math.exp(0.5), abs=1e-12)
    assert m["mismatch/logp_equal_share"] == pytest.approx(1 / 3, abs=1e-12)  # the one -2.0 == -2.0
    assert mismatch_metrics(trainer, trainer, mask)["mismatch/logp_equal_share"] == 1.0
    assert set(m) <= set(METRIC_KEYS)


def test_bad_inputs_are_refused_with_the_reason():
    t = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="shapes differ"):
        mismatch_metrics(t, torch.zeros(2, 4), torch.ones(2, 3))
    with pytest.raises(ValueError, match="selects no token"):
        mismatch_metrics(t, t, torch.zeros(2, 3))
    with pytest.raises(ValueError, match="1 of 6 response tokens"):
        mismatch_metrics(t, torch.tensor([[0.0, 0, 0], [0, 0, float("nan")]]), torch.ones(2, 3))
