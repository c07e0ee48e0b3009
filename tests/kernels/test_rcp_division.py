"""The reciprocal-division variant of the kernels (``rcp=True``, `jetrl.kernels._runtime.e4m3_grid`).

``q = fma(fma(-q0, s, x), r, q0)`` with ``r = RN(1/s)`` once per group and ``q0 = RN(x*r)`` replaces
the per-element ``div.rn``. Claimed: the same e4m3 bytes as ``RN(x/s)`` everywhere, and the same fp32
quotient wherever ``|x/s| >= 2^-11`` (below that, only underflowed remainders differ, and both round
to an e4m3 zero of x's sign).

1. The arithmetic, emulated exactly in numpy (products of fp32 values are exact in float64; sums
   that may not be are rounded to fp32 through round-to-odd), over every finite bf16 value and random
   fp32 values against scales ``RN(max(amax, eps) / 448)`` spanning the fp32 range.
2. The kernels under the Triton interpreter (its ``fma`` rounds once): ``rcp=True`` against
   ``rcp=False`` (the per-element ``div.rn``) of the same call, bytes (through a correct cast of the
   pre-cast values) and scales.
3. On an sm_90 GPU, the compiled kernels bit for bit, ``rcp=True`` against ``rcp=False``, over the
   GPU shapes.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
from kernels_cases import DTYPES, GPU_SHAPES, INTERP_SHAPES, assert_bitwise, e4m3_bytes_of, make_input, run_interpreted

from jetrl.recipe import DEFAULT_EPS, E4M3_MAX
from jetrl.testing.numerics import has_sm90

# ---------------------------------------------------------------- 1. the arithmetic, exactly


def _rn32_of_sum(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """RN_fp32(a + b) for float64 a, b, exactly: TwoSum gives u + e = a + b, round-to-odd on u keeps
    the information a second rounding (float64 -> fp32, 53 >= 24 + 2 bits) needs."""
    u = a + b
    bv = u - a
    e = (a - (u - bv)) + (b - bv)
    inexact = e != 0
    bits = u.view(np.int64).copy()
    toward_zero = inexact & (np.signbit(e) != np.signbit(u)) & (u != 0)
    bits[toward_zero] -= 1  # u was rounded away from zero: step one float64 toward zero (truncation)
    bits[inexact] |= 1
    return bits.view(np.float64).astype(np.float32)


def _rcp_quotient(x: np.ndarray, s: np.ndarray) -> np.ndarray:
    """The kernel's RCP=True arithmetic on fp32 arrays (before the clamp)."""
    r = (np.float32(1.0) / s).astype(np.float32)  # div.rn: numpy's fp32 division is IEEE
    q0 = (x * r).astype(np.float32)
    rem = _rn32_of_sum(x.astype(np.float64), -(q0.astype(np.float64) * s.astype(np.float64)))  # fma(-q0, s, x)
    q = _rn32_of_sum(q0.astype(np.float64), rem.astype(np.float64) * r.astype(np.float64))  # fma(rem, r, q0)
    return np.where(x == 0, x, q)


