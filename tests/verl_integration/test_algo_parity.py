"""`jetrl.train.algo` computes what verl 0.9.1's ``verl.trainer.ppo.core_algos`` computes (issue 16.5).

Same inputs into both, compared bitwise (``torch.equal``, NaN equal to NaN at the same place): GRPO
outcome advantages, every loss aggregation mode (with verl's default denominators and with the
mini-batch totals the trainers pass), the vanilla PPO policy loss with clip-higher, dual-clip, the
log-ratio clamp and IS weights (loss, gradient, metrics), and every KL kind (value, gradient), on
ordinary, extreme and garbage inputs. Where jetrl keeps a deliberate difference (garbage at masked
positions, singleton groups, ``eps = 0``, ``|d| > 2.6e19`` in the '+' KL kinds) a test pins both
sides. No tolerance is needed except for verl's *vectorized* GRPO estimator, which uses a one-pass
variance (``(sum2 - sum^2/n) / (n - 1)``) and so rounds differently from ``torch.std``.

No file of this directory may be called ``__init__.py``: with pytest's default import mode it would
make ``tests/`` a path entry and this directory the package ``verl``, shadowing the real one.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

verl = pytest.importorskip("verl", reason="verl 0.9.1 is not installed in this environment (the parity oracle)")
core_algos = pytest.importorskip("verl.trainer.ppo.core_algos", reason="verl's core_algos does not import here")
ActorConfig = pytest.importorskip("verl.workers.config", reason="verl's worker configs do not import").ActorConfig

from jetrl.train import algo  # noqa: E402

GARBAGE = (math.nan, math.inf, -math.inf, 1e30, -1e30)


def test_verl_version():
    assert verl.__version__ == "0.9.1", f"parity is pinned against verl 0.9.1, found {verl.__version__}"


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal values (NaN matching NaN), dtypes and shapes."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


# Batches: (name, N, T, lengths-or-None for random): hostile shapes next to ordinary ones.
SHAPES = [
    ("1x1", 1, 1, [1]),
    ("ragged-with-empty-rows", 6, 9, [9, 1, 0, 5, 7, 0]),
    ("all-full", 4, 16, [16, 16, 16, 16]),
    ("random-64x300", 64, 300, None),
    ("13x129", 13, 129, None),
]


def _mask(n: int, t: int, lengths, gen: torch.Generator) -> torch.Tensor:
    if lengths is None:
        lengths = torch.randint(0, t + 1, (n,), generator=gen).tolist()
    return (torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]).to(torch.float32)


def _inputs(n: int, t: int, lengths, seed: int, extreme: bool = False):
    """log_prob, old_log_prob, token-level advantages (0 off the mask, as verl's estimators give),
    IS weights, float mask. `extreme`: some real tokens get log-ratios of +-50 / +-1e30 (clamped to
    +-20 by both) and advantages of +-1e3."""
    g = torch.Generator().manual_seed(seed)
    mask = _mask(n, t, lengths, g)
    old = -torch.rand(n, t, generator=g) * 5
    logp = old + torch.randn(n, t, generator=g) * 0.3
    adv = torch.randn(n, generator=g)
    if extreme:
        pick = torch.rand(n, t, generator=g)
        logp = torch.where(pick < 0.05, old + 50, logp)
        logp = torch.where((pick >= 0.05) & (pick < 0.1), old - 50, logp)
        logp = torch.where((pick >= 0.1) & (pick < 0.12), torch.full_like(logp, 1e30), logp)
        logp = torch.where((pick >= 0.12) & (pick < 0.14), torch.full_like(logp, -1e30), logp)
        adv = adv * 1e3
    is_w = torch.rand(n, t, generator=g) * 2
    return logp, old, adv[:, None] * mask, is_w, mask


def _poison(x: torch.Tensor, mask: torch.Tensor, seed: int) -> torch.Tensor:
    vals = torch.tensor(GARBAGE, dtype=x.dtype)
    pick = vals[(torch.arange(x.numel()) + seed) % len(vals)].reshape(x.shape)
    return torch.where(mask.bool(), x, pick)


# ------------------------------------------------------------------------------------- advantages


def _verl_grpo(scores: torch.Tensor, group_size: int, t: int, **kw) -> torch.Tensor:
    """verl's GRPO advantage of `scores` (group-major), one reward per sequence at its first token."""
    n = scores.numel()
    rewards = torch.zeros(n, t)
    rewards[:, 0] = scores  # r + 0 + ... + 0 == r: the token sum verl takes is the score itself
    index = np.array([f"uid-{i // group_size}" for i in range(n)], dtype=object)
    adv, ret = core_algos.compute_grpo_outcome_advantage(rewards, torch.ones(n, t), index, **kw)
    assert adv is ret or _same(adv, ret)
    return adv


REWARDS = {
    "binary": lambda g, n: torch.randint(0, 2, (n,), generator=g).to(torch.float32),
    "continuous": lambda g, n: torch.randn(n, generator=g),
    "large": lambda g, n: torch.randn(n, generator=g) * 1e6,
    "tiny-spread": lambda g, n: 1.0 + torch.randn(n, generator=g) * 1e-7,
    "shaped": lambda g, n: torch.randint(0, 2, (n,), generator=g) - torch.rand(n, generator=g) * 0.5,
}


@pytest.mark.parametrize("kind", list(REWARDS))
@pytest.mark.parametrize("group_size", [2, 3, 5, 8, 16, 64])
@pytest.mark.parametrize("norm_by_std, eps", [(True, 1e-6), (True, 0.1), (False, 1e-6)])
def test_grpo_advantages_bitwise(kind, group_size, norm_by_std, eps):
    g = torch.Generator().manual_seed(group_size)
    for n_groups in (1, 7, 32):
        scores = REWARDS[kind](g, n_groups * group_size)
        ours = algo.group_advantages(scores, group_size, norm_by_std=norm_by_std, eps=eps)
        theirs = _verl_grpo(scores, group_size, 3, epsilon=eps, norm_adv_by_std_in_grpo=norm_by_std)
        assert _same(ours[:, None].expand(-1, 3), theirs), f"{kind=} {group_size=} {n_groups=}"


@pytest.mark.parametrize("group_size", [2, 5, 16])
def test_grpo_vectorized_estimator_within_rounding(group_size):
    """verl's ``grpo_vectorized`` estimator: same formula, one-pass variance, so float32 rounding
    differs from ``torch.std``; rewards in [0, 1] keep the difference at a few ulps of the result."""
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(32 * group_size, generator=g)
    index = np.array([f"uid-{i // group_size}" for i in range(scores.numel())], dtype=object)
    rewards = torch.zeros(scores.numel(), 4)
    rewards[:, 0] = scores
    theirs, _ = core_algos.compute_grpo_vectorized_outcome_advantage(rewards, torch.ones_like(rewards), index)
    ours = algo.group_advantages(scores, group_size)
    torch.testing.assert_close(ours[:, None].expand(-1, 4), theirs, rtol=1e-5, atol=1e-5)


def test_grpo_advantages_deliberate_differences():
    """Pinned differences: a lone sample gets 0 here and ``r / (1 + eps)`` in verl; equal rewards with
    ``eps = 0`` get 0 here and ``0 / 0 = NaN`` in verl."""
    r = torch.tensor([3.0, -2.0, 0.5])
    assert torch.equal(algo.group_advantages(r, 1), torch.zeros(3))
    assert torch.equal(_verl_grpo(r, 1, 1)[:, 0], r / (1 + 1e-6))
    eq = torch.ones(4)
    assert torch.equal(algo.group_advantages(eq, 2, eps=0.0), torch.zeros(4))
    assert _verl_grpo(eq, 2, 1, epsilon=0.0).isnan().all()


# ------------------------------------------------------------------------------------- aggregation


def _verl_agg(loss, mask, mode, **kw):
    return core_algos.agg_loss(loss_mat=loss, loss_mask=mask, loss_agg_mode=mode, **kw)


def test_every_verl_mode_is_known():
    modes = set()
    for mode in ("token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        _verl_agg(torch.ones(2, 2), torch.ones(2, 2), mode)
        modes.add(mode)
    with pytest.raises(ValueError):
        _verl_agg(torch.ones(2, 2), torch.ones(2, 2), "seq-sum")
    assert set(algo.LOSS_AGG_MODES) == modes


@pytest.mark.parametrize("mode", algo.LOSS_AGG_MODES)
@pytest.mark.parametrize("name, n, t, lengths", SHAPES, ids=[s[0] for s in SHAPES])
@pytest.mark.parametrize("bool_mask", [False, True], ids=["float-mask", "bool-mask"])
@pytest.mark.parametrize("totals", [False, True], ids=["own-denominators", "mini-batch-totals"])
def test_agg_loss_bitwise(mode, name, n, t, lengths, bool_mask, totals):
    g = torch.Generator().manual_seed(n * 1000 + t)
    mask = _mask(n, t, lengths, g)
    if not mask.any() and not totals:
        pytest.skip("an empty mask with own denominators: jetrl raises (pinned in test_empty_batch_...)")
    loss = (torch.randn(n, t, generator=g) * 10).requires_grad_(True)
    m = mask.bool() if bool_mask else mask
    kw, ours_kw = {}, {}
    if totals:  # what the trainers pass for a micro-batch of a larger mini-batch
        kw = dict(batch_num_tokens=int(mask.sum()) + 17, global_batch_size=n + 3, loss_scale_factor=t + 5)
        ours_kw = dict(num_tokens=kw["batch_num_tokens"], num_seqs=kw["global_batch_size"])
        ours_kw["loss_scale_factor"] = kw["loss_scale_factor"]
    ours = algo.aggregate_loss(loss, m, mode, **ours_kw)
    (g_ours,) = torch.autograd.grad(ours, loss)
    theirs = _verl_agg(loss, m, mode, **kw)
    (g_theirs,) = torch.autograd.grad(theirs, loss)
    assert _same(ours, theirs.to(ours.dtype)) and ours.dtype == theirs.dtype, f"{ours.item()!r} != {theirs.item()!r}"
    assert _same(g_ours, g_theirs)


def test_empty_batch_raises_where_verl_returns_silently():
    """Pinned difference: no response token at all raises here; verl returns 0 / 0 = NaN (0 tokens or
    0 sequences as the denominator). token-sum is 0 in both."""
    loss, mask = torch.ones(2, 3), torch.zeros(2, 3)
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        with pytest.raises(ValueError, match=mode):
            algo.aggregate_loss(loss, mask, mode)
        assert _verl_agg(loss, mask, mode).isnan(), mode
    assert float(algo.aggregate_loss(loss, mask, "token-sum")) == float(_verl_agg(loss, mask, "token-sum")) == 0.0


# ------------------------------------------------------------------------------------- policy loss

POLICY_CASES = [
    # (clip_low, clip_high, clip_ratio_c): GRPO defaults, DAPO clip-higher with its dual-clip 10
    (0.2, 0.2, 3.0),
    (0.2, 0.28, 10.0),
    (0.1, 0.5, 1.5),
]


def _verl_policy(logp, old, adv, mask, mode, clip, *, is_w=None, totals=None):
    low, high, c = clip
    cfg = ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio=low,
        clip_ratio_low=low,
        clip_ratio_high=high,
        clip_ratio_c=c,
        loss_agg_mode=mode,
    )
    cfg.global_batch_info.update(totals or {})
    return core_algos.get_policy_loss_fn("vanilla")(
        old_log_prob=old,
        log_prob=logp,
        advantages=adv,
        response_mask=mask,
        loss_agg_mode=mode,
        config=cfg,
        rollout_is_weights=is_w,
    )


def _ours_policy(logp, old, adv, mask, mode, clip, *, is_w=None, totals=None):
    low, high, c = clip
    totals = totals or {}
    return algo.policy_loss(
        logp,
        old,
        adv,
        mask,
        clip_low=low,
        clip_high=high,
        clip_ratio_c=c,
        loss_agg=mode,
        is_weights=is_w,
        num_tokens=totals.get("batch_num_tokens"),
        num_seqs=totals.get("global_batch_size"),
        loss_scale_factor=totals.get("loss_scale_factor"),
    )


def _compare_policy(ours_in, theirs_in, mask, mode, clip, *, with_is, totals, ctx):
    """Loss, d loss / d log_prob and the metrics of both, each from its own copy of the inputs."""
    out = []
    for fn, (logp, old, adv, is_w) in ((_ours_policy, ours_in), (_verl_policy, theirs_in)):
        lp = logp.clone().requires_grad_(True)
        m = mask.bool() if fn is _verl_policy else mask  # verl's ppo_loss hands it a bool mask
        loss, stats = fn(lp, old, adv, m, mode, clip, is_w=is_w if with_is else None, totals=totals)
        (grad,) = torch.autograd.grad(loss, lp)
        out.append((loss.detach(), grad, stats))
    (l_o, g_o, s_o), (l_t, g_t, s_t) = out
    assert _same(l_o, l_t), f"{ctx}: loss {l_o.item()!r} != verl {l_t.item()!r}"
    assert _same(g_o, g_t), f"{ctx}: grad differs at {int((g_o != g_t).sum())} of {g_o.numel()} positions"
    assert s_o["clip_frac"] == s_t["actor/pg_clipfrac"], ctx
    assert s_o["clip_frac_lower"] == s_t["actor/pg_clipfrac_lower"], ctx
    assert s_o["approx_kl"] == s_t["actor/ppo_kl"], ctx
    return l_o, g_o


@pytest.mark.parametrize("mode", algo.LOSS_AGG_MODES)
@pytest.mark.parametrize("clip", POLICY_CASES, ids=lambda c: f"clip{c[0]}-{c[1]}-c{c[2]}")
@pytest.mark.parametrize("extreme", [False, True], ids=["ordinary", "extreme"])
def test_policy_loss_bitwise(mode, clip, extreme):
    for i, (name, n, t, lengths) in enumerate(SHAPES):
        logp, old, adv, is_w, mask = _inputs(n, t, lengths, seed=i, extreme=extreme)
        if not mask.any():
            continue
        for with_is in (False, True):
            for totals in (
                None,
                dict(batch_num_tokens=int(mask.sum()) + 5, global_batch_size=n + 2, loss_scale_factor=t),
            ):
                ctx = f"{name} {mode=} {clip=} {extreme=} {with_is=} {totals=}"
                loss, grad = _compare_policy(
                    (logp, old, adv, is_w),
                    (logp, old, adv, is_w),
                    mask,
                    mode,
                    clip,
                    with_is=with_is,
                    totals=totals,
                    ctx=ctx,
                )
                assert torch.isfinite(loss) and torch.isfinite(grad).all(), ctx


def test_dual_clip_is_active_in_both():
    """A negative advantage on a token whose ratio blew up: both cap the loss at -A * clip_ratio_c."""
    logp, old = torch.tensor([[math.log(8.0), 0.0]]), torch.zeros(1, 2)
    adv, mask = torch.tensor([[-1.0, 1.0]]), torch.ones(1, 2)
    for c in (3.0, 10.0):
        loss, grad = _compare_policy(
            (logp, old, adv, None),
            (logp, old, adv, None),
            mask,
            "token-sum",
            (0.2, 0.2, c),
            with_is=False,
            totals=None,
            ctx=f"{c=}",
        )
        assert float(loss) == pytest.approx(min(8.0, c) - 1.0)


def test_policy_loss_garbage_at_masked_positions():
    """Pinned difference: NaN / inf / 1e30 at masked positions give jetrl exactly verl's result on the
    clean batch (loss, gradient, metrics), while verl itself leaks them: a NaN loss in the seq-mean
    modes, and in token-mean a NaN gradient at the masked positions when the garbage sits in the
    advantages or IS weights (garbage log-probs are stopped there by the clamp's zero gradient)."""
    for i, (name, n, t, lengths) in enumerate(SHAPES[1:], start=1):
        logp, old, adv, is_w, mask = _inputs(n, t, lengths, seed=i)
        if bool(mask.all()):
            continue
        dirty = tuple(_poison(x, mask, i + k) for k, x in enumerate((logp, old, adv, is_w)))
        half_dirty = (logp, old, *dirty[2:])  # finite log-probs, garbage advantages and IS weights
        for mode in algo.LOSS_AGG_MODES:
            for clip in POLICY_CASES:
                for bad in (dirty, half_dirty):
                    _compare_policy(bad, (logp, old, adv, is_w), mask, mode, clip, with_is=True, totals=None, ctx=name)
        for mode in ("seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
            loss, _ = _verl_policy(dirty[0], *dirty[1:3], mask.bool(), mode, POLICY_CASES[0], is_w=dirty[3])
            assert loss.isnan(), (
                f"{name} {mode}: verl now filters masked positions; revisit jetrl.train.algo's docstring"
            )
        lp = logp.clone().requires_grad_(True)
        loss, _ = _verl_policy(lp, old, half_dirty[2], mask.bool(), "token-mean", POLICY_CASES[0], is_w=half_dirty[3])
        (grad,) = torch.autograd.grad(loss, lp)
        assert torch.isfinite(loss) and grad[mask == 0].isnan().any(), name


# ------------------------------------------------------------------------------------- KL


def test_every_verl_kl_kind_is_known():
    for kind in algo.KL_TYPES:
        core_algos.kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), kind)
    with pytest.raises(NotImplementedError):
        core_algos.kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "k4")
    with pytest.raises(ValueError, match="k4"):
        algo.kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "k4")


