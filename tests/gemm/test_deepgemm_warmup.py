"""DeepGEMM's JIT: the warm-up (`jetrl.gemm.deepgemm.warmup_rows`, `DeepGemmBackend.warm_up`), the row counts it
runs and, on an sm_90 GPU, that after it no row count up to the bound compiles anything new; and what wgrad's
``compiled_dims`` passes on."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from jetrl.gemm.deepgemm import DeepGemmBackend, warmup_rows


def test_warmup_rows_take_both_ends_of_every_16_row_interval():
    rows = warmup_rows(100)
    assert rows == sorted(set(rows)) and rows[0] == 1 and rows[-1] == 100
    assert set(range(1, 18)) <= set(rows)
    for top in range(32, 100, 16):  # interval (top - 16, top]: both its ends
        assert {top - 15, top} <= set(rows), top
    assert not {m for m in rows if 17 < m < 100 and m % 16 not in (0, 1)}
    assert warmup_rows(1) == [1] and warmup_rows(16384)[-2:] == [16369, 16384]
    for bad in (0, -3, 2.0, True, None):
        with pytest.raises(ValueError, match="max_rows must be a positive int"):
            warmup_rows(bad)


_SWEEP = textwrap.dedent(
    """
    import os, sys, torch
    from jetrl.gemm.deepgemm import DeepGemmBackend
    from jetrl.quant import FP8_DTYPE

    def compiled():
        return sum(len(files) for _, _, files in os.walk(os.environ["DG_JIT_CACHE_DIR"]))

    n, k, max_rows = (int(v) for v in sys.argv[1:4])
    be = DeepGemmBackend()
    be.warm_up(n, k, max_rows, "cuda")
    after_warm_up = compiled()
    a = torch.zeros((max_rows, k), dtype=FP8_DTYPE, device="cuda")
    a_s = torch.ones((max_rows, k // 128), device="cuda")
    b = torch.zeros((n, k), dtype=FP8_DTYPE, device="cuda")
    b_s = torch.ones((n // 128, k // 128), device="cuda")
    for m in range(1, max_rows + 1):
        be.gemm(a[:m], a_s[:m], b, b_s, role="fprop")
    torch.cuda.synchronize()
    print(after_warm_up, compiled())
    """
)


@pytest.mark.skipif(DeepGemmBackend.unavailable_reason() is not None, reason="needs DeepGEMM on an sm_90 GPU")
@pytest.mark.parametrize(("n", "k"), [(1536, 512), (28672, 256)])
def test_after_the_warm_up_no_row_count_compiles_a_new_kernel(tmp_path, n, k):
    """Every ``m`` in 1..1024 after `warm_up(n, k, 1024)`: DeepGEMM's JIT cache (a fresh folder, so nothing
    else compiles into it) holds no new file. A fresh process, so the in-memory cache starts empty too."""
    env = {**os.environ, "DG_JIT_CACHE_DIR": str(tmp_path / "dg")}
    out = subprocess.run(
        [sys.executable, "-c", _SWEEP, str(n), str(k), "1024"], env=env, capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    after_warm_up, after_sweep = (int(v) for v in out.stdout.split()[-2:])
    assert after_warm_up > 0, "the warm-up compiled nothing: is DG_JIT_CACHE_DIR where DeepGEMM writes?"
    assert after_sweep == after_warm_up, f"{after_sweep - after_warm_up} files compiled after the warm-up"


def test_wgrad_passes_its_compiled_dims_to_deepgemm():
    """``wgrad_compiled_dims`` reaches every wgrad call: ``"mn"`` by default (the token count a runtime
    argument: `deepgemm-jit-nvidia-h100.json` measured the same bits and speed as DeepGEMM's default ``"nk"``,
    which compiled a kernel per count), ``"nk"`` when set; anything else is refused before any call. A stand-in
    for DeepGEMM records the calls (the backend itself needs an sm_90 GPU)."""
    import torch

    from jetrl.quant import FP8_DTYPE

    calls = []
    be = DeepGemmBackend.__new__(DeepGemmBackend)  # no GPU here: skip __init__'s availability check
    be.dg = type("DG", (), {"fp8_gemm_nt": staticmethod(lambda *a, **kw: calls.append(kw))})()
    be.device_type = "any"  # CPU tensors reach the stand-in
    a, b = torch.zeros((256, 128), dtype=FP8_DTYPE), torch.zeros((128, 128), dtype=FP8_DTYPE)
    a_s, b_s = torch.ones((256, 1)), torch.ones((128, 1))
    acc = torch.zeros((256, 128))
    be.gemm_accumulate_(a, a_s, b, b_s, acc)
    be.gemm(a, a_s, b, b_s, role="wgrad", out_dtype=torch.float32)
    be.wgrad_compiled_dims = "nk"
    be.gemm_accumulate_(a, a_s, b, b_s, acc)
    assert [sorted(kw.items()) for kw in calls] == [
        [("c", acc), ("compiled_dims", "mn"), ("recipe", (1, 1, 128))],
        [("c", calls[1]["c"]), ("compiled_dims", "mn"), ("recipe", (1, 1, 128))],
        [("c", acc), ("compiled_dims", "nk"), ("recipe", (1, 1, 128))],
    ]
    be.wgrad_compiled_dims = "k"
    with pytest.raises(ValueError, match="wgrad_compiled_dims must be 'nk' or 'mn', got 'k'"):
        be.gemm_accumulate_(a, a_s, b, b_s, acc)
    assert len(calls) == 3
