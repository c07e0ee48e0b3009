"""How many kernels DeepGEMM JIT-compiles as a training micro-batch's token count changes, and at what cost (GPU).

A verl actor with dynamic batch sizes (packed rows, ``use_dynamic_bsz``) hands each FP8 Linear a different token
count T almost every micro-batch. fprop and dgrad take T as their M (DeepGEMM picks a kernel per M, from few
choices); wgrad takes it as its K, which DeepGEMM compiles into the kernel by default (``compiled_dims="nk"``), so
each new T (padded to 128) may mean an nvcc run inside a training step. For each Linear of the Llama-3.1-8B shape
and each role this runs every ``--tokens`` count in a fresh DeepGEMM JIT cache and records what the call compiled
(new kernel folders and files), the first call's seconds (its compile included) and the steady milliseconds
(CUDA events, median of ``--repeats``); wgrad with ``compiled_dims`` ``"nk"`` and ``"mn"`` (T a runtime argument:
`jetrl.gemm.deepgemm.DeepGemmBackend.wgrad_compiled_dims`), and whether the two give the same bits at every T.
On an H100 (2026-12-05, `scripts/results/deepgemm-jit-nvidia-h100.json`) "nk" compiled a kernel at each of the 12
counts for qkv and down_proj (2.3-3.4 s each), "mn" one per Linear, bit-equal and as fast: jetrl's wgrad now
passes "mn".
Operands are random BF16 tensors quantized by jetrl's own quantizers, as `JetFP8Linear` makes them.

    python3 scripts/bench_deepgemm_jit.py [--tokens 700,1500,4096] [--linears qkv,down_proj] [--out DIR]

Prints a table and writes ``deepgemm-jit-<gpu>.json`` (GPU, versions, date, commit, command, rows) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import benchmeta

# (name, out_features, in_features) of Llama-3.1-8B's Linears (the shapes bench_linear.py times)
LINEARS = [("qkv", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up", 28672, 4096), ("down_proj", 4096, 14336)]
TOKENS = [700, 1500, 2100, 3300, 4096, 5000, 6600, 8192, 9999, 12000, 14500, 16384]
# (role, wgrad_compiled_dims)
VARIANTS = [("fprop", None), ("dgrad", None), ("wgrad", "nk"), ("wgrad", "mn")]

__all__ = ["LINEARS", "TOKENS", "cache_counts", "run", "summarize", "main"]


def cache_counts(root: Path) -> tuple[int, int]:
    """(kernel folders, files) under DeepGEMM's JIT cache `root`: it writes each compiled kernel into a folder
    named ``kernel.<name>.<hash>``."""
    kernels = files = 0
    for _, dirs, names in os.walk(root):
        kernels += sum(d.startswith("kernel.") for d in dirs)
        files += len(names)
    return kernels, files


def _tokens(value: str) -> list[int]:
    """``"700,1500"`` -> ``[700, 1500]`` (argparse type: a bad item is named)."""
    out = []
    for item in value.split(","):
        if not item.isdigit() or int(item) < 1:
            raise argparse.ArgumentTypeError(f"{item!r} is not a positive token count")
        out.append(int(item))
    return out


def _linears(value: str) -> list[tuple[str, int, int]]:
    names = [n for n in value.split(",") if n]
    known = {name: row for name, *row in LINEARS}
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{unknown or value!r}: choose from {sorted(known)}")
    return [(n, *known[n]) for n in names]


def _operands(role: str, t: int, n: int, k: int):
    """The GEMM operands of `role` for a Linear [n, k] at `t` tokens, as `JetFP8Linear` makes them."""
    import torch

    from jetrl.gemm.quantize import quantize_1x128, quantize_128x128, transpose_quantize

    g = torch.Generator(device="cuda").manual_seed(t)
    if role == "fprop":
        x = torch.randn((t, k), generator=g, device="cuda", dtype=torch.bfloat16)
        w = torch.randn((n, k), generator=g, device="cuda", dtype=torch.bfloat16) / k**0.5
        return (*quantize_1x128(x, scale_layout="deepgemm"), *quantize_128x128(w))
    if role == "dgrad":
        dy = torch.randn((t, n), generator=g, device="cuda", dtype=torch.bfloat16)
        w = torch.randn((n, k), generator=g, device="cuda", dtype=torch.bfloat16) / k**0.5
        return (*quantize_1x128(dy, scale_layout="deepgemm"), *quantize_128x128(w, with_transpose=True)[2:])
    dy = torch.randn((t, n), generator=g, device="cuda", dtype=torch.bfloat16)
    x = torch.randn((t, k), generator=g, device="cuda", dtype=torch.bfloat16)
    return (*transpose_quantize(dy), *transpose_quantize(x))


def _call(be, role: str, ops, acc):
    """One GEMM of `role`; wgrad accumulates into `acc` in place (as into FSDP's fp32 gradient)."""
    import torch

    if role == "wgrad":
        return be.gemm_accumulate_(*ops, acc)
    return be.gemm(*ops, role=role, out_dtype=torch.bfloat16)


def run(args, cache: Path) -> list[dict]:
    """One row per (Linear, role, compiled dims, tokens); `cache` is DeepGEMM's fresh JIT cache folder."""
    import torch

    from jetrl.gemm.deepgemm import DeepGemmBackend

    rows, first_out = [], {}
    for name, n, k in args.linears:
        for role, dims in VARIANTS:
            be = DeepGemmBackend()
            if dims is not None:
                be.wgrad_compiled_dims = dims
            for t in args.tokens:
                ops = _operands(role, t, n, k)
                acc = torch.zeros((n, k), dtype=torch.float32, device="cuda") if role == "wgrad" else None
                torch.cuda.synchronize()
                before = cache_counts(cache)
                row = {"linear": name, "n": n, "k": k, "role": role, "compiled_dims": dims or "nk", "tokens": t}
                t0 = time.perf_counter()
                try:
                    out = _call(be, role, ops, acc)
                    torch.cuda.synchronize()
                except Exception as e:  # e.g. a DeepGEMM build refusing compiled_dims="mn": recorded, not hidden
                    rows.append({**row, "error": f"{type(e).__name__}: {e}"})
                    print(f"{name:9s} {role:5s} {row['compiled_dims']:2s} T={t:6d}: FAILED {rows[-1]['error']}")
                    break
                first_s = time.perf_counter() - t0
                after = cache_counts(cache)
                if role == "wgrad":  # the same bits from both compiled-dims variants (nk runs first)
                    key = (name, t)
                    if key in first_out:
                        row["bits_equal_nk"] = bool(torch.equal(out, first_out.pop(key)))
                    else:
                        first_out[key] = out
                del out, acc
                acc = torch.zeros((n, k), dtype=torch.float32, device="cuda") if role == "wgrad" else None
                ms = []
                for _ in range(args.repeats):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    _call(be, role, ops, acc)
                    end.record()
                    end.synchronize()
                    ms.append(start.elapsed_time(end))
                row |= {
                    "new_kernels": after[0] - before[0],
                    "new_files": after[1] - before[1],
                    "first_call_s": first_s,
                    "steady_ms": statistics.median(ms),
                }
                rows.append(row)
                print(
                    f"{name:9s} {role:5s} {row['compiled_dims']:2s} T={t:6d}: {row['new_kernels']} new kernels, "
                    f"first call {first_s:.2f} s, steady {row['steady_ms']:.3f} ms"
                    + (f", bits equal to nk: {row['bits_equal_nk']}" if "bits_equal_nk" in row else ""),
                    flush=True,
                )
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Per (Linear, role, compiled dims): kernels compiled over the token counts, their first calls' seconds
    above the steady time (what the compiles cost a step), the steady ms summed over the counts, and (wgrad
    "mn") whether every count gave the "nk" bits."""
    out: dict[tuple, dict] = {}
    for r in rows:
        s = out.setdefault(
            (r["linear"], r["role"], r["compiled_dims"]),
            {
                "linear": r["linear"],
                "role": r["role"],
                "compiled_dims": r["compiled_dims"],
                "token_counts": 0,
                "new_kernels": 0,
                "first_call_excess_s": 0.0,
                "steady_ms_sum": 0.0,
            },
        )
        if "error" in r:  # the variant stopped at this count
            s["error"] = f"at {r['tokens']} tokens: {r['error']}"
            continue
        s["token_counts"] += 1
        s["new_kernels"] += r["new_kernels"]
        s["first_call_excess_s"] += max(r["first_call_s"] - r["steady_ms"] / 1e3, 0.0)
        s["steady_ms_sum"] += r["steady_ms"]
        if "bits_equal_nk" in r:
            s["bits_equal_nk"] = s.get("bits_equal_nk", True) and r["bits_equal_nk"]
    return list(out.values())


def _table(summary: list[dict]) -> str:
    lines = [
        f"{'linear':9s} {'role':5s} {'dims':4s} {'counts':>6s} {'kernels':>7s} {'compile s':>9s} "
        f"{'steady ms':>9s} bits=nk"
    ]
    for s in summary:
        if "error" in s:
            lines.append(f"{s['linear']:9s} {s['role']:5s} {s['compiled_dims']:4s} FAILED: {s['error'][:80]}")
            continue
        eq = {True: "yes", False: "NO"}.get(s.get("bits_equal_nk"), "")
        lines.append(
            f"{s['linear']:9s} {s['role']:5s} {s['compiled_dims']:4s} {s['token_counts']:6d} {s['new_kernels']:7d} "
            f"{s['first_call_excess_s']:9.2f} {s['steady_ms_sum']:9.2f} {eq}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=_tokens, default=TOKENS, help="token counts, comma-separated")
    p.add_argument("--linears", type=_linears, default=LINEARS, help="of " + ",".join(n for n, *_ in LINEARS))
    p.add_argument("--repeats", type=int, default=5, help="steady calls timed per row (median)")
    p.add_argument("--commit", default=None, help="the checkout's commit (the device machine has no git)")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    # a fresh cache, so what each call compiles shows as new folders (set before DeepGEMM is imported)
    cache = Path(tempfile.mkdtemp(prefix="jetrl-dg-jit-"))
    os.environ["DG_JIT_CACHE_DIR"] = str(cache)
    from jetrl.gemm.deepgemm import DeepGemmBackend

    reason = DeepGemmBackend.unavailable_reason()
    if reason is not None:
        print(f"bench_deepgemm_jit: {reason}", file=sys.stderr)
        return 2
    meta = benchmeta.meta(args.commit)
    rows = run(args, cache)
    summary = summarize(rows)
    result = {
        "benchmark": "deepgemm_jit",
        **meta,
        "dg_jit_cache_dir": str(cache),
        "tokens": args.tokens,
        "repeats": args.repeats,
        "summary": summary,
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"deepgemm-jit-{benchmeta.device_tag(meta['device'])}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(_table(summary))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
