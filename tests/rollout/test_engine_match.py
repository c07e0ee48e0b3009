"""vLLM-CPU-matched trainer numerics: same model up to BF16 rounding, differentiable, and bit-equal to
the rollout engine's log-probs (the last test needs vllm-cpu)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from torch import nn

from jetrl.rollout.engine_match import match_vllm_cpu
from jetrl.tiny import CharTokenizer, build_tiny_model, save_checkpoint


def _ids():
    return torch.tensor([CharTokenizer().encode("7+8=15 3+4=7 9+9=18 2+5=")])


def test_matched_model_is_the_same_function_and_trains():
    ref = build_tiny_model(0)
    m = build_tiny_model(0)
    match_vllm_cpu(m)
    ids = _ids()
    with torch.no_grad():
        a = torch.log_softmax(ref(input_ids=ids, use_cache=False).logits.float(), -1)
        b = torch.log_softmax(m(input_ids=ids, use_cache=False).logits.float(), -1)
    # only rounding differs: BF16 logits of the same model
    assert float((a - b).abs().max()) < 0.1, float((a - b).abs().max())
    assert not torch.equal(a, b)  # ... and the rounding does differ (else the patch would be a no-op)
    loss = m(input_ids=ids, use_cache=False).logits.float().logsumexp(-1).mean()
    loss.backward()
    grads = [p.grad for p in m.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


def test_rejects_other_architectures():
    with pytest.raises(ValueError, match="model.numerics='vllm-cpu'"):
        match_vllm_cpu(nn.Sequential(nn.Linear(2, 2)))


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (vllm-cpu on CPU)")
def test_trainer_logprobs_equal_the_engines(tmp_path):
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from jetrl.convert import convert_model
    from jetrl.rollout.adapter import create_engine

    path = save_checkpoint(build_tiny_model(3), CharTokenizer(), tmp_path / "m")
    prompt = _ids()[0].tolist()
    engine = create_engine(path, "jetrl-unified", seed=0, max_model_len=64)
    try:
        s = engine.generate([prompt], n=4, temperature=1.0, max_tokens=6, seed=1)
    finally:
        engine.close()
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    convert_model(m, "jetrl-unified")
    match_vllm_cpu(m)
    for sample in s:
        ids = torch.tensor([prompt + sample.response_ids])
        with torch.no_grad():
            lp = torch.log_softmax(m(input_ids=ids, use_cache=False).logits[0, :-1].float(), -1)
        got = [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(sample.response_ids)]
        assert got == sample.response_logprobs, (got, sample.response_logprobs)
