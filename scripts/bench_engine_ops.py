"""Decode-step GPU time of the `fused` rollout engine's small ops: separate launches vs jetrl's fused kernels.

Each decoder layer of the `fused` engine (`jetrl.rollout.vllm_model`, ``engine_ops: fused``) runs two residual
adds, each before an RMSNorm+quantize, and RoPE of q and of k. vLLM's profiler put 0.39 ms of a batch-256 decode
step of the Llama-3.1-8B shape in those adds and the two RoPE launches (`rollout-mp-profile-nvidia-h200.json`).
This script times both ways of running them for ``--layers`` layers at decode batches of M tokens, each way
replayed from one CUDA graph (no launch gaps or host time: what a captured decode step pays), every layer on
its own tensors (nothing found in L2 from the layer before):

    separate: ``residual + x`` (torch) then `rmsnorm_quant`, twice; `rope` of q, `rope` of k
    fused:    `add_rmsnorm_quant`, twice;                            `rope_pair` of q and k

q and k are the strided column slices of one ``[M, q + 2 * kv]`` qkv output, as vLLM hands them over. Before
timing it checks that both ways give the same bytes (y, FP8 q, scales, the residual sum; rotated q and k); on a
CPU (the ops' torch references) it runs that check alone.

Then the engine's fused producers as the engine calls them (`jetrl.rollout.vllm_model`'s ``jetrl::engine_*`` ops,
each layer: the add + norm + quantize before qkv and before gate_up, SwiGLU + quantize of the ``[M, 2 * 14336]``
gate_up output before down_proj), with their BF16 value written (``keep``: what the lint's capture records) and
without it (the engine's decode: the kernels quantize the value in registers; 2 of the norm's 9 MB and 7.3 of
SwiGLU's 26 MB a call at M = 256), after checking the FP8 bytes, scales and residual sums are the same.
Writes ``engine-ops-<device>.json``.

    python3 scripts/bench_engine_ops.py [--batches 64,256] [--layers 32] [--out DIR] [--commit SHA]
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path

import benchmeta
import torch

import jetrl.kernels as K

# Llama-3.1-8B: hidden 4096, 32 query heads and 8 key/value heads of 128
HIDDEN, HEAD_DIM, Q_HEADS, KV_HEADS, INTERMEDIATE = 4096, 128, 32, 8, 14336
POSITIONS = 8192  # the RoPE table's rows (the engine's max_model_len)
EPS = 1e-5


def layer_inputs(m: int, device: str, seed: int) -> dict:
    """One decoder layer's tensors at a decode batch of `m` tokens."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=torch.bfloat16)

    qkv = rnd(m, (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM)
    return {
        "x": rnd(m, HIDDEN),
        "residual": rnd(m, HIDDEN),
        "x2": rnd(m, HIDDEN),
        "norm_w": (1 + 0.1 * rnd(HIDDEN)),
        "norm2_w": (1 + 0.1 * rnd(HIDDEN)),
        "q": qkv[:, : Q_HEADS * HEAD_DIM],
        "k": qkv[:, Q_HEADS * HEAD_DIM : (Q_HEADS + KV_HEADS) * HEAD_DIM],
        "table": rnd(2, POSITIONS, HEAD_DIM),
        "pos": torch.randint(0, POSITIONS, (m,), generator=g).to(device),
    }


def separate(t: dict, scale_layout: str) -> tuple[torch.Tensor, ...]:
    """The layer's ops as the `fused` engine ran them before the fused kernels: a torch add before each norm."""
    s1 = t["residual"] + t["x"]
    y1, q1, sc1, _ = K.rmsnorm_quant(s1, t["norm_w"], EPS, scale_layout=scale_layout)
    rq = K.rope(t["q"], t["table"], t["pos"], HEAD_DIM)
    rk = K.rope(t["k"], t["table"], t["pos"], HEAD_DIM)
    s2 = s1 + t["x2"]
    y2, q2, sc2, _ = K.rmsnorm_quant(s2, t["norm2_w"], EPS, scale_layout=scale_layout)
    return y1, q1, sc1, s1, rq, rk, y2, q2, sc2, s2


def fused(t: dict, scale_layout: str) -> tuple[torch.Tensor, ...]:
    """The same layer through `add_rmsnorm_quant` and `rope_pair`."""
    y1, q1, sc1, s1 = K.add_rmsnorm_quant(t["x"], t["residual"], t["norm_w"], EPS, scale_layout=scale_layout)
    rq, rk = K.rope_pair(t["q"], t["k"], t["table"], t["pos"], HEAD_DIM)
    y2, q2, sc2, s2 = K.add_rmsnorm_quant(t["x2"], s1, t["norm2_w"], EPS, scale_layout=scale_layout)
    return y1, q1, sc1, s1, rq, rk, y2, q2, sc2, s2


OUTPUTS = ("y", "q", "scales", "sum", "rope q", "rope k", "y2", "q2", "scales2", "sum2")


def differing(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...], names=OUTPUTS) -> list[str]:
    """The `names` of the outputs whose bytes differ between two ways of running a layer."""

    def raw(t):
        return t.contiguous().view(torch.uint8)

    return [n for n, x, y in zip(names, a, b, strict=True) if x.shape != y.shape or not torch.equal(raw(x), raw(y))]


def check(m: int, device: str, scale_layout: str, seed: int = 0) -> None:
    """Raise naming the outputs where the fused kernels' bytes differ from the separate ops'."""
    t = layer_inputs(m, device, seed)
    bad = differing(separate(t, scale_layout), fused(t, scale_layout))
    if bad:
        raise SystemExit(f"batch {m}: the fused kernels differ from the separate ops in {', '.join(bad)}")


