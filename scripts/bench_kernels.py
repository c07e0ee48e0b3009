"""Effective bandwidth of the jetrl FP8 Triton kernels on a CUDA GPU, beside a device copy and eager torch.

For M in {4096, 16384} and K in {4096, 14336} (bf16 inputs) it times each kernel with
``triton.testing.do_bench`` (median), converts to effective GB/s = (bytes read + bytes written) /
time, and prints a table with the device-to-device copy of an ``[M, K]`` bf16 tensor measured in the
same run, the eager torch reference (`jetrl.kernels.torch_<op>`) and the goals of issue 3:
quantize kernels and rmsnorm+quant >= 80% of copy (3.4 TB/s on an H200), transpose-quantize >=
2.5 TB/s, swiglu+quant >= 75% of copy (the norm and SwiGLU producers also with ``[deepgemm]`` scales, the form
the trainer and the fused engine run); also the weight sync's digest (`jetrl.kernels.digest`: bytes
read only, no goal; eager = the torch definition) and the trainer-matched engine's RoPE (`jetrl.kernels.rope`, rows
of 128-wide heads, no goal; eager = its torch reference). Each kernel (and the copy) is timed twice: one call at a time
(``gbps``), and launched back to back over rotating input sets larger than L2, replayed from a CUDA
graph (``graph_gbps``: the launch gap that a single ~20 us call pays is gone, as inside a training
step); the goals are judged for each timing against the copy timed the same way.

``--sweep`` times launch configs per kernel (default shapes M=16384, K=4096 and 14336; ``--sweep-shapes``)
to pick defaults, each config's outputs checked against the default's (`valid_config`). Writes
``kernels-<gpu>.json`` (GPU name, torch/triton versions, date, every row) to ``--out`` (default
scripts/results/): a table run replaces the table, a sweep run adds its rows as a new labelled run.

    python3 scripts/bench_kernels.py [--out DIR] [--no-eager] [--sweep [NAMES]] [--sweep-shapes MxK,..]
        [--sweep-only] [--sweep-note TEXT]
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import itertools
import json
import os

import benchmeta
import torch
import triton
from triton.testing import do_bench

import jetrl.kernels as K
from jetrl.kernels.digest import launch_digest, torch_digest
from jetrl.quant import ceil_div
from jetrl.rollout.sync import DIGEST_K

# the op modules (jetrl.kernels re-exports functions of the same names, so import the modules by path)
q1, q128, rq, sq, tq, rp = (
    importlib.import_module(f"jetrl.kernels.{m}")
    for m in ("quantize_1x128", "quantize_128x128", "rmsnorm_quant", "swiglu_quant", "transpose_quantize", "rope")
)
ROPE_POSITIONS = 8192  # the cos/sin table's rows (an engine's max_model_len)

MS = (4096, 16384)
KS = (4096, 14336)


def _gbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def _time(fn) -> float:
    return do_bench(fn, warmup=10, rep=60, return_mode="median")


def _time_graph(fns: list) -> float:
    """ms per call of ``fns`` launched back to back, replayed from one CUDA graph (do_bench median of
    the replays / len(fns)): how the kernels run inside a training step, without the launch gap and
    event overhead that a single timed call of a ~20 us kernel carries. Each fn reads its own input
    set (together more bytes than L2 holds) and its outputs stay alive, so no call finds its operands
    in L2 from the call before."""
    for fn in fns:  # compile and register flags outside the capture
        fn()
    torch.cuda.synchronize()
    graph, keep = torch.cuda.CUDAGraph(), []
    with torch.cuda.graph(graph):
        for fn in fns:
            keep.append(fn())
    ms = _time(graph.replay) / len(fns)
    del graph, keep
    return ms


def _n_sets(m: int, k: int) -> int:
    """Input sets for `_time_graph`: enough [M, K] bf16 tensors to cover 4x the L2 cache, at least 2."""
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    return max(2, min(16, ceil_div(4 * l2, 2 * m * k)))


def _inputs(m: int, k: int) -> dict:
    """One set of bf16 inputs (and the saved tensors the backward/requantize kernels read) at [M, K]."""
    dev = "cuda"
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    gu = torch.randn(m, 2 * k, device=dev, dtype=torch.bfloat16)
    w = (1 + 0.1 * torch.randn(k, device=dev)).to(torch.bfloat16)
    xq, xs = K.quantize_1x128(x)
    _, _, _, rstd = K.rmsnorm_quant(x, w, 1e-6)
    dy = torch.randn_like(x)
    table = torch.randn(2, ROPE_POSITIONS, 128, device=dev).to(torch.bfloat16)
    pos = torch.randint(0, ROPE_POSITIONS, (m,), device=dev)
    return {"x": x, "gate": gu[:, :k], "up": gu[:, k:], "w": w, "xq": xq, "xs": xs, "rstd": rstd, "dy": dy,
            "rope_table": table, "pos": pos}  # fmt: skip


def _cases(m: int, k: int, inp: dict):
    """(kernel name, goal kind, bytes moved, triton fn, eager fn) for one shape and input set; the
    triton fn takes launch options (``fn(**config)``, the sweep's) and runs the defaults without."""
    x, gate, up, w, xq, xs, rstd, dy = (inp[n] for n in ("x", "gate", "up", "w", "xq", "xs", "rstd", "dy"))
    g, gm = ceil_div(k, 128), ceil_div(m, 128)
    mk = m * k
    return [
        (
            "quantize_1x128[row]",
            "quant",
            2 * mk + mk + 4 * m * g,
            lambda **c: q1.launch_quantize_1x128(x, "row", **c),
            lambda: K.torch_quantize_1x128(x),
        ),
        (
            "quantize_1x128[deepgemm]",
            "quant",
            2 * mk + mk + 4 * m * g,
            lambda **c: q1.launch_quantize_1x128(x, "deepgemm", **c),
            lambda: K.torch_quantize_1x128(x, scale_layout="deepgemm"),
        ),
        (
            "quantize_128x128",
            "quant",
            2 * mk + mk + 4 * gm * g,
            lambda **c: q128.launch_quantize_128x128(x, **c),
            lambda: K.torch_quantize_128x128(x),
        ),
        (
            "quantize_128x128[+T]",
            "quant",
            2 * mk + 2 * mk + 8 * gm * g,
            lambda **c: q128.launch_quantize_128x128(x, True, **c),
            lambda: K.torch_quantize_128x128(x, with_transpose=True),
        ),
        (
            "transpose_quantize",
            "transpose",
            2 * mk + mk + 4 * k * gm,
            lambda **c: tq.launch_transpose_quantize(x, **c),
            lambda: K.torch_transpose_quantize(x),
        ),
        (
            "transpose_requantize",
            "transpose",
            mk + 4 * m * g + mk + 4 * k * gm,
            lambda **c: tq.launch_transpose_requantize(xq, xs, **c),
            lambda: K.torch_transpose_requantize(xq, xs),
        ),
        (
            "rmsnorm_quant",
            "quant",
            2 * mk + 2 * k + 2 * mk + mk + 4 * m * g + 4 * m,
            lambda **c: rq.launch_rmsnorm_quant(x, w, 1e-6, **c),
            lambda: K.torch_rmsnorm_quant(x, w, 1e-6),
        ),
        (
            # the trainer's and the fused engine's form (scales as DeepGEMM reads them, their group stride
            # align(M, 4) left out of Triton's specialization: kernels._runtime.SCALE_STRIDE_UNALIGNED)
            "rmsnorm_quant[deepgemm]",
            "quant",
            2 * mk + 2 * k + 2 * mk + mk + 4 * m * g + 4 * m,
            lambda **c: rq.launch_rmsnorm_quant(x, w, 1e-6, "deepgemm", **c),
            lambda: K.torch_rmsnorm_quant(x, w, 1e-6, scale_layout="deepgemm"),
        ),
        (
            "rmsnorm_backward",
            "none",
            2 * mk * 2 + 2 * k + 4 * m + 2 * mk,
            lambda **c: rq.launch_rmsnorm_backward(dy, x, w, rstd, **c),
            lambda: K.torch_rmsnorm_backward(dy, x, w, rstd),
        ),
        (
            "swiglu_quant",
            "swiglu",
            4 * mk + 2 * mk + mk + 4 * m * g,
            lambda **c: sq.launch_swiglu_quant(gate, up, **c),
            lambda: K.torch_swiglu_quant(gate, up),
        ),
        (
            "swiglu_quant[deepgemm]",
            "swiglu",
            4 * mk + 2 * mk + mk + 4 * m * g,
            lambda **c: sq.launch_swiglu_quant(gate, up, "deepgemm", **c),
            lambda: K.torch_swiglu_quant(gate, up, scale_layout="deepgemm"),
        ),
        (
            "digest (weight sync)",
            "none",
            2 * mk,
            lambda **c: launch_digest(x.view(torch.int64).reshape(-1), DIGEST_K, **c),
            lambda: torch_digest(x.view(torch.int64).reshape(-1), DIGEST_K),
        ),
        (
            "rope (engine RoPE, head_dim 128)",
            "none",
            2 * mk + 2 * mk + 2 * 2 * m * 128 + 8 * m,
            lambda **c: rp.launch_rope(x, inp["rope_table"], inp["pos"], 128, **c),
            lambda: K.torch_rope(x, inp["rope_table"], inp["pos"], 128),
        ),
        (
            "swiglu_backward",
            "none",
            6 * mk + 4 * mk,
            lambda **c: sq.launch_swiglu_backward(dy, gate, up, **c),
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


def _grid(**axes) -> list[dict]:
    """Every combination of the given option values, as launch-config dicts."""
    return [dict(zip(axes, vals, strict=True)) for vals in itertools.product(*axes.values())]


# configs timed beside the default launch ({}); every flag both ways (g_fastest / k_fastest: program
# order; chunk_n=128: the block in registers).
# rcp (division through the per-group reciprocal) is on in every config: earlier sweeps (the
# sweep_runs of the committed JSON) found it as fast or faster everywhere.
SWEEPS = {
    "quantize_1x128[row]": _grid(block_m=(16, 32, 64, 128, 256), num_warps=(2, 4, 8, 16), g_fastest=(False, True)),
    "transpose_quantize": _grid(block_k=(16, 32, 64, 128), num_warps=(1, 2, 4, 8), k_fastest=(False, True)),
    "digest (weight sync)": _grid(block=(1024, 2048, 4096, 8192), num_warps=(4, 8, 16)),
    "transpose_requantize": _grid(block_k=(32, 64, 128), num_warps=(2, 4, 8), k_fastest=(False, True)),
    "rmsnorm_quant": _grid(block_k=(2048, 4096, 16384), num_warps=(4, 8, 16))
    + _grid(block_m=(2, 4), block_k=(2048, 4096), num_warps=(8, 16)),
    "swiglu_quant": _grid(block_m=(8, 16, 32, 64), num_warps=(4, 8)),
    "rope (engine RoPE, head_dim 128)": _grid(block_h=(1, 2, 4, 8, 16), num_warps=(1, 2, 4, 8)),
    "quantize_128x128": _grid(num_warps=(4, 8, 16, 32), chunk_n=(16, 32, 64, 128), k_fastest=(False, True)),
    "quantize_128x128[+T]": _grid(num_warps=(4, 8, 16), chunk_n=(32, 64, 128), k_fastest=(False, True))
    + _grid(fused_t=(False,), t_block=(32, 64, 128), t_warps=(2, 4, 8)),
}
SWEEP_SHAPES = ((16384, 4096), (16384, 14336))


def _same(a, b) -> bool:
    """Bitwise equality of two launcher outputs (tuples of tensors)."""
    return all(
        x.shape == y.shape and torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))
        for x, y in zip(a, b, strict=True)
    )


def valid_config(name: str, out, ref) -> bool:
    """Whether a config's outputs `out` are acceptable beside the default's `ref`: bit-equal (a tuning
    option must not change a byte), except RMSNorm's block/warps settings, which may move y by an ulp
    (the variance's reduction order): there the contract is checked, (q, s) = quantize_1x128 of its own y."""
    if _same(out, ref):
        return True
    if name == "rmsnorm_quant":
        y, q, s, _ = out
        return _same((q, s), K.quantize_1x128(y))
    return False


def _sweep(m: int, k: int, kernels: list[str]) -> list[dict]:
    """Time the default and every config of `SWEEPS` at one shape (the launchers and byte counts of
    `_cases`), one call at a time (``gbps``) and back to back from a CUDA graph (``graph_gbps``,
    `_time_graph`: what picks the best; single calls of the ~20 us kernels at M=4096 varied by up to
    2.6x between runs); each config's outputs are checked against the default's (`valid_config`), the
    best valid config printed."""
    sets = [_inputs(m, k) for _ in range(_n_sets(m, k))]
    per_set = [{name: (nbytes, fn) for name, _, nbytes, fn, _ in _cases(m, k, t)} for t in sets]
    rows = []
    for name in kernels:
        nbytes, fn = per_set[0][name]
        ref = fn()
        for c in [{}, *SWEEPS[name]]:
            out = fn(**c)
            same, valid = _same(out, ref), valid_config(name, out, ref)
            calls = [lambda f=cases[name][1], c=c: f(**c) for cases in per_set]
            gbps = _gbps(nbytes, _time(calls[0]))
            graph_gbps = _gbps(nbytes, _time_graph(calls))
            rows.append(
                {"kernel": name, "M": m, "K": k, "config": c, "gbps": gbps, "graph_gbps": graph_gbps,
                 "same_bytes": same, "valid": valid}
            )  # fmt: skip
            flag = "" if same else "y differs by reduction order" if valid else "INVALID"
            cfg = json.dumps(c)
            print(f"sweep {name:24s} {m:6d} {k:6d} {cfg:56s} {gbps:6.0f} | graph {graph_gbps:6.0f} GB/s {flag}")
        best = max((r for r in rows if r["kernel"] == name and r["valid"]), key=lambda r: r["graph_gbps"])
        print(f"best  {name:24s} {m:6d} {k:6d} {json.dumps(best['config']):56s} graph {best['graph_gbps']:6.0f} GB/s")
    return rows


def _table(no_eager: bool) -> list[dict]:
    """The issue's table: every kernel at every (M, K), single-call and graphed, beside copy and eager."""
    rows = []
    for m in MS:
        for k in KS:
            sets = [_inputs(m, k) for _ in range(_n_sets(m, k))]
            src = [inp["x"] for inp in sets]
            dst = [torch.empty_like(t) for t in src]
            copies = [lambda a=a, b=b: b.copy_(a) for a, b in zip(src, dst, strict=True)]
            copy_gbps = _gbps(4 * m * k, _time(copies[0]))
            copy_graph = _gbps(4 * m * k, _time_graph(copies))
            rows.append(
                {"kernel": "copy (bf16 d2d)", "M": m, "K": k, "gbps": copy_gbps, "copy_gbps": copy_gbps,
                 "graph_gbps": copy_graph, "graph_copy_gbps": copy_graph}
            )  # fmt: skip
            del dst, copies
            per_set = [_cases(m, k, inp) for inp in sets]
            for j, (name, kind, nbytes, fn, eager) in enumerate(per_set[0]):
                gbps = _gbps(nbytes, _time(fn))
                graph_gbps = _gbps(nbytes, _time_graph([cases[j][3] for cases in per_set]))
                eager_gbps = None if no_eager else _gbps(nbytes, _time(eager))
                goal, goal_txt = _goal(kind, copy_gbps)
                graph_goal, _ = _goal(kind, copy_graph)
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
                        "graph_gbps": graph_gbps,
                        "graph_copy_gbps": copy_graph,
                        "graph_pct_copy": 100.0 * graph_gbps / copy_graph,
                        "graph_goal_gbps": graph_goal,
                        "meets_goal_graph": None if graph_goal is None else graph_gbps >= graph_goal,
                    }
                )
            del sets, per_set, src
            torch.cuda.empty_cache()
    return rows


