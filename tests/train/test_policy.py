"""Token batches and the mixed-precision optimizer (no engine)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from jetrl.train.policy import MixedPrecisionAdamW, forward_logprobs, make_batch, micro_batches


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


def _ragged_batch():
    # real lengths (prompt + response): 8, 7, 11, 8, 16, 7 -> the batch is 16 wide
    lens = [(3, 5), (6, 1), (2, 9), (4, 4), (9, 7), (5, 2)]
    g = torch.Generator().manual_seed(0)
    prompts = [[1, *torch.randint(3, 60, (p - 1,), generator=g).tolist()] for p, _ in lens]
    responses = [torch.randint(3, 60, (r,), generator=g).tolist() for _, r in lens]
    logps = [(-torch.rand(r, generator=g) - 0.01).tolist() for _, r in lens]
    return make_batch(prompts, responses, logps, pad_id=0), [p + r for p, r in lens]


def test_trim_keeps_every_real_token():
    b, lengths = _ragged_batch()
    assert b.input_ids.shape == (6, 16)
    for rows in ([1], [0, 1], [1, 3, 5], [2, 0], [4, 1]):
        sub = b.select(rows)
        t = sub.trim()
        w = max(lengths[i] for i in rows)
        assert t.input_ids.shape == t.attention_mask.shape == (len(rows), w)
        assert t.targets.shape == t.mask.shape == t.rollout_logp.shape == (len(rows), w - 1)
        assert torch.equal(t.response_len, sub.response_len)
        # the cut-off columns are pure padding, the kept ones unchanged
        assert torch.equal(t.input_ids, sub.input_ids[:, :w]) and not sub.attention_mask[:, w:].any()
        assert torch.equal(t.attention_mask.sum(1), sub.attention_mask.sum(1))
        assert torch.equal(t.mask.sum(1), sub.mask.sum(1)) and not sub.mask[:, w - 1 :].any()
        assert torch.equal(t.rollout_logp[t.mask.bool()], sub.rollout_logp[sub.mask.bool()])
        assert torch.equal(t.targets, t.input_ids[:, 1:])
        # the width given from host lengths cuts the same
        assert all(torch.equal(a, c) for a, c in zip(vars(sub.trim(w)).values(), vars(t).values(), strict=True))
    # a batch at full width is returned as is
    assert torch.equal(b.trim().input_ids, b.input_ids)


def test_micro_batches_fixed_size_keeps_order():
    lengths = [5, 9, 2, 7, 3]
    assert micro_batches(lengths, [4, 0, 3, 1, 2], max_seqs=2, max_tokens=None) == [[4, 0], [3, 1], [2]]
    assert micro_batches(lengths, [1, 2], max_seqs=8, max_tokens=None) == [[1, 2]]
    assert micro_batches(lengths, [], max_seqs=2, max_tokens=None) == []


@pytest.mark.parametrize("max_seqs, max_tokens", [(64, 16), (64, 20), (3, 40), (64, 1000), (1, 16), (5, 31)])
def test_micro_batches_token_budget(max_seqs, max_tokens):
    g = torch.Generator().manual_seed(max_seqs * 1000 + max_tokens)
    lengths = torch.randint(1, 17, (40,), generator=g).tolist()
    idx = torch.randperm(40, generator=g)[:33].tolist()  # a mini-batch: a subset of the rows, in any order
    mbs = micro_batches(lengths, idx, max_seqs=max_seqs, max_tokens=max_tokens)
    assert sorted(i for mb in mbs for i in mb) == sorted(idx)  # every row exactly once
    for mb in mbs:
        assert 1 <= len(mb) <= max_seqs
        assert len(mb) * max(lengths[i] for i in mb) <= max_tokens
    # longest first, ties by row index; greedy: a micro-batch closes only when the next row does not fit
    flat = [i for mb in mbs for i in mb]
    assert flat == sorted(idx, key=lambda i: (-lengths[i], i))
    for mb in mbs[:-1]:
        assert len(mb) == max_seqs or (len(mb) + 1) * lengths[mb[0]] > max_tokens
    assert micro_batches(lengths, idx, max_seqs=max_seqs, max_tokens=max_tokens) == mbs  # deterministic


def test_micro_batches_packs_short_sequences_together():
    lengths = [10, 3, 3, 10, 4, 3]
    assert micro_batches(lengths, list(range(6)), max_seqs=64, max_tokens=20) == [[0, 3], [4, 1, 2, 5]]
    assert micro_batches(lengths, list(range(6)), max_seqs=3, max_tokens=20) == [[0, 3], [4, 1, 2], [5]]


def test_micro_batches_rejects_a_sequence_over_the_budget():
    with pytest.raises(ValueError, match=r"algo\.micro_batch_tokens: .*17 tokens.*budget of 16 tokens"):
        micro_batches([5, 17, 3], [0, 1, 2], max_seqs=4, max_tokens=16)
    with pytest.raises(ValueError, match="max_seqs=0"):
        micro_batches([5], [0], max_seqs=0, max_tokens=None)


@pytest.mark.parametrize("setup", ["fp32-sdpa", "fp32-eager", "vllm-cpu+jetrl-unified"])
def test_trimmed_forward_matches_untrimmed(setup):
    """A micro-batch trimmed to its longest sequence scores its response tokens as the full-width batch does.

    Only the padded key length changes, and padded keys carry exactly zero attention weight; what moves
    is the CPU attention kernels' reduction order over the keys (vector lanes and blocks over the key
    length; an all-ones mask also lets transformers drop the mask and take SDPA's ``is_causal`` path),
    so attention outputs differ in their last fp32 bits:

    - fp32 model: log-probs and entropies within a few fp32 ulps (max 4.3e-6 seen on 1922 random
      response tokens, log-probs of magnitude <= ~10 whose ulp is <= 1e-6): ``atol=2e-5``;
    - the demo's trainer (BF16, ``vllm-cpu`` numerics, ``jetrl-unified``): attention runs in fp32 and
      is rounded once to BF16, which rarely flips (about 0.3% of positions get one flipped element),
      and the next Linear's 1x128 FP8 quantization absorbs those flips: bit-equal (0 of 2840 random
      response tokens differed). HF's own BF16 SDPA kernel is not bit-stable across key lengths (up
      to 2e-2 in log-prob on this random tiny model), which is one reason the trainer uses ``vllm-cpu``.
    """
    from jetrl.tiny import build_tiny_model

    b, _ = _ragged_batch()
    model = build_tiny_model(0)
    if setup.startswith("fp32"):
        model = model.float()
        model.set_attn_implementation(setup.removeprefix("fp32-"))
    else:
        from jetrl.convert import convert_model
        from jetrl.rollout.engine_match import match_vllm_cpu

        match_vllm_cpu(model)
        convert_model(model, "jetrl-unified")
    with torch.no_grad():
        full, full_ent = forward_logprobs(model, b, with_entropy=True)
        # [1]: one sequence (all-ones mask); [4, 1]: contains the longest row; the others are narrower
        for rows in ([1], [0, 1], [1, 3, 5], [2, 0], [4, 1]):
            sub = b.select(rows).trim()
            w = sub.mask.shape[1]
            lp, ent = forward_logprobs(model, sub, with_entropy=True)
            assert lp.shape == ent.shape == (len(rows), w)
            m = sub.mask.bool()
            assert torch.equal(m, b.mask[rows, :w].bool())
            if setup.startswith("fp32"):
                torch.testing.assert_close(lp[m], full[rows, :w][m], rtol=0, atol=2e-5)
                torch.testing.assert_close(ent[m], full_ent[rows, :w][m], rtol=0, atol=2e-5)
            else:
                assert torch.equal(lp[m], full[rows, :w][m]), rows
                assert torch.equal(ent[m], full_ent[rows, :w][m]), rows


def _sdpa_calls(monkeypatch) -> list[dict]:
    """Record the mask / is_causal / enable_gqa of every SDPA call."""
    calls, sdpa = [], torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
        calls.append({"mask": attn_mask, "is_causal": is_causal, "gqa": kw.get("enable_gqa", False)})
        return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return calls


def test_causal_sdpa_scores_real_tokens_as_the_masked_model_with_no_mask_under_capture(monkeypatch):
    """``sdpa_causal`` (`use_causal_sdpa`) on right-padded rows: every response token's log-prob equals what
    transformers' masked SDPA gives (fp32, within kernel order), the padding's outputs are finite and its
    token ids change nothing, and SDPA gets no mask and ``is_causal`` with grouped-query heads, also while
    transformers believes it is tracing (as under CUDA-graph capture), where its own 'sdpa' builds a mask."""
    import transformers.masking_utils as mu

    from jetrl.tiny import build_tiny_model
    from jetrl.train.policy import CAUSAL_SDPA, use_causal_sdpa

    b, _ = _ragged_batch()
    assert not b.attention_mask.all()  # rows of different lengths: padding present
    hf = build_tiny_model(0).float()
    hf.set_attn_implementation("sdpa")
    ours = build_tiny_model(0).float()
    use_causal_sdpa(ours)
    assert ours.config._attn_implementation == CAUSAL_SDPA
    assert ours.config.num_key_value_heads < ours.config.num_attention_heads  # GQA is exercised
    monkeypatch.setattr(mu, "is_tracing", lambda *a, **k: True)
    calls = _sdpa_calls(monkeypatch)
    with torch.no_grad():
        want, _ = forward_logprobs(hf, b)
        assert calls and all(c["mask"] is not None for c in calls)  # transformers' path: a mask per layer
        calls.clear()
        got, _ = forward_logprobs(ours, b)
        other, _ = forward_logprobs(ours, _repadded(b, pad_id=7))
    assert len(calls) == 2 * ours.config.num_hidden_layers
    assert all(c["mask"] is None and c["is_causal"] and c["gqa"] for c in calls)
    m = b.mask.bool()
    torch.testing.assert_close(got[m], want[m], rtol=0, atol=2e-5)
    assert torch.isfinite(got).all()
    assert torch.equal(other[m], got[m])


def test_causal_sdpa_refuses_what_a_causal_mask_cannot_express():
    from jetrl.tiny import build_tiny_model
    from jetrl.train.policy import _causal_sdpa, use_causal_sdpa

    model = build_tiny_model(0)
    model.config.sliding_window, model.config.use_sliding_window = 16, True
    with pytest.raises(ValueError, match="uses sliding windows"):
        use_causal_sdpa(model)
    attn = build_tiny_model(0).model.layers[1].self_attn
    q, kv = torch.zeros(1, 4, 3, 8), torch.zeros(1, 2, 5, 8)
    with pytest.raises(ValueError, match=r"\(layer 1\): 3 queries over 5 keys"):
        _causal_sdpa(attn, q, kv, kv, None)
    with pytest.raises(ValueError, match="dropout=0.1"):
        _causal_sdpa(attn, q, q[:, :2], q[:, :2], None, dropout=0.1)
    for key in ("softcap", "s_aux"):
        with pytest.raises(ValueError, match=rf"\(layer 1\): the model passes {key}.*'sdpa' or 'eager'"):
            _causal_sdpa(attn, q, q[:, :2], q[:, :2], None, **{key: 50.0})


def _repadded(b, *, pad_id: int):
    """`b` with its padding replaced by `pad_id`."""
    ids = torch.where(b.attention_mask.bool(), b.input_ids, torch.full_like(b.input_ids, pad_id))
    return type(b)(ids, b.attention_mask, ids[:, 1:].clone(), b.mask, b.rollout_logp, b.response_len)
