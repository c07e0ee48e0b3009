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


def test_token_logprobs_and_entropy_share_one_log_softmax_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 7, 1000, generator=g) * 4).to(torch.bfloat16)
    targets = torch.randint(0, 1000, (3, 7), generator=g)
    lp, ent = algo.token_logprobs_and_entropy(logits, targets)
    assert torch.equal(lp, algo.token_logprobs(logits, targets))
    assert torch.equal(ent, algo.entropy_from_logits(logits))


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


# --- verl alignment (issue 16.5): dual-clip, log-ratio clamp, garbage at masked positions -------------

GARBAGE = (math.nan, math.inf, -math.inf, 1e30, -1e30)


def _batch(seed: int = 0, n: int = 6, t: int = 9):
    """Random log-probs / advantages over ragged rows (one row with no response token at all)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([t, 1, 0, 5, t - 2, 3][:n])
    mask = (torch.arange(t)[None, :] < lengths[:, None]).to(torch.float32)
    old = -torch.rand(n, t, generator=g) * 3
    logp = old + torch.randn(n, t, generator=g) * 0.5
    adv = torch.randn(n, generator=g)
    is_w = torch.rand(n, t, generator=g) + 0.5
    return logp, old, adv, is_w, mask


def _poison(x: torch.Tensor, mask: torch.Tensor, seed: int) -> torch.Tensor:
    """`x` with garbage (NaN, +-inf, +-1e30, cycling) at every masked position."""
    vals = torch.tensor(GARBAGE, dtype=x.dtype)
    pick = vals[(torch.arange(x.numel()) + seed) % len(vals)].reshape(x.shape)
    return torch.where(mask.bool(), x, pick)


@pytest.mark.parametrize("mode", algo.LOSS_AGG_MODES)
@pytest.mark.parametrize("clip_ratio_c", [3.0, None], ids=["dual-clip", "no-dual-clip"])
def test_policy_loss_ignores_garbage_at_masked_positions(mode, clip_ratio_c):
    logp, old, adv, is_w, mask = _batch()
    tok_adv = adv[:, None] * mask

    def run(lp, o, a, w):
        lp = lp.clone().requires_grad_(True)
        loss, st = algo.policy_loss(
            lp, o, a, mask, clip_low=0.2, clip_high=0.28, clip_ratio_c=clip_ratio_c, loss_agg=mode, is_weights=w
        )
        loss.backward()
        return loss.detach(), lp.grad, st

    clean = run(logp, old, tok_adv, is_w)
    for seed in range(len(GARBAGE)):
        got = run(*(_poison(x, mask, seed + i) for i, x in enumerate((logp, old, tok_adv, is_w))))
        assert torch.equal(got[0], clean[0]), f"{mode=} {seed=}: loss {got[0]} != {clean[0]}"
        assert torch.isfinite(got[1]).all(), f"{mode=} {seed=}: non-finite grad {got[1]}"
        assert torch.equal(got[1], clean[1]) and not got[1][mask == 0].any(), f"{mode=} {seed=}"
        assert got[2] == clean[2]
    assert torch.isfinite(clean[0]) and clean[1].abs().sum() > 0


@pytest.mark.parametrize("kind", algo.KL_TYPES)
def test_kl_penalty_ignores_garbage_at_masked_positions(kind):
    logp, ref, _, _, mask = _batch(seed=1)

    def run(lp, r):
        lp = lp.clone().requires_grad_(True)
        kl = algo.kl_penalty(lp, r, kind, mask=mask)
        loss = algo.aggregate_loss(kl, mask, "seq-mean-token-mean")
        loss.backward()
        return kl.detach(), loss.detach(), lp.grad

    clean = run(logp, ref)
    for seed in range(len(GARBAGE)):
        kl, loss, grad = run(_poison(logp, mask, seed), _poison(ref, mask, seed + 2))
        assert torch.equal(kl, clean[0]) and not kl[mask == 0].any(), f"{kind=} {seed=}"
        assert torch.equal(loss, clean[1]) and torch.equal(grad, clean[2]), f"{kind=} {seed=}"
        assert torch.isfinite(grad).all() and not grad[mask == 0].any(), f"{kind=} {seed=}"


@pytest.mark.parametrize("kind", ["k3", "low_var_kl", "k3+", "k1+", "abs+"])
def test_kl_penalty_extreme_real_values_stay_finite(kind):
    """The k3 log-ratio is clamped to [-20, 20] before exp (verl): |d| = 100 or 1e30 at real tokens gives
    the clamped value 10 and a zero gradient, not exp(100) = inf and 0 * inf = NaN. The straight-through
    '+' kinds keep a finite value and k2's gradient d."""
    d = torch.tensor([[100.0, -100.0, 1e30, -1e30, 0.5]])
    ref = torch.full_like(d, -1.0)
    logp = (ref + d).requires_grad_(True)
    kl = algo.kl_penalty(logp, ref, kind)
    kl.sum().backward()
    assert torch.isfinite(kl).all() and torch.isfinite(logp.grad).all(), (kl, logp.grad)
    if kind in ("k3", "low_var_kl"):
        assert kl[0, :4].tolist() == [10.0] * 4 and not logp.grad[0, :4].any()
    if kind.endswith("+"):
        torch.testing.assert_close(logp.grad, (logp - ref).detach(), rtol=0, atol=0)


