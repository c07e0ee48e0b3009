"""GRPO / DAPO pieces against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from jetrl.train import algo


def test_group_advantages_hand_values():
    # group 1: [1, 0, 0, 1] mean 0.5, unbiased std sqrt(1/3); group 2 all equal -> 0
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    a = algo.group_advantages(r, 4, eps=0.0)
    s = math.sqrt(1.0 / 3.0)
    want = torch.tensor([0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s, 0, 0, 0, 0])
    torch.testing.assert_close(a, want)
    # Dr. GRPO: centred only
    centred = algo.group_advantages(r, 4, norm_by_std=False)
    torch.testing.assert_close(centred, torch.tensor([0.5, -0.5, -0.5, 0.5] + [0.0] * 4))


def test_group_advantages_rejects_ragged_groups():
    with pytest.raises(ValueError, match="group_size=3"):
        algo.group_advantages(torch.zeros(8), 3)


def test_groups_with_signal():
    r = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    assert algo.groups_with_signal(r, 2).tolist() == [False, True, False]


def test_overlong_penalty_hand_values():
    # max_len 8, buffer 4: free up to 4 tokens, then -(L-4)/4
    lengths = torch.tensor([1, 4, 5, 6, 8, 9])
    got = algo.overlong_penalty(lengths, max_len=8, buffer_len=4, factor=1.0)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0]))
    got = algo.overlong_penalty(lengths, max_len=8, buffer_len=4, factor=0.5)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, -0.125, -0.25, -0.5, -0.5]))
    with pytest.raises(ValueError, match="buffer_len"):
        algo.overlong_penalty(lengths, max_len=8, buffer_len=0)


def test_token_logprobs_and_entropy():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [math.log(3.0), 0.0, -1e9, -1e9]])
    lp = algo.token_logprobs(logits, torch.tensor([2, 0]))
    torch.testing.assert_close(lp, torch.tensor([math.log(0.25), math.log(0.75)]))
    ent = algo.entropy_from_logits(logits)
    want1 = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    torch.testing.assert_close(ent, torch.tensor([math.log(4.0), want1]))


def test_aggregate_loss_modes():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    # token-mean: (1+2+3+4)/4; seq-mean-token-mean: (2 + 4)/2; seq-mean-token-sum: (6 + 4)/2
    assert float(algo.aggregate_loss(loss, mask, "token-mean")) == pytest.approx(2.5)
    assert float(algo.aggregate_loss(loss, mask, "seq-mean-token-mean")) == pytest.approx(3.0)
    assert float(algo.aggregate_loss(loss, mask, "seq-mean-token-sum")) == pytest.approx(5.0)
    # micro-batch denominators: the two rows as separate micro-batches sum to the whole
    a = algo.aggregate_loss(loss[:1], mask[:1], "token-mean", num_tokens=4)
    b = algo.aggregate_loss(loss[1:], mask[1:], "token-mean", num_tokens=4)
    assert float(a + b) == pytest.approx(2.5)
    with pytest.raises(ValueError, match="unknown mode"):
        algo.aggregate_loss(loss, mask, "sum")


def test_policy_loss_clip_higher_hand_values():
    # ratios: 1.5 (A>0: clipped at 1+ch), 0.5 (A>0: unclipped, pessimistic), 0.5 (A<0: clipped at 1-cl),
    # 1.1 (A<0, inside: unclipped)
    ratio = torch.tensor([[1.5, 0.5, 0.5, 1.1]])
    logp = torch.log(ratio).requires_grad_(True)
    old = torch.zeros_like(logp)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    mask = torch.ones_like(logp)
    loss, st = algo.policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, loss_agg="token-mean")
    # per token: -min(r*A, clip(r)*A): -1.28, -0.5, +0.8, +1.1
    assert float(loss.detach()) == pytest.approx((-1.28 - 0.5 + 0.8 + 1.1) / 4)
    assert st["clip_frac"] == pytest.approx(0.5)
    loss.backward()
    # gradient flows only through unclipped tokens: d(-A r)/dlogp = -A r
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -0.5, 0.0, 1.1]]) / 4)


def test_policy_loss_symmetric_clip_differs_from_clip_higher():
    logp = torch.log(torch.tensor([[1.25]]))
    old = torch.zeros_like(logp)
    adv, mask = torch.ones(1), torch.ones(1, 1)
    _, grpo = algo.policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2, loss_agg="token-mean")
    _, dapo = algo.policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, loss_agg="token-mean")
    assert grpo["clip_frac"] == 1.0 and dapo["clip_frac"] == 0.0


def test_policy_loss_is_weights_scale_tokens():
    logp = torch.zeros(1, 2)
    adv, mask = torch.ones(1), torch.ones(1, 2)
    w = torch.tensor([[2.0, 0.5]])
    loss, _ = algo.policy_loss(logp, logp, adv, mask, clip_low=0.2, clip_high=0.2, loss_agg="token-mean", is_weights=w)
    assert float(loss) == pytest.approx(-(2.0 + 0.5) / 2)


def test_mismatch_metrics_hand_values():
    trainer = torch.tensor([[-1.0, -2.0, -3.0]])
    rollout = torch.tensor([[-1.1, -2.0, -9.0]])
    mask = torch.tensor([[1, 1, 0]])
    m = algo.mismatch_metrics(trainer, rollout, mask)
    assert m["mismatch/logp_abs_diff_mean"] == pytest.approx(0.05)
    assert m["mismatch/logp_abs_diff_max"] == pytest.approx(0.1)
    assert m["mismatch/is_ratio_mean"] == pytest.approx((math.exp(0.1) + 1.0) / 2)
    assert m["mismatch/is_ratio_max"] == pytest.approx(math.exp(0.1))
    assert m["mismatch/kl_k3"] == pytest.approx((math.exp(0.1) - 1 - 0.1) / 2)
    with pytest.raises(ValueError, match="no response token"):
        algo.mismatch_metrics(trainer, rollout, torch.zeros_like(mask))


def test_truncated_is_weights():
    w = algo.truncated_is_weights(torch.tensor([0.0, 1.0]), torch.tensor([0.0, -1.0]), cap=2.0)
    torch.testing.assert_close(w, torch.tensor([1.0, 2.0]))


def test_pass_at_k_hand_values():
    # group 1: 1 of 4 correct -> pass@2 = 1 - C(3,2)/C(4,2) = 1 - 3/6; group 2: none; group 3: all
    c = torch.tensor([1, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1])
    assert algo.pass_at_k(c, 4, 2) == pytest.approx((0.5 + 0.0 + 1.0) / 3)
    assert algo.pass_at_k(c, 4, 1) == pytest.approx((0.25 + 0.0 + 1.0) / 3)
    with pytest.raises(ValueError, match="k=5"):
        algo.pass_at_k(c, 4, 5)


def test_kl_penalty_hand_values_and_gradients():
    d = torch.tensor([[0.0, 0.5, -0.5, -20.0]])
    ref = torch.full_like(d, -1.0)
    logp = (ref + d).requires_grad_(True)
    assert torch.equal(algo.kl_penalty(logp, ref, "k1"), d)
    assert torch.equal(algo.kl_penalty(logp, ref, "abs"), d.abs())
    torch.testing.assert_close(algo.kl_penalty(logp, ref, "k2"), 0.5 * d.square())
    k3 = algo.kl_penalty(logp, ref, "k3")
    want = torch.tensor([[0.0, math.exp(-0.5) - 1 + 0.5, math.exp(0.5) - 1 - 0.5, 10.0]])  # exp(20) clamps to 10
    torch.testing.assert_close(k3, want)
    assert (k3 >= 0).all()
    # d k3 / d logp = 1 - exp(-d) (0 where clamped); the reference gets no gradient
    k3[:, :3].sum().backward()
    torch.testing.assert_close(logp.grad[0, :3], 1 - torch.exp(-d[0, :3]))
    assert logp.grad[0, 3] == 0
    with pytest.raises(ValueError, match="unknown kind 'low_var'"):
        algo.kl_penalty(logp, ref, "low_var")
    with pytest.raises(ValueError, match="differ"):
        algo.kl_penalty(logp, ref[:, :2], "k3")
