"""scripts/profiling.py's summary of a profiled run (the profiling itself needs CUDA: bench_rollout / bench_e2e on
the GPU)."""

from __future__ import annotations

import pytest
from scripts_cases import load_script


def test_profile_summary_per_step_and_top_kernels():
    prof = load_script("profiling")
    kernels = [("gemm", 640, 6400.0), ("quant", 640, 1600.0), ("sampler", 64, 2000.0)]
    s = prof.profile_summary(kernels, wall_s=1.28, steps=64, top=2)
    assert s["wall_ms_per_step"] == 20.0 and s["gpu_busy_ms_per_step"] == 10000.0 / 1e3 / 64
    assert [k["name"] for k in s["top_kernels"]] == ["gemm", "sampler"]  # by GPU time, cut to `top`
    assert s["top_kernels"][0] == {"name": "gemm", "calls_per_step": 10.0, "gpu_us_per_step": 100.0, "share": 0.64}
    assert "launches_per_step" not in s
    with pytest.raises(ValueError, match="no GPU kernel time was recorded"):
        prof.profile_summary([], wall_s=1.0, steps=4)


def test_host_calls_tell_graph_replays_from_eager_launches_and_name_the_longest_wait():
    prof = load_script("profiling")
    calls = [
        ("cudaGraphLaunch", 64, 640.0),
        ("cudaLaunchKernel", 128, 256.0),
        ("cuLaunchKernelEx", 64, 64.0),
        ("cudaStreamSynchronize", 64, 64000.0),
        ("cudaMemcpyAsync", 64, 128.0),
    ]
    s = prof.profile_summary([("gemm", 64, 640.0)], wall_s=1.0, steps=64, host_calls=calls, top_host=2)
    assert s["launches_per_step"] == {"graph": 1.0, "kernel": 3.0}
    assert s["top_host_calls"] == [
        {"name": "cudaStreamSynchronize", "calls_per_step": 1.0, "host_us_per_step": 1000.0},
        {"name": "cudaGraphLaunch", "calls_per_step": 1.0, "host_us_per_step": 10.0},
    ]
    empty = prof.profile_summary([("g", 1, 1.0)], wall_s=1.0, steps=2, host_calls=[])
    assert empty["launches_per_step"] == {"graph": 0.0, "kernel": 0.0} and empty["top_host_calls"] == []
    for name in ("cudaStreamSynchronize", "cuLaunchKernel", "cudaGraphLaunch_v10000"):
        assert prof.RUNTIME_CALL.match(name), name
    for name in ("aten::mm", "cutlass::gemm", "custom_op", "execute_context_0(0)_generation_256(256)"):
        assert not prof.RUNTIME_CALL.match(name), name
    graph = ("cudaGraphLaunch", "cudaGraphLaunch_v10000", "cuGraphLaunch")
    kernel = ("cudaLaunchKernel", "cudaLaunchKernelExC_v11060", "cuLaunchKernel", "cuLaunchKernelEx")
    assert {prof.launch_kind(n) for n in graph} == {"graph"} and {prof.launch_kind(n) for n in kernel} == {"kernel"}
    for other in ("cudaMemcpyAsync", "cudaStreamSynchronize", "aten::mm", "cudaGraphInstantiate", "cuLaunchHostFunc"):
        assert prof.launch_kind(other) is None, other


def test_profile_host_names_the_function_that_spends_the_host_time():
    import time

    prof = load_script("profiling")

    def busy(s: float) -> None:
        t = time.perf_counter()
        while time.perf_counter() - t < s:
            pass

    def step_loop() -> None:
        for _ in range(4):
            busy(0.004)

    s = prof.profile_host(step_loop, steps=4, top=3)
    assert s["steps"] == 4 and s["wall_ms_per_step"] >= 4.0 and s["profiled_wall_ms_per_step"] >= 4.0
    top = s["top_functions"]
    assert len(top) == 3 and top[0]["own_ms_per_step"] >= top[1]["own_ms_per_step"]
    busy_row = next(r for r in top if r["function"].endswith("(busy)"))
    assert busy_row["calls_per_step"] == 1.0 and busy_row["cum_ms_per_step"] >= 4.0
    assert "test_profiling.py:" in busy_row["function"]
    with pytest.raises(ValueError, match="steps=0"):
        prof.profile_host(step_loop, steps=0)


def test_host_busy_time_counts_nested_and_overlapping_events_once():
    prof = load_script("profiling")
    assert prof._union_us([(20.0, 30.0), (0.0, 10.0), (5.0, 15.0), (6.0, 7.0)]) == 25.0
    assert prof._union_us([]) == 0.0
    s = prof.profile_summary([("g", 4, 4.0)], wall_s=0.004, steps=4, host_busy_us=1000.0)
    assert s["host_busy_ms_per_step"] == 0.25 and s["wall_ms_per_step"] == 1.0


def test_self_time_is_an_events_span_less_its_nested_events():
    prof = load_script("profiling")
    spans = [(0.0, 100.0, "a"), (10.0, 30.0, "b"), (20.0, 25.0, "c"), (90.0, 120.0, "d"), (200.0, 210.0, "b")]
    # b and c nest in a, c in b; d outlives a and is clipped to a's end; the second b is a root of its own
    assert prof._self_us(spans) == {"a": [1, 70.0], "b": [2, 25.0], "c": [1, 5.0], "d": [1, 10.0]}
    s = prof.profile_summary([("g", 1, 1.0)], wall_s=0.001, steps=2, host_self=[("a", 2, 70.0), ("b", 4, 25.0)], top=1)
    assert s["top_host_self"] == [{"name": "a", "calls_per_step": 1.0, "self_us_per_step": 35.0}]


def test_host_time_counts_the_blocks_cpu_and_the_collectors_pauses():
    """host_time: the calling thread's CPU apart from the process's, and every collection's pause while the block
    ran; busy work shows CPU near the wall, a sleep none, and its callback leaves with the block."""
    import gc
    import time

    prof = load_script("profiling")
    callbacks = len(gc.callbacks)
    with prof.host_time() as busy:
        t = time.perf_counter()
        while time.perf_counter() - t < 0.2:
            pass
        gc.collect()
    assert busy["thread_cpu_s"] > 0.5 * busy["wall_s"] and busy["cpu_s"] > busy["thread_cpu_s"] - 1e-3
    assert busy["gc_collections"][2] >= 1 and busy["gc_s"] > 0
    with prof.host_time() as idle:
        time.sleep(0.2)
    assert idle["wall_s"] >= 0.2 and idle["thread_cpu_s"] < 0.5 * idle["wall_s"]
    assert idle["gc_collections"] == [0, 0, 0] and idle["gc_s"] == 0.0
    assert len(gc.callbacks) == callbacks
