"""Tuning options of the kernel launchers change speed, never a byte.

`scripts/bench_kernels.py --sweep` picks the defaults by timing these options on the H200; whichever it
picks must give the same outputs. Each case runs a launcher with its defaults and with the other
values of its options (program order, tile shape, warps, the in-register transpose, a block held in
registers, quantize_128x128's q_t stored by its own kernel or by the byte transpose): under the Triton
interpreter on small hostile shapes (every output, and the bytes through
a correct cast of the pre-cast values) and, on an sm_90 GPU, compiled, bit for bit, over shapes that
mix real dims with partial groups. `rcp` has its own file (`test_rcp_division.py`).

RMSNorm's ``block_m`` / ``block_k`` / ``num_warps`` are different: they change the fp32 reduction
order of the variance, so y may move by an ulp. For them the test checks what the contract says:
``(q, s)`` are bit-equal to `quantize_1x128` of the kernel's own y, and y is within ulps of HF.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from kernels_cases import (
    DTYPES,
    assert_bitwise,
    assert_close_ulps,
    e4m3_bytes_of,
    launch,
    launcher,
    make_input,
    run_interpreted,
)

from jetrl import quant
from jetrl.testing.numerics import has_sm90

# options to try against each launcher's defaults
_OPTIONS = {
    "quantize_1x128": [{"g_fastest": False}, {"block_m": 16, "num_warps": 8}, {"block_m": 128, "g_fastest": False}],
    "transpose_quantize": [
        {"k_fastest": True},
        {"trans": True},
        {"block_k": 32, "num_warps": 4},
        {"block_k": 128, "trans": True},
    ],
    "transpose_requantize": [{"k_fastest": True}, {"trans": True}],
    "quantize_128x128": [
        {"chunk_n": 128},
        {"chunk_n": 32, "num_warps": 8},
        {"chunk_n": 16, "num_warps": 4},
        {"fused_t": False, "t_block": 32, "t_warps": 2},
        {"k_fastest": True, "num_warps": 16},
        {"k_fastest": False, "chunk_n": 128},
    ],
    "swiglu_quant": [{"block_m": 8}, {"block_m": 64, "num_warps": 8}],
}
_SHAPES_CPU = [(13, 300), (130, 257)]
_SHAPES_GPU = [(4095, 5120), (257, 14336), (13, 200), (129, 1000)]


def _args(op: str, m: int, k: int, d: str, device: str, precast: bool):
    x = make_input(m, k, DTYPES[d], "wide-range", seed=m + k, device=device)
    # NaN-filled: a lane a launch leaves unwritten reads as e4m3 NaN, never as a byte it should have written
    pre = [torch.full((k, m) if op.startswith("transpose") else (m, k), float("nan"))] if precast else []
    if op == "quantize_1x128":
        return (x, "deepgemm", "t.x", *pre)
    if op == "transpose_quantize":
        return (x, "t.x", *pre)
    if op == "transpose_requantize":
        q, s = quant.quantize_1x128(x.cpu())
        return (q.to(device), s.to(device), "t.x", *pre)
    if op == "quantize_128x128":
        return (x, True, "t.w", *pre)
    up = make_input(m, k, DTYPES[d], "randn", seed=k, device=device)
    return (x, up, "row", "t.h", *pre)


_CASES = [
    (op, i, m, k, d)
    for op, opts in _OPTIONS.items()
    for i in range(len(opts))
    for (m, k) in _SHAPES_CPU
    for d in ("bf16", "fp32")
]


# the default launches the cases compare against: one per (op, shape, dtype), shared by that op's options
_BASES = list(dict.fromkeys((op, m, k, d) for op, _, m, k, d in _CASES))


@pytest.fixture(scope="module")
def interp_results():
    """Per case, (the default launch, the launch with the option). Every call gets its own arguments:
    a pre-cast buffer shared by two calls would hold only the second one's values when compared."""
    calls = [(*launcher(op), _args(op, m, k, d, "cpu", precast=True), {}) for op, m, k, d in _BASES]
    calls += [(*launcher(op), _args(op, m, k, d, "cpu", precast=True), _OPTIONS[op][i]) for op, i, m, k, d in _CASES]
    results = run_interpreted(calls)
    base = dict(zip(_BASES, results[: len(_BASES)], strict=True))
    return [(base[op, m, k, d], got) for (op, _, m, k, d), got in zip(_CASES, results[len(_BASES) :], strict=True)]