def _kl_inputs(seed: int, extreme: bool):
    g = torch.Generator().manual_seed(seed)
    ref = -torch.rand(16, 33, generator=g) * 8
    d = torch.randn(16, 33, generator=g) * (30.0 if extreme else 0.5)  # extreme: beyond the +-20 clamp
    if extreme:
        d[0, :6] = torch.tensor([1e3, -1e3, 1e15, -1e15, 20.0, -20.0])
    return ref + d, ref


@pytest.mark.parametrize("kind", algo.KL_TYPES)
@pytest.mark.parametrize("extreme", [False, True], ids=["ordinary", "extreme"])
def test_kl_penalty_bitwise(kind, extreme):
    logp, ref = _kl_inputs(len(kind), extreme)
    mask = _mask(16, 33, None, torch.Generator().manual_seed(1))
    for use_mask in (False, True):
        res = []
        for fn in (algo.kl_penalty, core_algos.kl_penalty):
            lp = logp.clone().requires_grad_(True)
            kl = fn(lp, ref, kind, mask=mask) if use_mask and fn is algo.kl_penalty else fn(lp, ref, kind)
            loss = (
                algo.aggregate_loss(kl, mask, "token-mean")
                if fn is algo.kl_penalty
                else core_algos.agg_loss(kl, mask, "token-mean")
            )
            (grad,) = torch.autograd.grad(loss, lp)
            res.append((kl.detach(), loss.detach(), grad))
        (k_o, l_o, g_o), (k_t, l_t, g_t) = res
        ctx = f"{kind=} {extreme=} {use_mask=}"
        assert _same(k_o * mask, k_t * mask) and _same(l_o, l_t) and _same(g_o, g_t), ctx
        if not use_mask:
            assert _same(k_o, k_t), ctx
        assert torch.isfinite(l_o) and torch.isfinite(g_o).all(), ctx


