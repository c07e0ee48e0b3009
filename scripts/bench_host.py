"""Host (CPU) cost of each piece of an FP8 Linear fwd+bwd, on a CUDA GPU.

Eager FP8 Linears at Llama-8B shapes take 1.2-1.6 ms of host time to issue one fwd+bwd, against
0.2-0.4 ms for bf16 (`bench_linear.py`), which makes small Linears host-bound. This script splits
that cost: for each call it issues `--calls` calls on tiny tensors (128 x 128: the GPU finishes each
kernel long before the host issues the next, so the queue never fills and what is timed is the host)
and reports microseconds per call (median of `--repeats` runs, perf_counter, one sync per run):

- allocation: ``torch.empty`` and `jetrl.kernels._runtime.scale_buffer` (DeepGEMM layout);
- the non-finite flag lookup every launcher makes (`nonfinite_flag`);
- a bare Triton launch of `_quantize_1x128_kernel` with preallocated outputs, against jetrl's launcher
  `launch_quantize_1x128` (checks, allocation, flag, launch) and the ``jetrl::quantize_1x128``
  custom op (the dispatcher path the eager fast path bypasses);
- the other launchers of a step: `launch_transpose_quantize`, `launch_quantize_128x128` (+ transpose);
- DeepGEMM: a bare ``fp8_gemm_nt`` (fprop, preallocated output; also cycling through 8 operand sets,
  as a step's tensors are new each time) and the wgrad recipe (1, 1, 128) accumulating in place,
  against the `deepgemm` backend's `gemm` (output allocation, checks; wgrad's zero-filled output);
- autograd: an empty ``torch.autograd.Function`` fwd+bwd;
- whole steps (`bench_linear.LinearCase`'s): bf16 ``nn.Linear`` fwd+bwd, `JetFP8Linear` fwd+bwd with
  the weight cached and with it re-quantized (one micro-batch per optimizer step).

``--profile NAMES`` (substrings of the call names) also prints and saves a cProfile of 100 calls of
each, with autograd's backward on the calling thread so that it is seen; ``--api NAMES`` lists the
CUDA runtime/driver API calls each makes (torch.profiler), e.g. what DeepGEMM does inside one call.
Prints a table and writes ``host-<gpu>.json`` (GPU name, versions, date, rows, profiles) to ``--out``.

    python3 scripts/bench_host.py [--out DIR] [--calls 300] [--repeats 5] [--profile "cached W"]
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import importlib
import io
import itertools
import json
import os
import platform
import pstats
import statistics
import time

import benchmeta
import torch
import triton

from jetrl.gemm import get_backend
from jetrl.kernels._runtime import nonfinite_flag, scale_buffer
from jetrl.recipe import BLOCK, DEFAULT_EPS, E4M3_MAX, Recipe

q1 = importlib.import_module("jetrl.kernels.quantize_1x128")
q128 = importlib.import_module("jetrl.kernels.quantize_128x128")
tq = importlib.import_module("jetrl.kernels.transpose_quantize")

M = N = K = 128


def per_call_us(fn, calls: int, repeats: int) -> float:
    """Median over `repeats` runs of (host seconds to issue `calls` calls of fn) / calls, in us."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(runs)