@pytest.mark.parametrize("case", range(len(_CASES)), ids=["-".join(map(str, c)) for c in _CASES])
def test_interpreter_option_changes_no_byte(interp_results, case):
    op, i, m, k, d = _CASES[case]
    base, got = interp_results[case]
    ctx = f"{op} {_OPTIONS[op][i]} {m=} {k=} {d}"
    assert base["nonfinite"] is None and got["nonfinite"] is None, ctx
    assert_bitwise("bytes", e4m3_bytes_of(got["args"][-1]), e4m3_bytes_of(base["args"][-1]), ctx)
    for j, (b, g) in enumerate(zip(base["out"], got["out"], strict=True)):
        if b.dtype != torch.float8_e4m3fn:  # the interpreter's own fp8 cast is not trusted
            assert_bitwise(f"output {j}", g, b, ctx)


gpu = pytest.mark.skipif(not has_sm90(), reason="needs an sm_90 GPU to run the compiled Triton kernels")


@gpu
@pytest.mark.parametrize("op", list(_OPTIONS))
@pytest.mark.parametrize("m,k", _SHAPES_GPU)
def test_gpu_option_changes_no_byte(op, m, k):
    for d in DTYPES:
        args = _args(op, m, k, d, "cuda", precast=False)
        base = launch(op, *args)
        for opt in _OPTIONS[op]:
            for j, (b, g) in enumerate(zip(base, launch(op, *args, **opt), strict=True)):
                assert_bitwise(f"{op} output {j}", g, b, f"{opt} {m=} {k=} {d}")


_RMS_CONFIGS = [{"block_k": 128}, {"block_m": 2, "block_k": 256, "num_warps": 8}, {"block_k": 512, "num_warps": 2}]


def _rms_check(x, w, out, ctx):
    y, q, s, rstd = out
    y_hf = (w * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)).to(x.dtype)
    assert_close_ulps("y", y.cpu(), y_hf.cpu(), 8.0 if x.dtype == torch.float32 else 3.0, ctx)
    q_ref, s_ref = quant.quantize_1x128(y.cpu())
    assert_bitwise("scales", s, s_ref, ctx)
    return q_ref


@pytest.fixture(scope="module")
def rms_interp():
    calls = []
    for cfg in _RMS_CONFIGS:
        for m, k in _SHAPES_CPU:
            x = make_input(m, k, torch.float32, "randn", seed=k)
            w = 1 + 0.1 * make_input(1, k, torch.float32, "randn", seed=1)[0]
            calls.append(("rmsnorm_quant", "launch_rmsnorm_quant", (x, w, 1e-6, "row", "t.x", torch.empty(m, k)), cfg))
    return run_interpreted(calls)


@pytest.mark.parametrize("i", range(len(_RMS_CONFIGS) * len(_SHAPES_CPU)))
def test_interpreter_rmsnorm_configs_keep_the_contract(rms_interp, i):
    r = rms_interp[i]
    x, w, *_, pre = r["args"]
    ctx = f"{_RMS_CONFIGS[i // len(_SHAPES_CPU)]} {tuple(x.shape)}"
    q_ref = _rms_check(x, w, r["out"], ctx)
    assert_bitwise("bytes (ml_dtypes cast of pre-cast)", e4m3_bytes_of(pre), q_ref.view(torch.uint8), ctx)


@gpu
@pytest.mark.parametrize("m,k", _SHAPES_GPU)
def test_gpu_rmsnorm_configs_keep_the_contract(m, k):
    from jetrl.kernels.rmsnorm_quant import launch_rmsnorm_quant

    for d, dtype in DTYPES.items():
        x = make_input(m, k, dtype, "randn", seed=k, device="cuda")
        w = (1 + 0.1 * make_input(1, k, torch.float32, "randn", seed=1)[0]).to(dtype).cuda()
        for cfg in [{}, *_RMS_CONFIGS, {"block_k": 16384, "num_warps": 16}]:
            out = launch_rmsnorm_quant(x, w, 1e-6, **cfg)
            q_ref = _rms_check(x, w, out, f"{cfg} {m=} {k=} {d}")
            assert_bitwise("bytes", out[1], q_ref, f"{cfg} {m=} {k=} {d}")


