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
    with pytest.raises(ValueError, match="no GPU kernel time was recorded"):
        prof.profile_summary([], wall_s=1.0, steps=4)