class _Noop(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


def _bare_quantize(x, q, s, flag, slot):
    """`launch_quantize_1x128`'s kernel launch alone (same arguments, outputs preallocated)."""
    m, k = x.shape
    g = triton.cdiv(k, BLOCK)
    q1._quantize_1x128_kernel[(triton.cdiv(m, 64) * g,)](
        x, q, s, q, flag, slot, m, k, g, x.stride(0), q.stride(0), s.stride(0), s.stride(1),
        EPS=DEFAULT_EPS, FP8_MAX=E4M3_MAX, BLOCK_M=64, GROUP=BLOCK, G_FASTEST=True, STORE_PRECAST=False, RCP=True,
        num_warps=4,
    )  # fmt: skip


def cases(dev):
    from bench_linear import LinearCase  # the steps bench_linear times (scripts/ is on sys.path here)

    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    w = torch.randn(N, K, device=dev, dtype=torch.bfloat16)
    xq, xs = q1.launch_quantize_1x128(x, "deepgemm", "bench.x")
    wq, ws = q128.launch_quantize_128x128(w, False, "bench.w")
    flag, slot = nonfinite_flag("jetrl::quantize_1x128", "bench.x", dev)
    q_out, s_out = torch.empty_like(xq), scale_buffer(M, K // BLOCK, "deepgemm", dev)
    be = get_backend("deepgemm")
    dg = be.dg
    d = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
    acc = torch.zeros(N, K, device=dev, dtype=torch.float32)
    xtq, xts = tq.launch_transpose_quantize(x, "bench.x")  # [K, M]: wgrad operands, token axis M
    # the same fprop on 8 different operand/output allocations in turn (a step's tensors are new each time)
    sets = [((xq.clone(), xs.clone()), (wq.clone(), ws.clone()), torch.empty_like(d)) for _ in range(8)]
    rotating = itertools.cycle(sets)
    leaf = torch.randn(M, K, device=dev, requires_grad=True)
    case = LinearCase("bench", N, K, M, be, Recipe.from_name("jetrl-unified"), dev)
    return [
        ("alloc", "torch.empty fp8 [128, 128]", lambda: torch.empty(M, K, device=dev, dtype=torch.float8_e4m3fn)),
        ("alloc", "scale_buffer (deepgemm layout)", lambda: scale_buffer(M, K // BLOCK, "deepgemm", dev)),
        ("alloc", "nonfinite_flag lookup", lambda: nonfinite_flag("jetrl::quantize_1x128", "bench.x", dev)),
        ("triton", "bare _quantize_1x128_kernel launch", lambda: _bare_quantize(x, q_out, s_out, flag, slot)),
        ("triton", "launch_quantize_1x128 (jetrl launcher)", lambda: q1.launch_quantize_1x128(x, "deepgemm", "b")),
        ("triton", "jetrl::quantize_1x128 custom op", lambda: q1.quantize_1x128(x, scale_layout="deepgemm", name="b")),
        ("triton", "launch_transpose_quantize", lambda: tq.launch_transpose_quantize(x, "bench.x")),
        ("triton", "launch_quantize_128x128 +T (bf16)", lambda: q128.launch_quantize_128x128(w, True, "bench.w")),
        ("deepgemm", "bare fp8_gemm_nt fprop", lambda: dg.fp8_gemm_nt((xq, xs), (wq, ws), d)),
        (
            "deepgemm",
            "backend.gemm fprop (allocates output)",
            lambda: be.gemm(xq, xs, wq, ws, role="fprop", out_dtype=torch.bfloat16),
        ),
        (
            "deepgemm",
            "bare fp8_gemm_nt fprop, 8 rotating operand sets",
            lambda: dg.fp8_gemm_nt(*next(rotating)),
        ),
        (
            "deepgemm",
            "bare fp8_gemm_nt wgrad (1,1,128), in place",
            lambda: dg.fp8_gemm_nt((xtq, xts), (xtq, xts), acc, c=acc, recipe=(1, 1, 128)),
        ),
        (
            "deepgemm",
            "backend.gemm wgrad (zeros + accumulate)",
            lambda: be.gemm(xtq, xts, xtq, xts, role="wgrad", out_dtype=torch.float32),
        ),
        ("autograd", "empty autograd.Function fwd+bwd", lambda: _Noop.apply(leaf).sum().backward()),
        ("step", "bf16 nn.Linear fwd+bwd", case.step("bf16")),
        ("step", "JetFP8Linear fwd+bwd, cached W", case.step("fp8_cached_w")),
        ("step", "JetFP8Linear fwd+bwd, W re-quantized", case.step("fp8")),
    ]


def profile_calls(fn, calls: int, top: int = 18) -> str:
    """cProfile of `calls` calls of fn (autograd's backward on the calling thread, so it is seen)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    with torch.autograd.set_multithreading_enabled(False):
        prof.enable()
        for _ in range(calls):
            fn()
        prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def cuda_api_calls(fn, calls: int = 50) -> list[dict]:
    """CUDA runtime/driver API calls made while issuing `fn` (torch.profiler, CPU side): per call of
    fn, how many of each and their host microseconds, largest total first. Shows what a library does
    inside one opaque call (a launch, an allocation, a sync, a device query)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with (
        torch.autograd.set_multithreading_enabled(False),
        profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof,
    ):
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows = [
        {"api": e.key, "per_call": e.count / calls, "us_per_call": e.self_cpu_time_total / calls}
        for e in prof.key_averages()
        if e.key.startswith(("cuda", "cu")) and e.key != "cudaDeviceSynchronize"
    ]
    return sorted(rows, key=lambda r: -r["us_per_call"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--profile", default="", help="comma list of call names (substrings) to also cProfile")
    ap.add_argument("--api", default="", help="comma list of call names (substrings) whose CUDA API calls to list")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_host.py needs a CUDA GPU (it times what the host does to launch GPU work)")
    dev = torch.device("cuda")
    gpu = torch.cuda.get_device_name()
    rows, profiles, api = [], {}, {}
    wanted = [p for p in args.profile.split(",") if p]
    wanted_api = [p for p in args.api.split(",") if p]
    for group, name, fn in cases(dev):
        us = per_call_us(fn, args.calls, args.repeats)
        rows.append({"group": group, "call": name, "us_per_call": us})
        print(f"{group:9s} {name:45s} {us:8.1f} us", flush=True)
        if any(w in name for w in wanted):
            profiles[name] = profile_calls(fn, 100)
        if any(w in name for w in wanted_api):
            api[name] = cuda_api_calls(fn)
    for name, calls in api.items():
        print(f"\n## CUDA API calls per call: {name}")
        for r in calls[:12]:
            print(f"  {r['api'][:60]:60s} {r['per_call']:6.2f}x {r['us_per_call']:8.1f} us")
    for name, text in profiles.items():
        print(f"\n## cProfile, 100 calls: {name}\n" + "\n".join(ln[:160] for ln in text.splitlines() if ln.strip()))
    dg = get_backend("deepgemm").dg
    res = {
        "gpu": gpu,
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "deep_gemm": getattr(dg, "__version__", "unknown"),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "method": f"median of {args.repeats} runs of {args.calls} calls on 128x128 tensors; host perf_counter",
        "rows": rows,
        "profiles": profiles,
        "cuda_api": api,
    }
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"host-{benchmeta.device_tag(gpu)}.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
