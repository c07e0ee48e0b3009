"""Supervised warm-up: teach the policy the answer format (and some arithmetic) before RL.

RL with a binary reward needs a policy that is sometimes right. The warm-up trains on
``<s> prompt answer </s>`` with the loss on ``answer </s>`` only, in float32 (the warm-up is recipe
independent, so every recipe's RL starts from the same BF16 weights), with AdamW and a cosine decay.
Its result is an HF checkpoint directory that the trainer and the rollout engine both load; it is
cached under ``<out_dir>/_cache/warmup-<hash>/`` keyed by everything that determines it.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import time
from pathlib import Path

import torch

from .config import TrainConfig
from .task import ArithmeticTask, Stream

__all__ = ["warmup_key", "supervised_warmup", "prepare_initial_checkpoint"]


def warmup_key(cfg: TrainConfig) -> str:
    """Hash of what determines the warm-up (seed, tiny-model overrides, task, warm-up settings)."""
    d = cfg.to_dict()
    blob = json.dumps(
        {"seed": cfg.run.seed, "tiny": d["model"]["tiny"], "task": d["task"], "warmup": d["warmup"]}, sort_keys=True
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _sft_batch(tok, task: ArithmeticTask, index: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows, masks = [], []
    for p in task.problems(Stream.WARMUP, index, n):
        prompt = tok.encode(p.prompt, add_bos=True)
        answer = tok.encode(p.answer, add_bos=False, add_eos=True)
        rows.append(prompt + answer)
        masks.append([0] * (len(prompt) - 1) + [1] * len(answer))
    seq = max(len(r) for r in rows)
    ids = torch.full((n, seq), tok.pad_id, dtype=torch.long)
    attn = torch.zeros((n, seq), dtype=torch.long)
    mask = torch.zeros((n, seq - 1))
    for i, (r, m) in enumerate(zip(rows, masks, strict=True)):
        ids[i, : len(r)] = torch.tensor(r)
        attn[i, : len(r)] = 1
        mask[i, : len(m)] = torch.tensor(m, dtype=torch.float32)
    return ids, attn, mask


def supervised_warmup(model, tok, task: ArithmeticTask, *, steps: int, batch_size: int, lr: float, log=print) -> dict:
    """Train `model` (float32, in place) for `steps`; returns ``{"loss_start", "loss_end", "seconds"}``."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    t0 = time.perf_counter()
    losses = []
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / max(1, steps))))
        ids, attn, mask = _sft_batch(tok, task, step, batch_size)
        logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        loss = (nll * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        if log and (step + 1) % max(1, steps // 5) == 0:
            log(f"warm-up {step + 1}/{steps}: loss {sum(losses[-20:]) / len(losses[-20:]):.3f}")
    model.eval()
    return {
        "loss_start": losses[0] if losses else None,
        "loss_end": losses[-1] if losses else None,
        "seconds": time.perf_counter() - t0,
    }


def prepare_initial_checkpoint(cfg: TrainConfig, *, log=print) -> Path:
    """The HF checkpoint RL starts from: `model.path` as is, or the embedded tiny model after the
    supervised warm-up (built once per configuration and cached)."""
    if cfg.model.path is not None:
        if cfg.warmup.steps:
            raise ValueError(
                "warmup.steps: the supervised warm-up is for the embedded tiny model; set it to 0 "
                "when model.path is given"
            )
        return Path(cfg.model.path)
    from jetrl.tiny import CharTokenizer, build_tiny_model, save_checkpoint

    cache = Path(cfg.run.out_dir) / "_cache" / f"warmup-{warmup_key(cfg)}"
    if (cache / "warmup.json").exists():
        log(f"warm-up: reusing {cache}")
        return cache
    tok = CharTokenizer()
    model = build_tiny_model(cfg.run.seed, **cfg.model.tiny).float()
    task = ArithmeticTask(cfg.run.seed, cfg.task.min_operand, cfg.task.max_operand, cfg.task.ops)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.run.seed)
        info = supervised_warmup(
            model, tok, task, steps=cfg.warmup.steps, batch_size=cfg.warmup.batch_size, lr=cfg.warmup.lr, log=log
        )
    tmp = cache.with_name(cache.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_checkpoint(model.to(torch.bfloat16), tok, tmp)
    (tmp / "warmup.json").write_text(json.dumps({**info, "key": warmup_key(cfg)}, indent=2))
    shutil.rmtree(cache, ignore_errors=True)
    tmp.rename(cache)
    return cache
