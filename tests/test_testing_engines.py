"""The GPU suite's engine sizing (`jetrl.testing.engines`, applied by tests/conftest.py on CUDA)."""

from jetrl.testing.engines import GPU_ENGINE_KV_BYTES, GPU_ENGINE_SHARE, shared_gpu_engine_kwargs


def test_unsized_engines_get_a_fixed_kv_cache_and_a_small_share():
    kw = {"model": "m", "max_model_len": 64}
    out = shared_gpu_engine_kwargs(kw)
    assert out == {**kw, "kv_cache_memory_bytes": GPU_ENGINE_KV_BYTES, "gpu_memory_utilization": GPU_ENGINE_SHARE}
    assert kw == {"model": "m", "max_model_len": 64}  # the caller's dict is not changed


def test_a_test_that_sizes_its_engine_keeps_its_sizes():
    # a share of its own: vLLM profiles the memory as the test asked, no fixed KV cache is added
    assert shared_gpu_engine_kwargs({"gpu_memory_utilization": 0.3}) == {"gpu_memory_utilization": 0.3}
    # a KV size of its own: kept, and the start-up check asks for the small share, not vLLM's 0.92
    assert shared_gpu_engine_kwargs({"kv_cache_memory_bytes": 16 << 20}) == {
        "kv_cache_memory_bytes": 16 << 20,
        "gpu_memory_utilization": GPU_ENGINE_SHARE,
    }
