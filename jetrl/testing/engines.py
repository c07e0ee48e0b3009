"""How the GPU test suite starts vLLM engines side by side (``tests/conftest.py`` applies it to every
``vllm.LLM`` a test creates on CUDA)."""

from __future__ import annotations

from typing import Any

__all__ = ["GPU_ENGINE_SHARE", "GPU_ENGINE_KV_BYTES", "shared_gpu_engine_kwargs"]

GPU_ENGINE_SHARE = 0.08
"""GPU memory fraction a test's vLLM engine claims unless the test sets its own: GPU tests run under
``pytest -n 8`` on one GPU, and vLLM's default (0.92 of the device, checked against the free memory at
start-up) lets only the first engine start."""
GPU_ENGINE_KV_BYTES = 256 << 20
"""KV cache of a test's vLLM engine unless the test sizes it (``gpu_memory_utilization`` or
``kv_cache_memory_bytes``). A fixed size skips vLLM's memory profiling, which counts everything the pytest
process holds on the device against the share (at 8% the architecture tests of ``test_vllm_model``, run
serially on the H200 after the other tests of the file, found -2.7 to -9.4 GiB left for the KV cache) and,
under ``-n 8``, fails when another worker frees memory while it measures."""


def shared_gpu_engine_kwargs(kw: dict[str, Any]) -> dict[str, Any]:
    """`kw` of a test's ``vllm.LLM(...)`` on a shared GPU: a fixed KV cache unless the test sizes it, and a
    small share of the device (what vLLM checks is free at start-up) unless the test sets one."""
    out = dict(kw)
    if "gpu_memory_utilization" not in out and "kv_cache_memory_bytes" not in out:
        out["kv_cache_memory_bytes"] = GPU_ENGINE_KV_BYTES
    out.setdefault("gpu_memory_utilization", GPU_ENGINE_SHARE)
    return out