# The producers' value-less launches (the rollout engine's: `jetrl.rollout.vllm_model`) write every other output
# as the default launch does: (launcher, the option, the index of the output left unwritten).
_STORELESS = [
    ("swiglu_quant", "launch_swiglu_quant", "store_h", 0),
    ("rmsnorm_quant", "launch_rmsnorm_quant", "store_y", 0),
    ("rmsnorm_quant", "launch_add_rmsnorm_quant", "store_y", 0),
]


def _storeless_args(fn: str, m: int, k: int, dtype: torch.dtype, device: str, precast: bool) -> tuple:
    x = make_input(m, k, dtype, "wide-range", seed=m + k, device=device)
    other = make_input(m, k, dtype, "randn", seed=k, device=device)
    pre = (torch.full((m, k), float("nan")),) if precast else ()  # NaN: see `_args`
    if fn == "launch_swiglu_quant":
        return (x, other, "deepgemm", "t.h", *pre)
    w = (1 + 0.1 * make_input(1, k, torch.float32, "randn", seed=1)[0]).to(dtype).to(device)
    if fn == "launch_rmsnorm_quant":
        return (x, w, 1e-6, "deepgemm", "t.x", *pre)
    return (x, other, w, 1e-6, "deepgemm", "t.x", *pre)


def _assert_same_but_unwritten(base, got, skip: int, ctx: str, fp8_trusted: bool) -> None:
    assert base[skip] is not None and got[skip] is None, f"{ctx}: output {skip} must be None when not stored"
    for j, (b, g) in enumerate(zip(base, got, strict=True)):
        if j != skip and (fp8_trusted or b.dtype != torch.float8_e4m3fn):
            assert_bitwise(f"output {j}", g, b, ctx)


_STORELESS_CASES = [(i, m, k) for i in range(len(_STORELESS)) for (m, k) in _SHAPES_CPU]


@pytest.fixture(scope="module")
def storeless_interp():
    calls = []
    for i, m, k in _STORELESS_CASES:
        module, fn, opt, _ = _STORELESS[i]
        for kwargs in ({}, {opt: False}):  # each call its own pre-cast buffer (see `interp_results`)
            calls.append((module, fn, _storeless_args(fn, m, k, torch.float32, "cpu", precast=True), kwargs))
    return run_interpreted(calls)


@pytest.mark.parametrize(
    "case", range(len(_STORELESS_CASES)), ids=[f"{_STORELESS[i][1]}-{m}x{k}" for i, m, k in _STORELESS_CASES]
)
def test_interpreter_storeless_launch_writes_the_same_bytes(storeless_interp, case):
    i, m, k = _STORELESS_CASES[case]
    _, fn, opt, skip = _STORELESS[i]
    base, got = storeless_interp[2 * case], storeless_interp[2 * case + 1]
    ctx = f"{fn} {opt}=False {m=} {k=}"
    assert base["nonfinite"] is None and got["nonfinite"] is None, ctx
    assert_bitwise("bytes", e4m3_bytes_of(got["args"][-1]), e4m3_bytes_of(base["args"][-1]), ctx)
    _assert_same_but_unwritten(base["out"], got["out"], skip, ctx, fp8_trusted=False)


@gpu
@pytest.mark.parametrize("i", range(len(_STORELESS)), ids=[s[1] for s in _STORELESS])
@pytest.mark.parametrize("m,k", _SHAPES_GPU)
def test_gpu_storeless_launch_writes_the_same_bytes(i, m, k):
    module, fn, opt, skip = _STORELESS[i]
    for d, dtype in DTYPES.items():
        args = _storeless_args(fn, m, k, dtype, "cuda", precast=False)
        base, got = _call(module, fn, args, {}), _call(module, fn, args, {opt: False})
        _assert_same_but_unwritten(base, got, skip, f"{fn} {opt}=False {m=} {k=} {d}", fp8_trusted=True)


def _call(module: str, fn: str, args: tuple, kwargs: dict):
    return getattr(importlib.import_module(f"jetrl.kernels.{module}"), fn)(*args, **kwargs)


