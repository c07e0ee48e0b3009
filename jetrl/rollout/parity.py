"""Rollout-vs-trainer log-prob mismatch (NUMERICS.md section 5): the on-policy gap, measured.

For every sampled response token, ``|logp_rollout(token) - logp_trainer(token)|`` where the rollout
side is the engine's log-prob of the token it sampled (`adapter.Sample.response_logprobs`) and the
trainer side is the log-softmax of the trainer model's logits on the same prompt + response.
"""

from __future__ import annotations

import torch

__all__ = ["trainer_logprobs", "trainer_scores", "token_mismatch", "logprob_mismatch"]


def _scored(model: torch.nn.Module, prompt_ids: list[int], response_ids: list[int], entropy: bool):
    """The response tokens' log-probs (and entropies) under `model`, teacher-forced, on its device: by the
    model's ``_jetrl_token_logprobs`` where it has one (strict numerics: vLLM's sampler kernel), else the
    fp32 log-softmax."""
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt_ids) + list(response_ids)], device=device)
    tgt = torch.tensor(response_ids, device=device)
    p = len(prompt_ids)
    with torch.no_grad():
        logits = model(ids).logits[0, p - 1 : -1]
        strict = getattr(model, "_jetrl_token_logprobs", None)
        logp = logits.float().log_softmax(-1) if strict is None or entropy else None
        lp = strict(logits, tgt) if strict is not None else logp.gather(-1, tgt[:, None])[:, 0]
        ent = -(logp.exp() * logp).sum(-1) if entropy else None
    return lp, ent


def trainer_logprobs(model: torch.nn.Module, prompt_ids: list[int], response_ids: list[int]) -> torch.Tensor:
    """fp32 log-probs the trainer `model` (an HF causal LM) gives each response token, teacher-forced."""
    return _scored(model, prompt_ids, response_ids, entropy=False)[0].cpu()


def trainer_scores(
    model: torch.nn.Module, prompt_ids: list[int], response_ids: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs, entropies), fp32 ``[len(response_ids)]`` each, on CPU: the trainer's log-prob of each
    response token (as `trainer_logprobs`) and the entropy in nats of its full next-token distribution
    at that position (how peaked the policy is where it sampled)."""
    lp, ent = _scored(model, prompt_ids, response_ids, entropy=True)
    return lp.cpu(), ent.cpu()


def token_mismatch(model: torch.nn.Module, samples) -> list[dict]:
    """Per sample with a response: ``{"rollout", "trainer", "entropy"}`` fp32 tensors over its response
    tokens (the engine's log-probs, the trainer's, the trainer's entropy), position 0 = first response token."""
    out = []
    for s in samples:
        if not s.response_ids:
            continue
        if len(s.response_logprobs) != len(s.response_ids):
            raise ValueError(
                f"token_mismatch: a sample has {len(s.response_ids)} response tokens but "
                f"{len(s.response_logprobs)} log-probs"
            )
        lp, ent = trainer_scores(model, s.prompt_ids, s.response_ids)
        out.append({"rollout": torch.tensor(s.response_logprobs, dtype=torch.float32), "trainer": lp, "entropy": ent})
    if not out:
        raise ValueError("token_mismatch: no response tokens in the samples")
    return out


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
