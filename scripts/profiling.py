"""Where a GPU step's time goes, measured: one run of a function under torch.profiler, summarized as wall vs
GPU-busy milliseconds per step and the kernels with the most GPU time (imported by the ``scripts/bench_*.py``
run as scripts: this folder is then first on ``sys.path``)."""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["profile_summary", "profile_cuda"]


def profile_summary(kernels: list[tuple[str, int, float]], *, wall_s: float, steps: int, top: int = 15) -> dict:
    """Where a step's time goes, from ``(kernel name, calls, GPU microseconds)`` of a profiled run of `steps`
    steps (e.g. output tokens of a generate) that took `wall_s`: wall and GPU-busy ms per step (their gap is
    host time the GPU waited through, when kernels do not overlap) and the `top` kernels by GPU time, with
    their share."""
    if steps < 1 or wall_s <= 0:
        raise ValueError(f"profile_summary: steps={steps}, wall_s={wall_s} must be positive")
    busy_us = sum(us for _, _, us in kernels)
    if busy_us <= 0:
        raise ValueError("profile_summary: no GPU kernel time was recorded (CUDA activity profiling unavailable?)")
    rows = sorted(kernels, key=lambda k: -k[2])[:top]
    return {
        "steps": steps,
        "wall_ms_per_step": wall_s * 1e3 / steps,
        "gpu_busy_ms_per_step": busy_us / 1e3 / steps,
        "top_kernels": [
            {"name": n, "calls_per_step": c / steps, "gpu_us_per_step": us / steps, "share": us / busy_us}
            for n, c, us in rows
        ],
    }


def profile_cuda(fn: Callable[[], object], *, steps: int, top: int = 15) -> dict:
    """`profile_summary` of one call of `fn` (which runs `steps` steps) under torch.profiler, CUDA kernels
    (graph replays included) timed between two device synchronizations. Warm `fn` up before: a first call's
    compilation would be counted."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    kernels = [
        (e.key, e.count, e.self_device_time_total)
        for e in prof.key_averages()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0
    ]
    return profile_summary(kernels, wall_s=wall, steps=steps, top=top)
