"""Every launch config a launcher accepts (the defaults and each candidate `bench_kernels.py --sweep`
times, `<module>.SWEEP_CONFIGS`) gives the same numbers as the reference.

CPU (Triton interpreter, one subprocess for all calls): small shapes with partial groups and M not a
multiple of the tile; scales bitwise and the clamped pre-cast values bitwise via ml_dtypes' correct
e4m3 cast (the interpreter's own fp8 cast is wrong for a few % of values, NUMERICS.md section 3);
for quantize_128x128's transposed outputs, q_t equal to the transpose of the kernel's own q (both
transpose modes, fp32 and bf16 input). GPU (sm_90): bytes and scales bitwise for every config.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from kernels_cases import assert_bitwise, e4m3_bytes_of, make_input, run_interpreted

import jetrl.kernels as K
from jetrl import quant
from jetrl.testing.numerics import has_sm90

q1, q128, rq, tq = (
    importlib.import_module(f"jetrl.kernels.{m}")
    for m in ("quantize_1x128", "quantize_128x128", "rmsnorm_quant", "transpose_quantize")
)

EPS = 1e-6

# (kernel, config, shape, dtype, extra) - every sweep candidate on small hostile shapes
_Q1 = [
    ("quantize_1x128", cfg, shape, torch.bfloat16, lay)
    for i, cfg in enumerate(q1.SWEEP_CONFIGS + [dict(block_m=16, groups_k=2, num_warps=4, persistent=True)])
    for shape, lay in (((13, 300), "row"), ((130, 1000), "deepgemm"))
    if not (i % 2 and shape == (130, 1000))  # big shape for half the configs: keeps the CPU time low
]
_Q128 = [
    ("quantize_128x128", dict(cfg, transpose=mode), (130, 257), dtype, None)
    for cfg in q128.SWEEP_CONFIGS + [dict(chunk_n=16, num_warps=4)]
    for mode, dtype in (("fused", torch.float32), ("fused", torch.bfloat16), ("separate", torch.float32))
]
_TQ = [
    (kernel, cfg, shape, torch.bfloat16, None)
    for cfg in tq.SWEEP_CONFIGS
    for kernel, shape in (("transpose_quantize", (300, 129)), ("transpose_requantize", (13, 300)))
]
_RQ = [
    ("rmsnorm_quant", cfg, shape, torch.float16, "deepgemm")
    for cfg in rq.SWEEP_CONFIGS + [dict(block_m=4, block_k=256, num_warps=4)]
    for shape in ((3, 1000), (5, 5000))
]
CASES = _Q1 + _Q128 + _TQ + _RQ


def _ids():
    return [f"{c[0]}-{'-'.join(f'{k}{v}' for k, v in c[1].items())}-{c[2][0]}x{c[2][1]}-{c[3]}" for c in CASES]


def _call(kernel, cfg, shape, dtype, extra, device="cpu", precast=True):
    """(module, function, args, kwargs) of one launcher call."""
    m, k = shape
    x = make_input(m, k, dtype, "wide-range" if kernel != "rmsnorm_quant" else "randn", seed=m + k, device=device)
    pre = (lambda a, b: torch.empty(a, b, device=device)) if precast else (lambda a, b: None)
    if kernel == "quantize_1x128":
        return "quantize_1x128", "launch_quantize_1x128", (x, extra, "t.x", pre(m, k)), cfg
    if kernel == "quantize_128x128":
        return "quantize_128x128", "launch_quantize_128x128", (x, True, "t.w", pre(m, k)), cfg
    if kernel == "transpose_quantize":
        return "transpose_quantize", "launch_transpose_quantize", (x, "t.x", pre(k, m)), cfg
    if kernel == "transpose_requantize":
        qx, sx = quant.quantize_1x128(x)
        return "transpose_quantize", "launch_transpose_requantize", (qx, sx, "t.x", pre(k, m)), cfg
    w = (1 + 0.1 * torch.randn(k, generator=torch.Generator().manual_seed(k))).to(dtype).to(device)
    return "rmsnorm_quant", "launch_rmsnorm_quant", (x, w, EPS, extra, "t.x", pre(m, k)), cfg


def _check(kernel, args, out, ctx, exact_bytes):
    """Compare one call's outputs with the reference; bytes from the pre-cast buffer on CPU."""
    if kernel == "quantize_1x128":
        x, pre = args[0], args[3]
        q_ref, s_ref = quant.quantize_1x128(x.cpu())
        q, s = out
    elif kernel == "quantize_128x128":
        x, pre = args[0], args[3]
        q_ref, s_ref = quant.quantize_128x128(x.cpu())
        q, s, q_t, s_t = out
        assert_bitwise("s_t", s_t, s_ref.t().contiguous(), ctx)
        assert_bitwise("q_t is q.t()", q_t, q.t().contiguous(), ctx)
    elif kernel == "transpose_quantize":
        x, pre = args[0], args[2]
        q_ref, s_ref = quant.quantize_128x1(x.cpu())
        q, s = out
    elif kernel == "transpose_requantize":
        pre = args[3]
        q_ref, s_ref = quant.quantize_128x1(quant.dequantize_1x128(args[0].cpu(), args[1].cpu(), torch.float32))
        q, s = out
    else:
        x, w, pre = args[0], args[1], args[5]
        y, q, s, rstd = out
        _, _, _, rstd_ref = K.torch_rmsnorm_quant(x.cpu(), w.cpu(), EPS)
        torch.testing.assert_close(rstd.cpu(), rstd_ref, rtol=1e-6, atol=0, msg=lambda m_: f"rstd {ctx}: {m_}")
        y_want = (w * (x.float() * rstd[:, None]).to(x.dtype)).to(x.dtype)  # HF formula, the kernel's rstd
        assert_bitwise("y", y.float(), y_want.float(), ctx)
        q_ref, s_ref = quant.quantize_1x128(y.cpu())
    assert_bitwise("scales", s, s_ref, ctx)
    if exact_bytes:
        assert_bitwise("bytes", q, q_ref, ctx)
    else:
        assert_bitwise("bytes(ml_dtypes cast of pre-cast)", e4m3_bytes_of(pre), q_ref.view(torch.uint8), ctx)


