"""Effective bandwidth of the jetrl FP8 Triton kernels on a CUDA GPU, beside a device copy and eager torch.

For M in {4096, 16384} and K in {4096, 14336} (bf16 inputs) it times each kernel with
``triton.testing.do_bench`` (median), converts to effective GB/s = (bytes read + bytes written) /
time, and prints a table with the device-to-device copy of an ``[M, K]`` bf16 tensor measured in the
same run, the eager torch reference (`jetrl.kernels.torch_<op>`) and the goals of issue 3:
quantize kernels and rmsnorm+quant >= 80% of copy (3.4 TB/s on an H200), transpose-quantize >=
2.5 TB/s, swiglu+quant >= 75% of copy. Writes ``kernels-<gpu>.json`` (GPU name, torch/triton
versions, date, every row) to ``--out`` (default scripts/results/).

``--sweep`` instead times every candidate launch config of the tunable kernels (each module's
``SWEEP_CONFIGS``, plus the default ``config=default``) at each shape, with the same do_bench median
but fewer repetitions, prints kernel / M / K / config / GB/s / % of copy, and stores the rows under
``"sweep"`` in the same JSON (the other key is kept). ``--only`` restricts either mode to some
kernels (the name before ``[``, e.g. ``quantize_1x128``), ``--shapes`` to some ``MxK``; rows of a
partial run replace the matching rows of an existing file and keep the rest.

    python3 scripts/bench_kernels.py [--out DIR] [--no-eager] [--sweep] [--only K1,K2] [--shapes 16384x14336]
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import re

import torch
import triton
from triton.testing import do_bench

import jetrl.kernels as K
from jetrl.quant import ceil_div

# the op modules (jetrl.kernels re-exports functions of the same names, so import the modules by path)
q1, q128, rq, sq, tq = (
    importlib.import_module(f"jetrl.kernels.{m}")
    for m in ("quantize_1x128", "quantize_128x128", "rmsnorm_quant", "swiglu_quant", "transpose_quantize")
)

KERNELS = (
    "quantize_1x128",
    "quantize_128x128",
    "transpose_quantize",
    "transpose_requantize",
    "quantize_1x128_and_transpose",
    "rmsnorm_quant",
    "rmsnorm_backward",
    "swiglu_quant",
    "swiglu_backward",
)
MS = (4096, 16384)
KS = (4096, 14336)


def _gbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def _time(fn, warmup: int = 10, rep: int = 60) -> float:
    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def _copy_gbps(m: int, k: int) -> float:
    src = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return _gbps(4 * m * k, _time(lambda: dst.copy_(src)))


def _cases(m: int, k: int):
    """(kernel name, goal kind, bytes moved, triton fn, eager fn) for one shape."""
    dev = "cuda"
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    gu = torch.randn(m, 2 * k, device=dev, dtype=torch.bfloat16)
    gate, up = gu[:, :k], gu[:, k:]
    w = (1 + 0.1 * torch.randn(k, device=dev)).to(torch.bfloat16)
    g, gm = ceil_div(k, 128), ceil_div(m, 128)
    xq, xs = K.quantize_1x128(x)
    _, _, _, rstd = K.rmsnorm_quant(x, w, 1e-6)
    dy = torch.randn_like(x)
    mk = m * k
    return [
        (
            "quantize_1x128[row]",
            "quant",
            2 * mk + mk + 4 * m * g,
            lambda: q1.launch_quantize_1x128(x, "row"),
            lambda: K.torch_quantize_1x128(x),
        ),
        (
            "quantize_1x128[deepgemm]",
            "quant",
            2 * mk + mk + 4 * m * g,
            lambda: q1.launch_quantize_1x128(x, "deepgemm"),
            lambda: K.torch_quantize_1x128(x, scale_layout="deepgemm"),
        ),
        (
            "quantize_128x128",
            "quant",
            2 * mk + mk + 4 * gm * g,
            lambda: q128.launch_quantize_128x128(x),
            lambda: K.torch_quantize_128x128(x),
        ),
        (
            "quantize_128x128[+T]",
            "quant",
            2 * mk + 2 * mk + 8 * gm * g,
            lambda: q128.launch_quantize_128x128(x, True),
            lambda: K.torch_quantize_128x128(x, with_transpose=True),
        ),
        (
            "transpose_quantize",
            "transpose",
            2 * mk + mk + 4 * k * gm,
            lambda: tq.launch_transpose_quantize(x),
            lambda: K.torch_transpose_quantize(x),
        ),
        (
            "transpose_requantize",
            "transpose",
            mk + 4 * m * g + mk + 4 * k * gm,
            lambda: tq.launch_transpose_requantize(xq, xs),
            lambda: K.torch_transpose_requantize(xq, xs),
        ),
        (
            "quantize_1x128_and_transpose",
            "transpose",
            2 * mk + mk + 4 * m * g + mk + 4 * k * gm,
            lambda: tq.launch_quantize_1x128_and_transpose(x, "deepgemm"),
            lambda: K.torch_quantize_1x128_and_transpose(x),
        ),
        (
            "rmsnorm_quant",
            "quant",
            2 * mk + 2 * k + 2 * mk + mk + 4 * m * g + 4 * m,
            lambda: rq.launch_rmsnorm_quant(x, w, 1e-6),
            lambda: K.torch_rmsnorm_quant(x, w, 1e-6),
        ),
        (
            "rmsnorm_backward",
            "none",
            2 * mk * 2 + 2 * k + 4 * m + 2 * mk,
            lambda: rq.launch_rmsnorm_backward(dy, x, w, rstd),
            lambda: K.torch_rmsnorm_backward(dy, x, w, rstd),
        ),
        (
            "swiglu_quant",
            "swiglu",
            4 * mk + 2 * mk + mk + 4 * m * g,
            lambda: sq.launch_swiglu_quant(gate, up),
            lambda: K.torch_swiglu_quant(gate, up),
        ),
        (
            "swiglu_backward",
            "none",
            6 * mk + 4 * mk,
            lambda: sq.launch_swiglu_backward(dy, gate, up),
            lambda: K.torch_swiglu_backward(dy, gate, up),
        ),
    ]


def _goal(kind: str, copy_gbps: float) -> tuple[float | None, str]:
    if kind == "quant":
        return max(0.8 * copy_gbps, 3400.0), ">=80% copy & 3.4TB/s"
    if kind == "transpose":
        return 2500.0, ">=2.5TB/s"
    if kind == "swiglu":
        return 0.75 * copy_gbps, ">=75% copy"
    return None, "-"


SWEEP_TIMING = dict(warmup=5, rep=25)

# kernel -> candidate launcher keywords; "default" (no keywords) is timed too
SWEEPS = {
    "quantize_1x128[deepgemm]": q1.SWEEP_CONFIGS,
    "quantize_128x128": q128.SWEEP_CONFIGS,
    "quantize_128x128[+T]": [dict(c, transpose=t) for c in q128.SWEEP_CONFIGS for t in q128.TRANSPOSE_MODES],
    "transpose_quantize": tq.SWEEP_CONFIGS,
    "quantize_1x128_and_transpose": tq.DUAL_SWEEP_CONFIGS,
    "rmsnorm_quant": rq.SWEEP_CONFIGS,
    "swiglu_quant": [dict(block_m=bm, num_warps=nw) for bm, nw in ((16, 4), (32, 4), (32, 8), (64, 8))],
}


def _sweep(m: int, k: int, copy_gbps: float, only: set[str] | None) -> list[dict]:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    gu = torch.randn(m, 2 * k, device="cuda", dtype=torch.bfloat16)
    w = (1 + 0.1 * torch.randn(k, device="cuda")).to(torch.bfloat16)
    mk, g, gm = m * k, ceil_div(k, 128), ceil_div(m, 128)
    # same byte counts as `_cases`
    fns = {
        "quantize_1x128[deepgemm]": (3 * mk + 4 * m * g, lambda c: q1.launch_quantize_1x128(x, "deepgemm", **c)),
        "quantize_128x128": (3 * mk + 4 * gm * g, lambda c: q128.launch_quantize_128x128(x, **c)),
        "quantize_128x128[+T]": (4 * mk + 8 * gm * g, lambda c: q128.launch_quantize_128x128(x, True, **c)),
        "transpose_quantize": (3 * mk + 4 * k * gm, lambda c: tq.launch_transpose_quantize(x, **c)),
        "quantize_1x128_and_transpose": (
            4 * mk + 4 * m * g + 4 * k * gm,
            lambda c: tq.launch_quantize_1x128_and_transpose(x, "deepgemm", **c),
        ),
        "rmsnorm_quant": (
            5 * mk + 2 * k + 4 * m * g + 4 * m,
            lambda c: rq.launch_rmsnorm_quant(x, w, 1e-6, **c),
        ),
        "swiglu_quant": (7 * mk + 4 * m * g, lambda c: sq.launch_swiglu_quant(gu[:, :k], gu[:, k:], **c)),
    }
    rows = []
    for name, configs in SWEEPS.items():
        if not _selected(name, only):
            continue
        nbytes, fn = fns[name]
        for c in [{}, *configs]:
            gbps = _gbps(nbytes, _time(lambda fn=fn, c=c: fn(c), **SWEEP_TIMING))
            cfg = _cfg_text(c)
            rows.append(
                {
                    "kernel": name,
                    "M": m,
                    "K": k,
                    "config": cfg,
                    "gbps": gbps,
                    "copy_gbps": copy_gbps,
                    "pct_copy": 100.0 * gbps / copy_gbps,
                }
            )
            print(f"sweep {name:30s} {m:6d} {k:6d} {cfg:52s} {gbps:8.0f} {100.0 * gbps / copy_gbps:6.1f}", flush=True)
    return rows


def _cfg_text(c: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in c.items()) or "default"


def _selected(name: str, only: set[str] | None) -> bool:
    return only is None or name in only or name.split("[")[0] in only


def _merge(old: list[dict], new: list[dict], keys: tuple[str, ...]) -> list[dict]:
    """Rows of `new` replace the rows of `old` with the same key; the rest of `old` is kept."""
    fresh = {tuple(r.get(k) for k in keys) for r in new}
    return [r for r in old if tuple(r.get(k) for k in keys) not in fresh] + new


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--sweep", action="store_true", help="time every candidate launch config (instead of the table)")
    ap.add_argument("--only", default=None, help="comma-separated kernels, e.g. quantize_1x128,rmsnorm_quant")
    ap.add_argument("--shapes", default=None, help="comma-separated MxK among the benchmark shapes")
    ap.add_argument("--no-eager", action="store_true", help="skip the eager torch references")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels.py needs a CUDA GPU (the Triton kernels are what is measured)")
    only = set(args.only.split(",")) if args.only else None
    if only is not None and not only <= set(KERNELS) | set(SWEEPS):
        raise SystemExit(f"--only: unknown kernels {sorted(only - set(KERNELS) - set(SWEEPS))}; choose from {KERNELS}")
    shapes = [(m, k) for m in MS for k in KS]
    if args.shapes:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    gpu = torch.cuda.get_device_name()
    date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    rows, sweep = [], []
    for m, k in shapes:
        copy_gbps = _copy_gbps(m, k)
        if args.sweep:
            sweep += _sweep(m, k, copy_gbps, only)
            torch.cuda.empty_cache()
            continue
        rows.append({"kernel": "copy (bf16 d2d)", "M": m, "K": k, "gbps": copy_gbps, "copy_gbps": copy_gbps})
        for name, kind, nbytes, fn, eager in _cases(m, k):
            if not _selected(name, only):
                continue
            gbps = _gbps(nbytes, _time(fn))
            eager_gbps = None if args.no_eager else _gbps(nbytes, _time(eager))
            goal, goal_txt = _goal(kind, copy_gbps)
            rows.append(
                {
                    "kernel": name,
                    "M": m,
                    "K": k,
                    "bytes": nbytes,
                    "gbps": gbps,
                    "copy_gbps": copy_gbps,
                    "pct_copy": 100.0 * gbps / copy_gbps,
                    "eager_gbps": eager_gbps,
                    "goal": goal_txt,
                    "goal_gbps": goal,
                    "meets_goal": None if goal is None else gbps >= goal,
                }
            )
        torch.cuda.empty_cache()
    K.check_nonfinite()

    print(f"\n{gpu} | torch {torch.__version__} | triton {triton.__version__}")
    if args.sweep:
        _print_sweep(sweep)
    else:
        _print_rows(rows)

    os.makedirs(args.out, exist_ok=True)
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")
    path = os.path.join(args.out, f"kernels-{slug}.json")
    old = {}
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
    for r in rows + sweep:
        r["date"] = date
    out = {
        "gpu": gpu,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": date,
        "timing": "do_bench median (warmup 10 ms, rep 60 ms); GB/s = (bytes read + written) / time",
        "sweep_timing": f"do_bench median (warmup {SWEEP_TIMING['warmup']} ms, rep {SWEEP_TIMING['rep']} ms)",
        "rows": _merge(old.get("rows", []), rows, ("kernel", "M", "K")),
        "sweep": _merge(old.get("sweep", []), sweep, ("kernel", "M", "K", "config")),
    }
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {path}")


def _print_rows(rows: list[dict]) -> None:
    hdr = f"{'kernel':30s} {'M':>6s} {'K':>6s} {'GB/s':>8s} {'%copy':>6s} {'copy':>7s} {'eager':>7s} {'goal':>22s} ok"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        eager = f"{r['eager_gbps']:7.0f}" if r.get("eager_gbps") else "      -"
        ok = {True: "yes", False: "NO", None: ""}[r.get("meets_goal")]
        print(
            f"{r['kernel']:30s} {r['M']:6d} {r['K']:6d} {r['gbps']:8.0f} {r.get('pct_copy', 100.0):6.1f} "
            f"{r['copy_gbps']:7.0f} {eager} {r.get('goal', '-'):>22s} {ok}"
        )


def _print_sweep(sweep: list[dict]) -> None:
    """The sweep table, and per (kernel, shape) the best config."""
    hdr = f"{'kernel':30s} {'M':>6s} {'K':>6s} {'config':52s} {'GB/s':>8s} {'%copy':>6s}"
    print(hdr)
    print("-" * len(hdr))
    best: dict[tuple, dict] = {}
    for r in sweep:
        key = (r["kernel"], r["M"], r["K"])
        if key not in best or r["gbps"] > best[key]["gbps"]:
            best[key] = r
        print(f"{r['kernel']:30s} {r['M']:6d} {r['K']:6d} {r['config']:52s} {r['gbps']:8.0f} {r['pct_copy']:6.1f}")
    print("\nbest per kernel and shape:")
    for (name, m, k), r in best.items():
        print(f"{name:30s} {m:6d} {k:6d} {r['config']:52s} {r['gbps']:8.0f} {r['pct_copy']:6.1f}")


if __name__ == "__main__":
    main()