def producers(t: dict, scale_layout: str, keep: bool) -> tuple[torch.Tensor, ...]:
    """One layer's fused producers through the engine's ops, their BF16 value written or not (`keep`)."""
    from jetrl.rollout.vllm_model import _add_norm_quant, _swiglu_quant

    y1, q1, sc1, s1 = _add_norm_quant(t["x"], t["residual"], t["norm_w"], EPS, scale_layout, "t.in", keep)
    y2, q2, sc2, s2 = _add_norm_quant(t["x2"], s1, t["norm2_w"], EPS, scale_layout, "t.post", keep)
    h, q3, sc3 = _swiglu_quant(t["gate_up"], scale_layout, "t.down", keep)
    return y1, y2, h, q1, sc1, s1, q2, sc2, s2, q3, sc3


def check_producers(m: int, device: str, scale_layout: str, seed: int = 0) -> None:
    """Raise unless the producers' bytes, scales and sums are the same with and without their value written."""
    t = {**layer_inputs(m, device, seed), "gate_up": _gate_up(m, device, seed)}
    kept, bare = producers(t, scale_layout, True), producers(t, scale_layout, False)
    if any(v.numel() for v in bare[:3]):
        raise SystemExit(f"batch {m}: a producer returned its value without being asked to keep it")
    names = ("q", "scales", "sum", "q2", "scales2", "sum2", "q (down_proj)", "scales (down_proj)")
    bad = differing(kept[3:], bare[3:], names)
    if bad:
        raise SystemExit(f"batch {m}: the producers' bytes differ without their value written, in {', '.join(bad)}")


def _gate_up(m: int, device: str, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(1000 + seed)
    return torch.randn(m, 2 * INTERMEDIATE, generator=g).to(device=device, dtype=torch.bfloat16)


def _graph_ms(fn, layers: list[dict], scale_layout: str) -> float:
    """ms of one replay of a CUDA graph running `fn` over every layer's inputs (do_bench median)."""
    from triton.testing import do_bench

    for t in layers:  # compile outside the capture
        fn(t, scale_layout)
    torch.cuda.synchronize()
    graph, keep = torch.cuda.CUDAGraph(), []
    with torch.cuda.graph(graph):
        for t in layers:
            keep.append(fn(t, scale_layout))
    ms = do_bench(graph.replay, warmup=25, rep=200, return_mode="median")
    del graph, keep
    return ms


def _batches(text: str) -> list[int]:
    try:
        out = [int(b) for b in text.split(",")]
    except ValueError:
        out = []
    if not out or any(b < 1 for b in out):
        raise SystemExit(f"--batches {text!r}: give positive decode batch sizes separated by commas, e.g. 64,256")
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="64,256", help="decode batch sizes M (tokens per step)")
    ap.add_argument("--layers", type=int, default=32, help="decoder layers per step (Llama-3.1-8B: 32)")
    ap.add_argument("--scale-layout", default="deepgemm", choices=("row", "deepgemm"))
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--commit", help="the checkout's commit, recorded (the device machine has no git)")
    args = ap.parse_args(argv)
    batches = _batches(args.batches)
    if args.layers < 1:
        raise SystemExit(f"--layers {args.layers}: need at least one layer")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for m in batches:
        check(m, device, args.scale_layout)
        check_producers(m, device, args.scale_layout)
    print(f"bytes equal (separate vs fused; producers with and without their value) at batches {batches} on {device}")
    result = {
        **benchmeta.meta(args.commit), "layers": args.layers, "scale_layout": args.scale_layout, "rows": [],
        "producer_rows": [],
    }  # fmt: skip
    if device == "cpu":
        print("no CUDA GPU: the byte check ran on the ops' torch references; nothing timed, nothing written")
        return result
    for m in batches:
        layers = [layer_inputs(m, device, seed) for seed in range(args.layers)]
        sep, fus = _graph_ms(separate, layers, args.scale_layout), _graph_ms(fused, layers, args.scale_layout)
        result["rows"].append(
            {"batch": m, "separate_us_per_step": 1e3 * sep, "fused_us_per_step": 1e3 * fus,
             "saved_us_per_step": 1e3 * (sep - fus), "ratio": sep / fus}
        )  # fmt: skip
        for t, seed in zip(layers, range(args.layers), strict=True):
            t["gate_up"] = _gate_up(m, device, seed)
        kept = _graph_ms(partial(producers, keep=True), layers, args.scale_layout)
        bare = _graph_ms(partial(producers, keep=False), layers, args.scale_layout)
        result["producer_rows"].append(
            {"batch": m, "value_written_us_per_step": 1e3 * kept, "bytes_only_us_per_step": 1e3 * bare,
             "saved_us_per_step": 1e3 * (kept - bare), "ratio": kept / bare}
        )  # fmt: skip
        del layers
    K.check_nonfinite()
    print(f"{'batch':>6s} {'separate us':>12s} {'fused us':>9s} {'saved us':>9s} {'ratio':>6s}  ({args.layers} layers)")
    for r in result["rows"]:
        print(
            f"{r['batch']:6d} {r['separate_us_per_step']:12.1f} {r['fused_us_per_step']:9.1f} "
            f"{r['saved_us_per_step']:9.1f} {r['ratio']:6.2f}"
        )
    print(f"{'batch':>6s} {'value written us':>17s} {'bytes only us':>14s} {'saved us':>9s} {'ratio':>6s}  (producers)")
    for r in result["producer_rows"]:
        print(
            f"{r['batch']:6d} {r['value_written_us_per_step']:17.1f} {r['bytes_only_us_per_step']:14.1f} "
            f"{r['saved_us_per_step']:9.1f} {r['ratio']:6.2f}"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"engine-ops-{benchmeta.device_tag(result['device'])}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
