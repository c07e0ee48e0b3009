"""Token batches and the mixed-precision optimizer (no engine)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from jetrl.train.policy import MixedPrecisionAdamW, make_batch


def test_make_batch_layout():
    b = make_batch([[1, 5, 6], [1, 7]], [[8, 2], [9, 10, 2]], [[-0.5, -0.25], [-1.0, -2.0, -3.0]], pad_id=0)
    assert b.input_ids.tolist() == [[1, 5, 6, 8, 2], [1, 7, 9, 10, 2]]
    # position t predicts token t+1: sample 0's response starts at t=2, sample 1's at t=1
    assert b.mask.tolist() == [[0, 0, 1, 1], [0, 1, 1, 1]]
    assert b.rollout_logp.tolist() == [[0, 0, -0.5, -0.25], [0, -1.0, -2.0, -3.0]]
    assert b.targets.tolist() == [[5, 6, 8, 2], [7, 9, 10, 2]]
    assert b.response_len.tolist() == [2, 3]
    sub = b.select([1])
    assert sub.input_ids.tolist() == [[1, 7, 9, 10, 2]]
    with pytest.raises(ValueError, match="sample 0 has 2 response tokens but 1 log-probs"):
        make_batch([[1]], [[3, 2]], [[-1.0]], pad_id=0)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)).to(torch.bfloat16)


def test_mixed_precision_adamw_accumulates_fp32_and_updates_bf16():
    m = _model()
    opt = MixedPrecisionAdamW(m, lr=1e-2, betas=(0.9, 0.99))
    x = torch.randn(8, 4)
    for _ in range(2):  # two micro-batches accumulate
        m(x.to(torch.bfloat16)).float().pow(2).mean().backward()
    assert all(p.grad is None for p in m.parameters())  # moved into main_grad by the hook
    assert all(p.main_grad.dtype == torch.float32 and p.main_grad.abs().sum() > 0 for p in m.parameters())
    before = [p.detach().clone() for p in m.parameters()]
    norm = opt.step()
    assert norm > 0 and opt.steps == 1
    for p, b, master in zip(m.parameters(), before, opt.masters, strict=True):
        assert p.dtype == torch.bfloat16 and not torch.equal(p, b)
        assert torch.equal(p, master.to(torch.bfloat16))  # bf16 params are the rounded masters
        assert p.main_grad.abs().sum() == 0  # zeroed for the next step
    # AdamW's first step moves each master by ~lr (bias-corrected m/sqrt(v) = sign of the gradient)
    delta = (opt.masters[0].detach() - before[0].float()).abs()
    assert float(delta.max()) == pytest.approx(1e-2, rel=0.2)


def test_mixed_precision_adamw_state_round_trip_and_nonfinite():
    m = _model()
    opt = MixedPrecisionAdamW(m, lr=1e-2, grad_clip=1.0)
    m(torch.randn(2, 4).to(torch.bfloat16)).float().sum().backward()
    opt.step()
    state = opt.state_dict()
    m2 = _model()
    opt2 = MixedPrecisionAdamW(m2, lr=1e-2, grad_clip=1.0)
    opt2.load_state_dict(state)
    assert opt2.steps == 1
    for a, b in zip(m.parameters(), m2.parameters(), strict=True):
        assert torch.equal(a, b)
    for p in m2.parameters():
        p.main_grad.fill_(float("nan"))
    with pytest.raises(FloatingPointError, match="non-finite gradient norm"):
        opt2.step()
