"""Rollout-vs-trainer log-prob mismatch (NUMERICS.md section 5): the on-policy gap, measured.

For every sampled response token, ``|logp_rollout(token) - logp_trainer(token)|`` where the rollout
side is the engine's log-prob of the token it sampled (`adapter.Sample.response_logprobs`) and the
trainer side is the log-softmax of the trainer model's logits on the same prompt + response.
"""

from __future__ import annotations

import torch

__all__ = ["trainer_logprobs", "logprob_mismatch"]


def trainer_logprobs(model: torch.nn.Module, prompt_ids: list[int], response_ids: list[int]) -> torch.Tensor:
    """fp32 log-probs the trainer `model` (an HF causal LM) gives each response token, teacher-forced."""
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt_ids) + list(response_ids)], device=device)
    with torch.no_grad():
        logp = model(ids).logits.float().log_softmax(-1)[0]
    p = len(prompt_ids)
    tgt = torch.tensor(response_ids, device=device)[:, None]
    return logp[p - 1 : -1].gather(-1, tgt)[:, 0].cpu()


def logprob_mismatch(model: torch.nn.Module, samples) -> dict:
    """Mean and max |delta logp| over all response tokens of `samples`, plus the mean IS ratio
    ``exp(logp_trainer - logp_rollout)`` and the token count."""
    deltas = []
    for s in samples:
        if not s.response_ids:
            continue
        mine = trainer_logprobs(model, s.prompt_ids, s.response_ids)
        deltas.append(mine - torch.tensor(s.response_logprobs, dtype=torch.float32))
    if not deltas:
        raise ValueError("logprob_mismatch: no response tokens in the samples")
    d = torch.cat(deltas)
    return {
        "mean_abs": float(d.abs().mean()),
        "max_abs": float(d.abs().max()),
        "is_ratio_mean": float(d.exp().mean()),
        "tokens": int(d.numel()),
    }