@pytest.fixture(scope="module")
def interp_results():
    return run_interpreted([_call(*c) for c in CASES])


@pytest.mark.parametrize("case", range(len(CASES)), ids=_ids())
def test_interpreter_config(interp_results, case):
    kernel, cfg, shape, dtype, extra = CASES[case]
    r = interp_results[case]
    assert r["nonfinite"] is None
    _check(kernel, r["args"], r["out"], f"{kernel} {cfg} {shape} {dtype} {extra}", exact_bytes=False)


def test_default_configs_are_valid():
    """The shape -> config functions give tiles the kernels accept, at the benchmark and edge shapes."""
    for m, k in [(1, 72), (13, 300), (4096, 4096), (16384, 14336), (4095, 5120), (7, 20000)]:
        bm, gk, nw, _, _ = q1.default_config(m, k)
        assert bm & (bm - 1) == 0 and gk & (gk - 1) == 0 and nw in (4, 8), (m, k)
        cn, nw, _ = q128.default_config(m, k)
        assert 128 % cn == 0 and nw in (4, 8, 16), (m, k)
        gm, bk, nw, _ = tq.default_config(m, k)
        assert 128 % bk == 0 and gm & (gm - 1) == 0, (m, k)
        bm, bk, nw, _ = rq.default_config(m, k)
        assert bk & (bk - 1) == 0 and bk >= 128 and 4 <= nw <= 32, (m, k)
        assert bk >= k or k > rq.MAX_SINGLE_K, f"{m=} {k=}: rows up to MAX_SINGLE_K are held in registers"


gpu = pytest.mark.skipif(not has_sm90(), reason="needs an sm_90 GPU to run the compiled Triton kernels")


@gpu
@pytest.mark.parametrize("case", range(len(CASES)), ids=_ids())
@pytest.mark.parametrize("shape", [None, (257, 4096 + 200)], ids=["small", "M257-K4296"])
def test_gpu_config_bitwise(case, shape):
    kernel, cfg, small, dtype, extra = CASES[case]
    args_ = _call(kernel, cfg, shape or small, dtype, extra, device="cuda", precast=False)
    module, fn, args, kwargs = args_
    out = getattr(importlib.import_module(f"jetrl.kernels.{module}"), fn)(*args, **kwargs)
    _check(kernel, args, out, f"{kernel} {cfg} {shape or small} {dtype} {extra}", exact_bytes=True)
    if kernel == "quantize_128x128":
        q_ref, _ = quant.quantize_128x128(args[0].cpu())
        assert_bitwise("q_t", out[2], q_ref.t().contiguous(), f"{cfg} {dtype}")
    K.check_nonfinite()