def _e4m3(v: np.ndarray) -> np.ndarray:
    return np.clip(v, -E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def test_emulated_exactness_of_the_fma_correction():
    # the emulation itself: a sum that float64 cannot hold is still rounded once to fp32
    a, b = np.array([1.0]), np.array([2.0**-24 + 2.0**-70])  # 1 + just over half an fp32 ulp: 71 bits
    assert _rn32_of_sum(a, b)[0] == np.float32(1.0 + 2.0**-23)
    assert _rn32_of_sum(a, np.array([2.0**-24]))[0] == np.float32(1.0)  # a tie: to even
    rng = np.random.default_rng(0)
    bf16 = (np.arange(1 << 16, dtype=np.uint32) << 16).view(np.float32)
    bf16 = bf16[np.isfinite(bf16)]
    amax = np.concatenate([np.abs(rng.choice(bf16, 48)), np.exp(rng.uniform(-87, 87, 48))]).astype(np.float32)
    scales = (np.maximum(amax, np.float32(DEFAULT_EPS)) / np.float32(E4M3_MAX)).astype(np.float32)
    n_exact = n_bytes = 0
    for am, s in zip(amax, scales, strict=True):
        x = np.concatenate(
            [
                bf16[np.abs(bf16) <= am],  # every bf16 value the group can hold (subnormals and zeros too)
                (rng.uniform(-1, 1, 20000) * am).astype(np.float32),
                (am * (1 - rng.integers(0, 64, 500) * np.float32(2.0**-24))).astype(np.float32),  # near amax
            ]
        ).astype(np.float32)
        ref = (x / s).astype(np.float32)
        got = _rcp_quotient(x, np.full_like(x, s))
        big = np.abs(ref) >= np.float32(2.0**-11)
        assert np.array_equal(ref[big].view(np.uint32), got[big].view(np.uint32)), f"fp32 quotient differs, s={s!r}"
        assert np.array_equal(_e4m3(ref), _e4m3(got)), f"e4m3 bytes differ, s={s!r}"
        n_exact += int(big.sum())
        n_bytes += x.size
    assert n_exact > 1_000_000 and n_bytes > 2_000_000


# ---------------------------------------------------------------- 2. the kernels, interpreted

_KERNELS = (
    "quantize_1x128",
    "quantize_128x128",
    "transpose_quantize",
    "transpose_requantize",
    "rmsnorm_quant",
    "swiglu_quant",
)
_CASES = [(op, m, k, d, kind) for op in _KERNELS for (m, k) in INTERP_SHAPES for d in ("bf16", "fp32")
          for kind in ("zero-group", "wide-range")]  # fmt: skip


def _call(op: str, m: int, k: int, d: str, kind: str, rcp: bool, device="cpu"):
    """(module, launcher, args, kwargs) of one kernel call on test data; on CPU the last argument is the
    pre-cast fp32 buffer the kernel fills."""
    x = make_input(m, k, DTYPES[d], kind, seed=m + 3 * k, device=device)
    pre = [torch.empty((k, m) if op.startswith("transpose") else (m, k))] if device == "cpu" else []
    if op == "quantize_1x128":
        return "quantize_1x128", "launch_quantize_1x128", (x, "deepgemm", "t.x", *pre), {"rcp": rcp}
    if op == "quantize_128x128":
        return "quantize_128x128", "launch_quantize_128x128", (x, True, "t.w", *pre), {"rcp": rcp}
    if op == "transpose_quantize":
        return "transpose_quantize", "launch_transpose_quantize", (x, "t.x", *pre), {"rcp": rcp}
    if op == "transpose_requantize":
        from jetrl import quant

        q, s = quant.quantize_1x128(x.cpu())
        q, s = q.to(device), s.to(device)
        return "transpose_quantize", "launch_transpose_requantize", (q, s, "t.x", *pre), {"rcp": rcp}
    if op == "rmsnorm_quant":
        w = (1 + 0.1 * make_input(1, k, torch.float32, "randn", seed=k)[0]).to(DTYPES[d]).to(device)
        return "rmsnorm_quant", "launch_rmsnorm_quant", (x, w, 1e-6, "row", "t.x", *pre), {"rcp": rcp}
    up = make_input(m, k, DTYPES[d], "randn", seed=m * k, device=device)
    return "swiglu_quant", "launch_swiglu_quant", (x, up, "row", "t.h", *pre), {"rcp": rcp}


@pytest.fixture(scope="module")
def interp_results():
    calls = [_call(*case, rcp=rcp) for case in _CASES for rcp in (False, True)]
    return run_interpreted(calls)


@pytest.mark.parametrize("case", range(len(_CASES)), ids=["-".join(map(str, c)) for c in _CASES])
def test_interpreter_rcp_equals_default(interp_results, case):
    base, rcp = interp_results[2 * case], interp_results[2 * case + 1]
    ctx = str(_CASES[case])
    assert base["nonfinite"] is None and rcp["nonfinite"] is None, ctx
    assert_bitwise("bytes", e4m3_bytes_of(rcp["args"][-1]), e4m3_bytes_of(base["args"][-1]), ctx)
    outs_b, outs_r = base["out"], rcp["out"]
    for i, (b, r) in enumerate(zip(outs_b, outs_r, strict=True)):
        if b.dtype != torch.float8_e4m3fn:  # scales, rstd, the bf16 y / h outputs: bitwise too
            assert_bitwise(f"output {i}", r, b, ctx)


# ---------------------------------------------------------------- 3. the compiled kernels

gpu = pytest.mark.skipif(not has_sm90(), reason="needs an sm_90 GPU to run the compiled Triton kernels")


@gpu
@pytest.mark.parametrize("op", _KERNELS)
@pytest.mark.parametrize("m,k", GPU_SHAPES)
def test_gpu_rcp_equals_default(op, m, k):
    import importlib

    for d in DTYPES:
        for kind in ("randn", "zero-group", "wide-range"):
            module, fn, args, _ = _call(op, m, k, d, kind, rcp=False, device="cuda")
            launcher = getattr(importlib.import_module(f"jetrl.kernels.{module}"), fn)
            base = launcher(*args, rcp=False)
            got = launcher(*args, rcp=True)
            for i, (b, r) in enumerate(zip(base, got, strict=True)):
                assert_bitwise(f"{op} output {i}", r, b, f"{m=} {k=} {d} {kind}")