def test_policy_loss_dual_clip_hand_values():
    # A<0: ratio 5 -> capped at -A*c = 3 (no gradient); ratio 2 -> 2 (< 3, plain PPO); A>0: ratio 5 -> 1+ch
    ratio = torch.tensor([[5.0, 2.0, 5.0]])
    adv = torch.tensor([[-1.0, -1.0, 1.0]])
    old, mask = torch.zeros(1, 3), torch.ones(1, 3)
    logp = torch.log(ratio).requires_grad_(True)
    loss, st = algo.policy_loss(
        logp, old, adv, mask, clip_low=0.2, clip_high=0.28, clip_ratio_c=3.0, loss_agg="token-sum"
    )
    assert float(loss.detach()) == pytest.approx(3.0 + 2.0 - 1.28)
    assert st["clip_frac_lower"] == pytest.approx(1 / 3) and st["clip_frac"] == pytest.approx(1 / 3)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 2.0, 0.0]]))
    # off: the A<0 token at ratio 5 pays its full ratio
    off, st = algo.policy_loss(
        logp, old, adv, mask, clip_low=0.2, clip_high=0.28, clip_ratio_c=None, loss_agg="token-sum"
    )
    assert float(off.detach()) == pytest.approx(5.0 + 2.0 - 1.28) and st["clip_frac_lower"] == 0.0
    # verl's default is 3; the bound must exceed 1
    dflt, _ = algo.policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, loss_agg="token-sum")
    assert torch.equal(dflt, loss)
    with pytest.raises(ValueError, match="clip_ratio_c=1.0"):
        algo.policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2, clip_ratio_c=1.0, loss_agg="token-mean")


def test_policy_loss_clamps_log_ratio_before_exp():
    """logp - old_logp = +-50 is clamped to +-20 (verl): ratio exp(20) is finite and the clamped tokens
    get no gradient; without the clamp exp(100) would be inf and the A<0 loss inf."""
    logp = torch.tensor([[50.0, -50.0, 100.0]]).requires_grad_(True)
    old, mask = torch.zeros(1, 3), torch.ones(1, 3)
    adv = torch.tensor([[-1.0, 1.0, -1.0]])
    loss, st = algo.policy_loss(
        logp, old, adv, mask, clip_low=0.2, clip_high=0.2, clip_ratio_c=None, loss_agg="token-sum"
    )
    big = math.exp(20.0)
    assert float(loss.detach()) == pytest.approx(big - 0.8 + big, rel=1e-6)
    assert st["ratio_max"] == pytest.approx(big, rel=1e-6) and st["approx_kl"] == pytest.approx(-20 / 3)
    loss.backward()
    assert torch.equal(logp.grad, torch.zeros(1, 3))


def test_aggregate_loss_verl_modes_hand_values():
    loss = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0], [9.0, 9.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    # the empty third row is not a sequence of the default denominator (verl), its 9s never count
    assert float(algo.aggregate_loss(loss, mask, "token-sum")) == 10.0
    assert float(algo.aggregate_loss(loss, mask, "seq-mean-token-sum")) == 5.0
    assert float(algo.aggregate_loss(loss, mask, "seq-mean-token-mean")) == 3.0
    assert float(algo.aggregate_loss(loss, mask, "seq-mean-token-sum-norm")) == 5.0 / 4  # T = 4
    assert float(algo.aggregate_loss(loss, mask, "seq-mean-token-sum-norm", loss_scale_factor=10)) == 0.5
    assert float(algo.aggregate_loss(loss, mask, "seq-mean-token-sum", num_seqs=5)) == 2.0
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        with pytest.raises(ValueError, match=mode):
            algo.aggregate_loss(loss, torch.zeros_like(mask), mode)
    with pytest.raises(ValueError, match="loss_scale_factor=0"):
        algo.aggregate_loss(loss, mask, "seq-mean-token-sum-norm", loss_scale_factor=0)


def test_group_advantages_deliberate_differences_from_verl():
    """A group of one gets 0 (verl: r / (1 + eps)); equal rewards get 0 even with eps = 0 (verl: NaN)."""
    r = torch.tensor([3.0, -2.0])
    assert torch.equal(algo.group_advantages(r, 1), torch.zeros(2))
    assert torch.equal(algo.group_advantages(torch.ones(4), 4, eps=0.0), torch.zeros(4))
    with pytest.raises(ValueError, match="eps=-1"):
        algo.group_advantages(r, 2, eps=-1.0)
