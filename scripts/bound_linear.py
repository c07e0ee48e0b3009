"""Upper bounds on the FP8 Linear's speedup over bf16, from measured GEMM rates and copy bandwidth.

No GPU needed: it reads the committed results of `bench_linear.py` (the bf16 steps of each Llama-8B
Linear, graph-timed, and the DeepGEMM kernel times of its profiled o_proj step) and of
`bench_kernels.py` (the fastest graph-timed device copy of its shapes), and asks how fast the FP8
fwd+bwd could be if every quantization pass ran at copy bandwidth. Per Linear (T tokens, W ``[N, K]``):

- ``gemm_only``: fprop + dgrad at the profiled ``sm90_fp8_gemm_1d2d`` rate, wgrad at the
  ``sm90_fp8_gemm_1d1d`` (recipe (1, 1, 128)) rate, nothing else;
- ``separate``: plus the traffic the recipe's passes move with one kernel each: X and dY read
  (2 B) and written as 1x128 and 128x1 FP8 (1 B each) by two kernels -- 6 B per element; W read
  and written with its transpose (4 B); dW cast from the fp32 accumulator to bf16 (6 B);
- ``favorable``: only X and dY, each in one fused pass (4 B per element): W cached, gradients
  accumulated in fp32 ``main_grad``.

Each bound is ``bf16 step / (GEMMs + bytes / copy bandwidth)``. Writes
``scripts/results/linear-bound-<gpu>.json`` and prints the table beside the measured speedups.
"""

from __future__ import annotations

import argparse
import json
import math
import os

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def gemm_rates(linear: dict) -> tuple[float, float]:
    """(fprop/dgrad, wgrad) TFLOP/s of the DeepGEMM kernels in bench_linear's profiled step."""
    prof = linear["profile"]
    case = next(c for c in linear["linears"] if c["linear"] == prof["linear"] and c["tokens"] == prof["tokens"])
    flops = 2 * case["tokens"] * case["N"] * case["K"]
    rates = {}
    for kind in ("1d2d", "1d1d"):
        rows = [k for k in prof["kernels"] if f"sm90_fp8_gemm_{kind}" in k["name"]]
        if not rows:
            raise SystemExit(f"bound_linear: no sm90_fp8_gemm_{kind} kernel in the profile of {prof['linear']}")
        ms = sum(k["ms"] for k in rows)
        calls = sum(k["calls"] for k in rows)
        rates[kind] = calls * flops / (ms * 1e-3) / 1e12
    return rates["1d2d"], rates["1d1d"]


def bounds(linear: dict, copy_gbps: float, fwd_tflops: float, wgrad_tflops: float) -> list[dict]:
    """Per Linear case: the three bounds and the measured graph-timed speedup."""
    bw = copy_gbps * 1e9
    out = []
    for c in linear["linears"]:
        t, n, k = c["tokens"], c["N"], c["K"]
        flops = 2 * t * n * k
        gemm_s = 2 * flops / (fwd_tflops * 1e12) + flops / (wgrad_tflops * 1e12)
        bf16_s = c["bf16_graph_ms"] * 1e-3
        traffic = {
            "separate": 6 * t * k + 6 * t * n + 4 * n * k + 6 * n * k,
            "favorable": 4 * t * k + 4 * t * n,
        }
        row = {"linear": c["linear"], "tokens": t, "N": n, "K": k, "gemm_only": bf16_s / gemm_s}
        row.update({name: bf16_s / (gemm_s + b / bw) for name, b in traffic.items()})
        row["measured_graph"] = c["speedup_graph"]
        out.append(row)
    return out


def geomean(values) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values))


def summarize(linear: dict, kernels: dict) -> dict:
    copy = max(r["graph_gbps"] for r in kernels["rows"] if r["kernel"].startswith("copy"))
    fwd, wgrad = gemm_rates(linear)
    rows = bounds(linear, copy, fwd, wgrad)
    keys = ("gemm_only", "separate", "favorable", "measured_graph")
    return {
        "gpu": linear["gpu"],
        "inputs": {
            "fprop_dgrad_tflops": fwd,
            "wgrad_tflops": wgrad,
            "copy_gbps": copy,
            "linear_json_date": linear["date"],
            "kernels_json_date": kernels["date"],
        },
        "rows": rows,
        "geomean": {key: geomean(r[key] for r in rows) for key in keys},
        "goal": linear["goals"]["linear_speedup"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", default="nvidia-h200", help="the results files' GPU slug (default %(default)s)")
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args()
    with open(os.path.join(RESULTS, f"linear-{args.gpu}.json")) as f:
        linear = json.load(f)
    with open(os.path.join(RESULTS, f"kernels-{args.gpu}.json")) as f:
        kernels = json.load(f)
    result = summarize(linear, kernels)
    inp = result["inputs"]
    print(
        f"{result['gpu']}: FP8 GEMMs {inp['fprop_dgrad_tflops']:.0f} (fprop/dgrad) and {inp['wgrad_tflops']:.0f} "
        f"(wgrad) TFLOP/s, copy {inp['copy_gbps']:.0f} GB/s"
    )
    print(f"{'linear':10s} {'tokens':>6s} {'gemm_only':>9s} {'separate':>9s} {'favorable':>9s} {'measured':>9s}")
    for r in result["rows"]:
        print(
            f"{r['linear']:10s} {r['tokens']:6d} {r['gemm_only']:9.2f} {r['separate']:9.2f} "
            f"{r['favorable']:9.2f} {r['measured_graph']:9.2f}"
        )
    g = result["geomean"]
    print(
        f"{'geomean':10s} {'':6s} {g['gemm_only']:9.2f} {g['separate']:9.2f} {g['favorable']:9.2f} "
        f"{g['measured_graph']:9.2f}   (goal {result['goal']})"
    )
    path = os.path.join(args.out, f"linear-bound-{args.gpu}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
