"""Where a GPU step's time goes, measured: one run of a function under torch.profiler, summarized as wall vs
GPU-busy milliseconds per step and the kernels with the most GPU time, and where its host time goes, under
cProfile (imported by the ``scripts/bench_*.py`` run as scripts: this folder is then first on ``sys.path``)."""

from __future__ import annotations

import gc
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

__all__ = [
    "profile_summary",
    "profile_cuda",
    "profile_host",
    "profile_worker",
    "host_time",
    "worker_profiler_config",
    "read_trace",
    "launch_kind",
    "DEVICE_EVENT_CATEGORIES",
    "HOST_CALL_CATEGORIES",
    "HOST_ACTIVITY_CATEGORIES",
    "Trace",
]

DEVICE_EVENT_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
"""Chrome-trace categories of device activity (what `profile_cuda` counts as device time)."""
HOST_CALL_CATEGORIES = ("cuda_runtime", "cuda_driver")
"""Chrome-trace categories of the host's CUDA runtime / driver calls (launches, copies, synchronizations)."""
HOST_ACTIVITY_CATEGORIES = ("cpu_op", "user_annotation", "python_function", *HOST_CALL_CATEGORIES)
"""Chrome-trace categories of host work (the profiler's own whole-window ``Trace`` span and the GPU timeline's
annotations are not)."""
RUNTIME_CALL = re.compile(r"cu(da)?[A-Z]")
"""A CUDA runtime / driver call's name in torch.profiler's key averages (``cudaStreamSynchronize``,
``cuLaunchKernelEx``), as against ``aten::`` ops and kernels."""

LAUNCH_CALLS = {
    "graph": ("cudaGraphLaunch", "cuGraphLaunch"),
    "kernel": ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchCooperativeKernel", "cuLaunchCooperativeKernel"),
}
"""Host CUDA runtime / driver calls that start device work: a CUDA-graph replay, or one kernel launched on its
own (eager PyTorch, Triton, a library). Profilers may suffix the API version (``cudaGraphLaunch_v10000``)."""


def launch_kind(name: str) -> str | None:
    """``"graph"`` / ``"kernel"`` for a host call of `LAUNCH_CALLS` (version suffix and ``Ex`` / ``ExC`` variants
    included: ``cuLaunchKernelEx``, ``cudaLaunchKernelExC_v11060``), else None."""
    base = name.split("_v", 1)[0].removesuffix("ExC").removesuffix("Ex")
    return next((kind for kind, calls in LAUNCH_CALLS.items() if base in calls), None)


def profile_summary(
    kernels: list[tuple[str, int, float]],
    *,
    wall_s: float,
    steps: int,
    top: int = 15,
    host_calls: list[tuple[str, int, float]] | None = None,
    top_host: int = 6,
    host_busy_us: float | None = None,
    host_self: list[tuple[str, int, float]] | None = None,
) -> dict:
    """Where a step's time goes, from ``(kernel name, calls, GPU microseconds)`` of a profiled run of `steps`
    steps (e.g. output tokens of a generate) that took `wall_s`: wall and GPU-busy ms per step (their gap is
    host time the GPU waited through, when kernels do not overlap) and the `top` kernels by GPU time, with
    their share. `host_calls` (``(CUDA runtime / driver call, calls, host microseconds)`` over the run) adds
    ``launches_per_step`` (calls per `launch_kind`: about one graph replay a step where a decode step replays a
    CUDA graph, none (every kernel launched by itself) where it runs eagerly) and ``top_host_calls``, the calls
    the host spent the most time in: a synchronization that waits out most of a step while the process's own
    kernels are short says the GPU (or the copy it waits for) was held up elsewhere; launch calls taking most
    of it say the host is slow to issue. `host_busy_us` and `host_self` (`Trace`) add
    ``host_busy_ms_per_step`` and ``top_host_self``, the busiest host thread's events by self time."""
    if steps < 1 or wall_s <= 0:
        raise ValueError(f"profile_summary: steps={steps}, wall_s={wall_s} must be positive")
    busy_us = sum(us for _, _, us in kernels)
    if busy_us <= 0:
        raise ValueError("profile_summary: no GPU kernel time was recorded (CUDA activity profiling unavailable?)")
    rows = sorted(kernels, key=lambda k: -k[2])[:top]
    out = {
        "steps": steps,
        "wall_ms_per_step": wall_s * 1e3 / steps,
        "gpu_busy_ms_per_step": busy_us / 1e3 / steps,
        "top_kernels": [
            {"name": n, "calls_per_step": c / steps, "gpu_us_per_step": us / steps, "share": us / busy_us}
            for n, c, us in rows
        ],
    }
    if host_calls is not None:
        launches = dict.fromkeys(LAUNCH_CALLS, 0)
        for name, calls, _ in host_calls:
            if (kind := launch_kind(name)) is not None:
                launches[kind] += calls
        out["launches_per_step"] = {kind: n / steps for kind, n in launches.items()}
        out["top_host_calls"] = [
            {"name": n, "calls_per_step": c / steps, "host_us_per_step": us / steps}
            for n, c, us in sorted(host_calls, key=lambda h: -h[2])[:top_host]
        ]
    if host_busy_us is not None:
        out["host_busy_ms_per_step"] = host_busy_us / 1e3 / steps
    if host_self is not None:
        out["top_host_self"] = [
            {"name": n, "calls_per_step": c / steps, "self_us_per_step": us / steps}
            for n, c, us in sorted(host_self, key=lambda h: -h[2])[:top]
        ]
    return out


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
    kernels, host_calls = [], []
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0:
            kernels.append((e.key, e.count, e.self_device_time_total))
        elif RUNTIME_CALL.match(e.key):
            host_calls.append((e.key, e.count, e.cpu_time_total))
    return profile_summary(kernels, wall_s=wall, steps=steps, top=top, host_calls=host_calls)