# `live` rows (the rollout engine passes vLLM's slot mapping, -1 on CUDA-graph padding): rows whose entry is < 0
# set no non-finite flag, the others still do, and every byte is the default launch's.
_LIVE = [
    ("quantize_1x128", "launch_quantize_1x128"),
    ("swiglu_quant", "launch_swiglu_quant"),
    ("rmsnorm_quant", "launch_rmsnorm_quant"),
    ("rmsnorm_quant", "launch_add_rmsnorm_quant"),
]
_LIVE_M, _LIVE_K = 70, 300  # rows over two row blocks of every launcher's default tile
_NAN_ROWS = (3, 69)


def _live_args(fn: str, device: str) -> tuple:
    """A launcher's args whose input holds NaN / Inf in rows `_NAN_ROWS`."""
    if fn == "launch_quantize_1x128":
        x, *rest = make_input(_LIVE_M, _LIVE_K, torch.float32, "randn", seed=5, device=device), "deepgemm", "t.x"
    else:
        x, *rest = _storeless_args(fn, _LIVE_M, _LIVE_K, torch.float32, device, precast=False)
    x[_NAN_ROWS[0], 7], x[_NAN_ROWS[1], 290] = float("nan"), float("inf")
    return (x, *rest)


def _live(device: str, dead: tuple[int, ...]) -> torch.Tensor:
    live = torch.arange(_LIVE_M, dtype=torch.int64, device=device)
    live[list(dead)] = -1
    return live


@pytest.fixture(scope="module")
def live_interp():
    calls = []
    for module, fn in _LIVE:
        args = _live_args(fn, "cpu")
        calls += [
            (module, fn, args, {}),
            (module, fn, args, {"live": _live("cpu", _NAN_ROWS)}),
            (module, fn, args, {"live": _live("cpu", _NAN_ROWS[:1])}),
        ]
    return run_interpreted(calls)


def _assert_live_contract(base, base_err, dead, dead_err, half, half_err, ctx: str) -> None:
    """Outputs and non-finite messages of the default launch, with both NaN rows dead, with one of them dead."""
    assert base_err is not None and "t." in base_err, f"{ctx}: the NaN rows must flag a launch without live rows"
    assert dead_err is None, f"{ctx}: only padding rows held NaN/Inf, yet the flag was set: {dead_err}"
    assert half_err is not None, f"{ctx}: a live row held Inf and set no flag"
    for j, (b, d, h) in enumerate(zip(base, dead, half, strict=True)):
        if b is not None:
            assert_bitwise(f"output {j}", d, b, f"{ctx} (padding rows dead)")
            assert_bitwise(f"output {j}", h, b, f"{ctx} (one padding row)")


@pytest.mark.parametrize("i", range(len(_LIVE)), ids=[fn for _, fn in _LIVE])
def test_interpreter_live_rows_flag_only_real_rows(live_interp, i):
    base, dead, half = live_interp[3 * i : 3 * i + 3]
    _assert_live_contract(*(r[key] for r in (base, dead, half) for key in ("out", "nonfinite")), _LIVE[i][1])


@gpu
@pytest.mark.parametrize("i", range(len(_LIVE)), ids=[fn for _, fn in _LIVE])
def test_gpu_live_rows_flag_only_real_rows(i):
    from jetrl.kernels import check_nonfinite
    from jetrl.quant import NonFiniteError

    module, fn = _LIVE[i]
    args = _live_args(fn, "cuda")

    def run(kwargs):
        out = _call(module, fn, args, kwargs)
        try:
            check_nonfinite()
        except NonFiniteError as e:
            return out, str(e)
        return out, None

    (base, base_err), (dead, dead_err), (half, half_err) = (
        run({}), run({"live": _live("cuda", _NAN_ROWS)}), run({"live": _live("cuda", _NAN_ROWS[:1])})
    )  # fmt: skip
    _assert_live_contract(base, base_err, dead, dead_err, half, half_err, fn)


def test_live_rows_must_be_an_integer_row_vector():
    from jetrl.kernels.quantize_1x128 import launch_quantize_1x128

    x = torch.zeros(4, 128)
    for bad in (torch.zeros(3, dtype=torch.int64), torch.zeros(4), torch.ones(4, dtype=torch.bool)):
        with pytest.raises(ValueError, match="live rows of t.x must be an integer \\[4\\] tensor"):
            launch_quantize_1x128(x, "row", "t.x", live=bad)
    with pytest.raises(ValueError, match="live rows of t.x must be contiguous on cpu, got stride 2 on cpu"):
        launch_quantize_1x128(x, "row", "t.x", live=torch.arange(8)[::2])