def _print_table(rows: list[dict]) -> None:
    hdr = (
        f"{'kernel':26s} {'M':>6s} {'K':>6s} {'GB/s':>8s} {'%copy':>6s} {'copy':>7s} {'eager':>7s} {'goal':>22s} ok  "
        f"{'graph':>7s} {'%copy':>6s} ok"
    )
    print(hdr)
    print("-" * len(hdr))
    ok = {True: "yes", False: "NO", None: "  -"}
    for r in rows:
        eager = f"{r['eager_gbps']:7.0f}" if r.get("eager_gbps") else "      -"
        print(
            f"{r['kernel']:26s} {r['M']:6d} {r['K']:6d} {r['gbps']:8.0f} {r.get('pct_copy', 100.0):6.1f} "
            f"{r['copy_gbps']:7.0f} {eager} {r.get('goal', '-'):>22s} {ok[r.get('meets_goal')]:3s} "
            f"{r['graph_gbps']:7.0f} {r.get('graph_pct_copy', 100.0):6.1f} {ok[r.get('meets_goal_graph')]}"
        )


def _shapes(text: str) -> list[tuple[int, int]]:
    """``"16384x4096,4096x14336"`` -> ``[(16384, 4096), (4096, 14336)]``."""
    shapes = []
    for item in text.split(","):
        parts = item.lower().split("x")
        if len(parts) != 2 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
            raise SystemExit(f"--sweep-shapes {text!r}: give MxK pairs separated by commas, e.g. 16384x4096")
        shapes.append((int(parts[0]), int(parts[1])))
    return shapes