@pytest.mark.parametrize("kind", ["k3", "low_var_kl", "k3+", "k1", "abs+", "k2"])
def test_kl_penalty_garbage_at_masked_positions(kind):
    """With the mask, garbage at masked positions gives jetrl verl's result on the clean batch."""
    logp, ref = _kl_inputs(3, False)
    mask = _mask(16, 33, None, torch.Generator().manual_seed(2))
    lp = _poison(logp, mask, 0).requires_grad_(True)
    kl = algo.kl_penalty(lp, _poison(ref, mask, 3), kind, mask=mask)
    loss = algo.aggregate_loss(kl, mask, "seq-mean-token-mean")
    (grad,) = torch.autograd.grad(loss, lp)
    lp_t = logp.clone().requires_grad_(True)
    loss_t = core_algos.agg_loss(core_algos.kl_penalty(lp_t, ref, kind), mask, "seq-mean-token-mean")
    (grad_t,) = torch.autograd.grad(loss_t, lp_t)
    assert _same(loss.detach(), loss_t.detach()) and _same(grad, grad_t)


def test_straight_through_kl_stays_finite_where_verl_overflows():
    """Pinned difference: for |d| > 2.6e19 verl's '+' kinds compute ``0.5 d^2 - 0.5 d^2 = inf - inf``
    (NaN); jetrl's form gives the estimator's value and the gradient d, both finite."""
    ref = torch.zeros(1, 2)
    logp = torch.tensor([[1e20, -1e20]])
    for kind in ("k3+", "k1+"):
        theirs = core_algos.kl_penalty(logp.clone().requires_grad_(True), ref, kind)
        assert theirs.isnan().any(), kind
        lp = logp.clone().requires_grad_(True)
        ours = algo.kl_penalty(lp, ref, kind)
        (grad,) = torch.autograd.grad(ours.sum(), lp)
        assert _same(ours.detach(), core_algos.kl_penalty(logp, ref, kind.rstrip("+"))), kind
        assert torch.equal(grad, logp), kind