class Trace(NamedTuple):
    """What `read_trace` reads from a Chrome trace, in `profile_summary`'s terms."""

    kernels: list[tuple[str, int, float]]
    """``(name, calls, device microseconds)`` per kernel / memcpy / memset."""
    host_calls: list[tuple[str, int, float]]
    """``(name, calls, host microseconds)`` per CUDA runtime / driver call (`HOST_CALL_CATEGORIES`)."""
    host_busy_us: float
    """Microseconds the busiest host thread spent inside any recorded host event (`HOST_ACTIVITY_CATEGORIES`,
    nested events counted once). Without Python stacks in the trace only torch ops and CUDA calls are events,
    so the rest is Python work or idling; with them (``with_stack``) the rest is time outside Python."""
    host_self: list[tuple[str, int, float]]
    """``(name, calls, self microseconds)`` per host event of that thread, self time being its span less its
    nested events': with Python stacks, the functions the thread spent its time in (e.g. vLLM's message-queue
    read when a worker waits for its engine core's next step)."""


def _union_us(spans: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _self_us(spans: list[tuple[float, float, str]]) -> dict[str, list[float]]:
    """``name -> [calls, self microseconds]`` of one thread's ``(start, end, name)`` events: each event's span
    less the parts its nested events cover (an event reaching past its parent's end is clipped to it)."""
    out: dict[str, list[float]] = {}
    stack: list[list] = []  # [end, name, self]

    def close(item: list) -> None:
        calls_us = out.setdefault(item[1], [0, 0.0])
        calls_us[0] += 1
        calls_us[1] += item[2]

    for start, end, name in sorted(spans, key=lambda sp: (sp[0], -sp[1])):
        while stack and stack[-1][0] <= start:
            close(stack.pop())
        if stack:
            end = min(end, stack[-1][0])
            stack[-1][2] -= end - start
        stack.append([end, name, end - start])
    while stack:
        close(stack.pop())
    return out


def read_trace(path: str | Path) -> Trace:
    """What `profile_summary` takes (`Trace`), from one read of a torch.profiler Chrome trace (``.json`` or
    ``.json.gz``, as ``tensorboard_trace_handler`` writes it; e.g. a vLLM worker's, profiled by vLLM's own
    profiler). A trace without device events is refused: it was recorded without CUDA activity."""
    import gzip
    import json

    path = Path(path)
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    data = json.loads(raw)
    events = data.get("traceEvents") if isinstance(data, dict) else None
    if not isinstance(events, list):
        raise ValueError(f"{path}: no traceEvents list; not a torch.profiler Chrome trace")
    device: dict[str, list[float]] = {}
    host: dict[str, list[float]] = {}
    threads: dict[tuple, list[tuple[float, float, str]]] = {}
    for e in events:
        if e.get("ph") != "X":
            continue
        cat = e.get("cat")
        if cat in HOST_ACTIVITY_CATEGORIES:
            ts = float(e["ts"])
            threads.setdefault((e.get("pid"), e.get("tid")), []).append((ts, ts + float(e["dur"]), str(e["name"])))
        per = device if cat in DEVICE_EVENT_CATEGORIES else host if cat in HOST_CALL_CATEGORIES else None
        if per is not None:
            calls_us = per.setdefault(str(e["name"]), [0, 0.0])
            calls_us[0] += 1
            calls_us[1] += float(e["dur"])
    if not device:
        raise ValueError(f"{path}: no {'/'.join(DEVICE_EVENT_CATEGORIES)} events (recorded without CUDA activity?)")
    busy, spans = max(((_union_us([sp[:2] for sp in t]), t) for t in threads.values()), default=(0.0, []))
    return Trace(
        kernels=[(name, int(c), us) for name, (c, us) in device.items()],
        host_calls=[(name, int(c), us) for name, (c, us) in host.items()],
        host_busy_us=busy,
        host_self=[(name, int(c), us) for name, (c, us) in _self_us(spans).items()],
    )


def profile_host(fn: Callable[[], object], *, steps: int, top: int = 20) -> dict:
    """One call of `fn` (which runs `steps` steps) under cProfile: wall ms per step and the `top` Python
    functions by their own time (``tottime``: C calls such as kernel launches included, callees excluded), per
    step, with their share of the wall time. cProfile's own cost per Python call inflates the wall time (by
    ``profiled_wall_ms_per_step / wall_ms_per_step``, also recorded from an unprofiled call), so read the
    shares, not the absolute milliseconds. Only the calling thread is profiled. Warm `fn` up before."""
    import cProfile
    import pstats

    if steps < 1:
        raise ValueError(f"profile_host: steps={steps} must be positive")
    t0 = time.perf_counter()
    fn()
    wall = time.perf_counter() - t0
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.runcall(fn)
    profiled = time.perf_counter() - t0
    stats = pstats.Stats(prof).stats  # (file, line, function) -> (primitive calls, calls, tottime, cumtime, callers)
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return {
        "steps": steps,
        "wall_ms_per_step": wall * 1e3 / steps,
        "profiled_wall_ms_per_step": profiled * 1e3 / steps,
        "top_functions": [
            {
                "function": f"{Path(file).name}:{line}({name})" if line else name,
                "calls_per_step": calls / steps,
                "own_ms_per_step": tot * 1e3 / steps,
                "cum_ms_per_step": cum * 1e3 / steps,
                "share": tot / profiled,
            }
            for (file, line, name), (_, calls, tot, cum, _) in rows
        ],
    }


@contextmanager
def host_time() -> Iterator[dict]:
    """This process's host time over the ``with`` block, in the dict it yields once the block ends: ``wall_s``,
    ``cpu_s`` (every thread of the process), ``thread_cpu_s`` (the thread that runs the block: with a vLLM
    engine in other processes, the front-end's output handling of a generate), ``gc_s`` (the garbage collector's
    pauses, in any thread) and ``gc_collections`` (per generation 0, 1, 2). A block whose thread CPU is near its
    wall kept this process's thread busy throughout (it paced the block); one far below it mostly waited."""
    out: dict = {}
    pause = {"s": 0.0, "t0": 0.0, "n": [0, 0, 0]}

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            pause["t0"] = time.perf_counter()
        else:
            pause["s"] += time.perf_counter() - pause["t0"]
            pause["n"][info["generation"]] += 1

    gc.callbacks.append(on_gc)
    wall, cpu, thread = time.perf_counter(), time.process_time(), time.thread_time()
    try:
        yield out
    finally:
        out.update(
            wall_s=time.perf_counter() - wall,
            cpu_s=time.process_time() - cpu,
            thread_cpu_s=time.thread_time() - thread,
            gc_s=pause["s"],
            gc_collections=pause["n"],
        )
        gc.callbacks.remove(on_gc)


def worker_profiler_config(trace_dir: Path, python: bool = False) -> dict:
    """vLLM's ``profiler_config`` for `profile_worker`: torch.profiler in the model's processes, traces into
    `trace_dir`; with `python` also their Python calls (``with_stack``: the trace's ``python_function`` events,
    whose self times `profiling.read_trace` sums; the tracing slows the host, so the profiled wall time grows)."""
    return {"profiler": "torch", "torch_profiler_dir": str(trace_dir), "torch_profiler_with_stack": python}


def profile_worker(engine, generate, tokens: int, trace_dir: Path) -> dict:
    """`profile_summary` of one call of `generate` when the engine's model runs in another process:
    vLLM's own profiler (the engine was created with a ``profiler_config`` writing to `trace_dir`) records the
    worker meanwhile, the call is timed here, and the GPU time comes from the trace the worker wrote
    (`read_trace`; tensor-parallel rank 0's)."""
    before = set(trace_dir.glob("*.pt.trace.json*"))
    engine.llm.start_profile()
    t0 = time.perf_counter()
    generate()
    wall = time.perf_counter() - t0
    engine.llm.stop_profile()  # the workers write their traces before it returns
    traces = sorted(set(trace_dir.glob("*.pt.trace.json*")) - before)
    # vLLM names a worker's trace <prefix>_<rank suffix>.<time>.pt.trace.json.gz, the suffix ending in rank<global
    # rank> (dp0_pp0_tp0_dcp0_ep0_rank0), or rank<global rank> alone before the parallel state exists
    rank0 = [t for t in traces if t.name.split(".", 1)[0].split("_")[-1] == "rank0"]
    if not rank0:
        raise RuntimeError(f"vLLM's profiler wrote no rank-0 trace into {trace_dir} (new: {[t.name for t in traces]})")
    trace = read_trace(rank0[0])
    summary = profile_summary(
        trace.kernels,
        wall_s=wall,
        steps=tokens,
        host_calls=trace.host_calls,
        host_busy_us=trace.host_busy_us,
        host_self=trace.host_self,
    )
    return {"profiled_in": "vLLM worker (vLLM's profiler)", **summary}
