"""Attention of a training micro-batch, per SDPA path and backend: which kernels PyTorch runs and what the
forward and forward + backward cost, at a model shape's heads and a micro-batch's rows x width.

Why. The trainer attends through transformers' SDPA integration. Given a padding mask, transformers hands
SDPA a 4D boolean mask and K/V repeated to the query heads (it passes grouped-query attention to SDPA only
without a mask, on CUDA); without a mask it calls SDPA with ``is_causal=True, enable_gqa=True``. On the H200
the masked path ran PyTorch's memory-efficient kernels (fmha_cutlassF/B, sm80) for 6.0 of a 20.6 s 8B-class
FP8 training phase (``bench_e2e.py --profile-train``), and calling the model without its padding mask (the
rows are right-padded) left the phase's time unchanged. This measures each path under SDPA's own choice and
under each backend forced, so that the trainer's attention changes on a measurement:

- ``masked``: causal + padding 4D boolean mask, K/V repeated (transformers with a padding mask);
- ``causal_gqa``: ``is_causal=True, enable_gqa=True`` (transformers without a mask);
- ``causal_repeat``: ``is_causal=True``, K/V repeated;

backends ``auto`` (SDPA's choice), ``flash``, ``efficient``, ``cudnn``, ``math``; a backend that refuses a
path is recorded with its reason. Times: `bench_linear.timeit` (CUDA events; CPU: wall clock), median of
``--repeats`` after a warm-up; kernels: the profiler's top three by device time (CUDA).

    python scripts/bench_attention.py --shape llama3.1-8b --rows 4 --width 2064 --commit SHA   # on the H200
    python scripts/bench_attention.py --tiny                                                    # CPU plumbing
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

import benchmeta
from bench_linear import timeit
from shape_model import SHAPES, shape_config

PATHS = ("masked", "causal_gqa", "causal_repeat")
BACKENDS = ("auto", "flash", "efficient", "cudnn", "math")


def _inputs(heads: int, kv_heads: int, head_dim: int, rows: int, width: int, device: str, dtype):
    """q ``[rows, heads, width, head_dim]``, k/v ``[rows, kv_heads, ...]`` (requiring grad) and the causal +
    padding mask of right-padded rows (row i holds ``width - i`` real tokens)."""
    import torch

    g = torch.Generator(device=device).manual_seed(0)

    def leaf(h):
        return torch.randn(rows, h, width, head_dim, generator=g, device=device, dtype=dtype).requires_grad_(True)

    q, k, v = leaf(heads), leaf(kv_heads), leaf(kv_heads)
    real = torch.arange(width, device=device)[None, :] < (width - torch.arange(rows, device=device))[:, None]
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    mask = causal[None, None] & real[:, None, None, :]
    return q, k, v, mask


def _call(path: str, q, k, v, mask):
    import torch.nn.functional as F

    rep = q.shape[1] // k.shape[1]
    if path == "masked":
        return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), mask)
    if path == "causal_gqa":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    if path == "causal_repeat":
        return F.scaled_dot_product_attention(
            q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True
        )
    raise ValueError(f"unknown path {path!r}; choose one of {PATHS}")


def _backend_ctx(backend: str):
    import contextlib

    from torch.nn.attention import SDPBackend, sdpa_kernel

    if backend == "auto":
        return contextlib.nullcontext()
    names = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "math": SDPBackend.MATH,
    }
    return sdpa_kernel(names[backend])


def _kernels(fn) -> list[str]:
    """The three CUDA kernels with the most device time in one run of `fn`."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    return [e.key for e in sorted(rows, key=lambda e: -e.self_device_time_total)[:3]]


def measure(path: str, backend: str, tensors, repeats: int) -> dict:
    """``{"fwd_ms", "fwd_bwd_ms", "kernels"}`` of `path` under `backend`, or ``{"refused": reason}``."""
    import torch

    q, k, v, mask = tensors
    cuda = q.is_cuda

    def fwd():
        with _backend_ctx(backend), torch.no_grad():
            return _call(path, q, k, v, mask)

    def fwd_bwd():
        with _backend_ctx(backend):
            out = _call(path, q, k, v, mask)
        out.backward(torch.ones_like(out))
        q.grad = k.grad = v.grad = None

    try:
        with warnings.catch_warnings(record=True) as why:  # SDPA warns why each backend declined
            warnings.simplefilter("always")
            fwd_ms = timeit(fwd, q.device, warmup=2, rep=repeats)
            fwd_bwd_ms = timeit(fwd_bwd, q.device, warmup=2, rep=repeats)
    except RuntimeError as e:  # the backend cannot run this case
        reasons = [str(e).strip().splitlines()[0], *dict.fromkeys(str(w.message).strip() for w in why)]
        return {"refused": "; ".join(reasons)[:600]}
    return {"fwd_ms": fwd_ms, "fwd_bwd_ms": fwd_bwd_ms, "kernels": _kernels(fwd_bwd) if cuda else []}


def run(args) -> dict:
    import torch

    cuda = torch.cuda.is_available()
    if args.tiny:
        heads, kv_heads, head_dim = 4, 2, 16
        label = "tiny (4 heads, 2 KV heads, head_dim 16)"
    else:
        cfg = shape_config(args.shape, 1)
        heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        label = f"{args.shape} ({heads} heads, {kv_heads} KV heads, head_dim {head_dim})"
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    tensors = _inputs(heads, kv_heads, head_dim, args.rows, args.width, device, dtype)
    backends = args.backends or (BACKENDS if cuda else ("auto", "math"))
    result = {
        "benchmark": "attention",
        **benchmeta.meta(args.commit),
        "shape": label,
        "rows": args.rows,
        "width": args.width,
        "dtype": str(dtype).removeprefix("torch."),
        "repeats": args.repeats,
        "results": {p: {b: measure(p, b, tensors, args.repeats) for b in backends} for p in PATHS},
    }
    return result


def table(result: dict) -> str:
    lines = [
        f"attention fwd / fwd+bwd ms, {result['shape']}, {result['rows']} x {result['width']} on {result['device']}"
    ]
    for path, by_backend in result["results"].items():
        for backend, r in by_backend.items():
            if "refused" in r:
                lines.append(f"{path:14s} {backend:10s} refused: {r['refused'][:90]}")
            else:
                head = r["kernels"][0][:60] if r["kernels"] else ""
                lines.append(f"{path:14s} {backend:10s} {r['fwd_ms']:9.3f} {r['fwd_bwd_ms']:9.3f}  {head}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="a tiny head layout (CPU: the math backend's plumbing)")
    p.add_argument("--shape", choices=SHAPES, default="llama3.1-8b", help="the model shape whose heads are used")
    p.add_argument("--rows", type=int, default=4, help="sequences per micro-batch")
    p.add_argument("--width", type=int, default=2064, help="tokens per row (prompt + response, padded)")
    p.add_argument("--backends", nargs="+", choices=BACKENDS, help="default: all on CUDA, auto and math on CPU")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--commit", help="the checkout's commit, recorded (the device machine has no git)")
    p.add_argument("--out", help="JSON path (default scripts/results/attention-<device>.json)")
    args = p.parse_args(argv)
    if args.rows < 1 or args.width < 2 or args.repeats < 1:
        p.error("--rows, --repeats must be >= 1 and --width >= 2")
    if args.rows > args.width:
        p.error(f"--rows {args.rows} > --width {args.width}: row i holds width - i real tokens")
    if args.tiny:
        args.width = min(args.width, 64)
    result = run(args)
    out = Path(
        args.out or Path(__file__).parent / "results" / f"attention-{benchmeta.device_tag(result['device'])}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
