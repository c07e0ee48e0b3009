"""Supervised warm-up: teach the policy the answer format (and some arithmetic) before RL.

RL with a binary reward needs a policy that is sometimes right. The warm-up trains on
``<s> prompt answer </s>`` with the loss on ``answer </s>`` only, in float32 (the warm-up is recipe
independent, so every recipe's RL starts from the same BF16 weights), with AdamW and a cosine decay.
Its result is an HF checkpoint directory that the trainer and the rollout engine both load; it is
cached under ``<out_dir>/_cache/warmup-<hash>/`` keyed by everything that determines it.

``jetrl warmup --out DIR`` writes the same warm-up as a stand-alone checkpoint for other trainers. With
``--format chat`` (the default there) the model is the ChatML tiny model (``CharTokenizer(chat=True)``)
trained on the prompts exactly as a verl run renders the task's parquet rows
(`jetrl.tasks.arithmetic.chat_messages` through the chat template, answer then ``<|im_end|>``): the start of
``recipes/tiny-arith-verl.sh``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shutil
import sys
import time
from pathlib import Path

import torch

from jetrl.tasks.arithmetic import chat_messages

from .config import TaskConfig, TrainConfig, WarmupConfig
from .task import ArithmeticTask, Stream

__all__ = ["warmup_key", "supervised_warmup", "prepare_initial_checkpoint", "main"]


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
        prompt = tok.encode_chat(chat_messages(p)) if tok.chat else tok.encode(p.prompt, add_bos=True)
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
    """Train `model` (float32, in place, on its device) for `steps`; returns ``{"loss_start", "loss_end",
    "seconds"}``. A chat tokenizer (``tok.chat``) gets the prompts rendered as chat messages."""
    device = next(model.parameters()).device
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    t0 = time.perf_counter()
    losses = []
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / max(1, steps))))
        ids, attn, mask = (t.to(device) for t in _sft_batch(tok, task, step, batch_size))
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


def main(argv: list[str] | None = None) -> int:
    """``jetrl warmup``: the tiny model after the supervised warm-up, written as an HF checkpoint."""
    w, t = WarmupConfig(), TaskConfig()
    p = argparse.ArgumentParser(
        prog="jetrl warmup",
        description="Write the embedded tiny Qwen3 after jetrl's supervised warm-up on the arithmetic task as an HF "
        "checkpoint (bf16), e.g. as the model of a verl run (recipes/tiny-arith-verl.sh).",
    )
    p.add_argument("--out", required=True, help="checkpoint folder to write (must not exist, or be empty)")
    p.add_argument(
        "--format",
        choices=("chat", "plain"),
        default="chat",
        help="chat: ChatML tokenizer, prompts as verl renders scripts/data/arithmetic.py rows (default); "
        "plain: the local trainer's '<s>12+7=' prompts",
    )
    p.add_argument("--seed", type=int, default=0, help="model init and data seed (default 0)")
    p.add_argument("--steps", type=int, default=w.steps, help=f"warm-up steps (default {w.steps})")
    p.add_argument("--batch-size", type=int, default=w.batch_size, help=f"problems per step (default {w.batch_size})")
    p.add_argument("--lr", type=float, default=w.lr, help=f"AdamW learning rate (default {w.lr})")
    p.add_argument("--min-operand", type=int, default=t.min_operand)
    p.add_argument("--max-operand", type=int, default=t.max_operand)
    p.add_argument("--ops", default="".join(t.ops), help="operators drawn, e.g. '+-*' (default '+')")
    p.add_argument("--device", default="cpu", help="torch device of the warm-up, e.g. cuda (default cpu)")
    args = p.parse_args(argv)
    from jetrl.tiny import CharTokenizer, build_tiny_model, save_checkpoint

    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        print(f"jetrl warmup: --out {out} exists and is not an empty folder", file=sys.stderr)
        return 2
    for name in ("steps", "batch_size"):
        if getattr(args, name) <= 0:
            print(f"jetrl warmup: --{name.replace('_', '-')} must be > 0, got {getattr(args, name)}", file=sys.stderr)
            return 2
    try:
        task = ArithmeticTask(args.seed, args.min_operand, args.max_operand, tuple(args.ops))
        device = torch.device(args.device)
    except (ValueError, RuntimeError) as e:
        print(f"jetrl warmup: {e}", file=sys.stderr)
        return 2
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"jetrl warmup: --device {args.device}: this machine has no CUDA device", file=sys.stderr)
        return 2
    chat = args.format == "chat"
    tok = CharTokenizer(chat=chat)
    model = build_tiny_model(args.seed, chat=chat).float().to(device)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(args.seed)
        info = supervised_warmup(model, tok, task, steps=args.steps, batch_size=args.batch_size, lr=args.lr)
    save_checkpoint(model.to("cpu", torch.bfloat16), tok, out)
    meta = {**info, **{k: v for k, v in vars(args).items() if k != "out"}}
    (out / "warmup.json").write_text(json.dumps(meta, indent=2))
    loss = f"loss {info['loss_start']:.3f} -> {info['loss_end']:.3f}"
    print(f"jetrl warmup: {loss} in {info['seconds']:.1f} s; wrote {out}")
    return 0