def sweep_names(arg: str) -> list[str]:
    """The `SWEEPS` names `--sweep` selects: ``all``, or a comma list of names, each exact or the part of a name
    before ``" ("`` (``rope`` for ``"rope (engine RoPE, head_dim 128)"``, whose comma a plain split would cut)."""
    if arg == "all":
        return list(SWEEPS)
    names = []
    for token in (t.strip() for t in arg.split(",")):
        hits = [n for n in SWEEPS if token in (n, n.split(" (")[0])]
        if not hits:
            raise SystemExit(f"--sweep: unknown kernel {token!r}; choose from {list(SWEEPS)}")
        names.append(hits[0])
    return names


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument(
        "--sweep",
        nargs="?",
        const="all",
        help="also time launch configs (all kernels, or a comma list of SWEEPS names; a name's part before "
        "' (' selects it too, e.g. 'rope')",
    )
    ap.add_argument(
        "--sweep-shapes",
        default=",".join(f"{m}x{k}" for m, k in SWEEP_SHAPES),
        help="MxK shapes of the sweep (default %(default)s)",
    )
    ap.add_argument("--sweep-only", action="store_true", help="run the sweep alone; the table in the JSON is kept")
    ap.add_argument("--sweep-note", default="", help="what this sweep run tried, stored beside its rows")
    ap.add_argument("--no-eager", action="store_true", help="skip the eager torch references")
    ap.add_argument("--commit", help="the checkout's commit, recorded (the device machine has no git)")
    args = ap.parse_args()
    sweep_kernels = sweep_names(args.sweep) if args.sweep else []
    if args.sweep_only and not sweep_kernels:
        raise SystemExit("--sweep-only needs --sweep")
    sweep_shapes = _shapes(args.sweep_shapes) if sweep_kernels else []
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels.py needs a CUDA GPU (the Triton kernels are what is measured)")
    gpu = torch.cuda.get_device_name()
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    rows = [] if args.sweep_only else _table(args.no_eager)
    K.check_nonfinite()
    sweep = [r for m, k in sweep_shapes for r in _sweep(m, k, sweep_kernels)]

    os.makedirs(args.out, exist_ok=True)
    slug = benchmeta.device_tag(gpu)
    path = os.path.join(args.out, f"kernels-{slug}.json")
    # one file per GPU: a table run replaces the table, a sweep run adds its rows under a new label
    result = {}
    if os.path.exists(path):
        with open(path) as f:
            result = json.load(f)
    if rows:
        result.update(
            gpu=gpu,
            torch=torch.__version__,
            triton=triton.__version__,
            date=now,
            timing=(
                "gbps: do_bench median of single calls (warmup 10 ms, rep 60 ms); graph_gbps: the same kernel "
                "launched back to back over rotating input sets (> 4x L2) replayed from a CUDA graph; "
                "GB/s = (bytes read + written) / time; goals judged against the copy timed the same way"
            ),
            rows=rows,
            meta=benchmeta.meta(args.commit),
        )
    if sweep:
        runs = result.setdefault("sweep_runs", {})
        label = f"sweep-{len(runs) + 1}"
        runs[label] = f"{now}: {','.join(sweep_kernels)} at {args.sweep_shapes}; torch {torch.__version__}, " + (
            f"triton {triton.__version__}. {args.sweep_note}".strip()
        )
        result.setdefault("sweep", []).extend(dict(r, run=label) for r in sweep)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)

    if rows:
        print(f"\n{gpu} | torch {torch.__version__} | triton {triton.__version__}")
        _print_table(rows)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
