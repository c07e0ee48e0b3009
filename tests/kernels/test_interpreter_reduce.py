"""The interpreter harness's fast ``tl.reduce`` (`kernels_cases._fold_reduce`) gives the bits of Triton's own.

Every interpreter test here runs the kernels with `_fold_reduce` in place of the interpreter's
element-by-element reduce loop (each launch about 10 times faster). That is only sound if it computes the same
bits for every reduction the kernels make: `abs_max` along axis 1 of a tile (quantize_1x128,
swiglu_quant, quantize_128x128, transpose_quantize with ``trans``), axis 0 (transpose_quantize),
axis 2 of a 3-D tile (rmsnorm_quant), and of a 1-D vector down to a scalar (quantize_128x128's block
amax). So each of these launches runs twice, under the stock loop and under the fold, on hostile
input: NaN and -NaN, +-Inf, -0.0, subnormals, values near the fp32 limits, and each group's largest
magnitude planted at the first or the last element its fold visits (a fold that skipped or repeated
an end would change a scale). Every output, the pre-cast values and the non-finite message must be
bit for bit the same, and the stock run must really have used the interpreter's own loop.
"""

from __future__ import annotations

import pytest
import torch
from kernels_cases import run_interpreted

from jetrl import quant


def _hostile(m: int, k: int, seed: int, exp: int) -> torch.Tensor:
    """fp32 ``[m, k]``: magnitudes 10^-exp..10^exp, -0.0 and subnormal columns, NaN and -NaN in row 1's
    first group, +Inf / -Inf in rows 2 / 3 of the middle column (other groups and rows stay finite)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.pow(10.0, torch.randint(-exp, exp + 1, (m, k), generator=g).float())
    x[:, 5], x[:, 70] = -0.0, 1e-40
    x[1, 7], x[1, 64] = float("nan"), -float("nan")
    x[2, k // 2], x[3, k // 2 + 1] = float("inf"), float("-inf")
    return x


def _row_groups(m: int, k: int, seed: int, exp: int) -> torch.Tensor:
    """`_hostile` ``[m, k]`` with the largest magnitude of each 128-group of rows 0 and 4 at its first
    or last column (the ends of a fold along K)."""
    x = _hostile(m, k, seed, exp)
    big = 10.0 ** (exp + 1)  # above every other value
    x[0, 0], x[0, 255], x[0, k - 1] = -big, 0.9 * big, -0.8 * big
    x[4, 127], x[4, 128], x[4, 256] = 0.95 * big, -0.85 * big, 0.75 * big
    return x


def _token_groups() -> torch.Tensor:
    """`_hostile` ``[128, 100]`` (one full token group) with the largest magnitude of some columns at
    token 0 or token 127 (the ends of a fold along M)."""
    x = _hostile(128, 100, 3, 30)
    x[0, 10], x[127, 11], x[0, 99], x[127, 98] = 3e31, -2e31, -1e31, 4e31  # above every other value
    return x


def _calls() -> list[tuple[str, str, tuple, dict]]:
    x = _row_groups(5, 300, 1, 37)  # 3 groups along K (the last partial), fewer rows than any tile
    xs, up = _row_groups(5, 300, 1, 12), _hostile(5, 300, 2, 12)  # RMSNorm / SwiGLU: no overflow in x*x or g*u
    xt = _token_groups()
    q, s = quant.quantize_1x128(torch.randn(128, 100, generator=torch.Generator().manual_seed(4)))
    s[4, 0], s[9, 0] = float("inf"), float("nan")
    w = 1 + 0.1 * torch.randn(300, generator=torch.Generator().manual_seed(5))

    def pre(*shape):
        return torch.full(shape, float("nan"))

    return [
        ("quantize_1x128", "launch_quantize_1x128", (x, "deepgemm", "t.x", pre(5, 300)), {}),
        ("quantize_128x128", "launch_quantize_128x128", (x, True, "t.w", pre(5, 300)), {}),
        ("transpose_quantize", "launch_transpose_quantize", (xt, "t.x", pre(100, 128)), {}),
        ("transpose_quantize", "launch_transpose_quantize", (xt, "t.x", pre(100, 128)), {"trans": True}),
        ("transpose_quantize", "launch_transpose_requantize", (q, s, "t.x", pre(100, 128)), {}),
        ("rmsnorm_quant", "launch_rmsnorm_quant", (xs, w, 1e-6, "row", "t.x", pre(5, 300)), {"block_m": 2}),
        ("rmsnorm_quant", "launch_add_rmsnorm_quant", (xs, up, w, 1e-6, "row", "t.x"), {"block_m": 2}),
        ("swiglu_quant", "launch_swiglu_quant", (xs, up, "row", "t.h", pre(5, 300)), {}),
    ]


_IDS = [f"{fn}{'-' + '-'.join(f'{k}={v}' for k, v in kw.items()) if kw else ''}" for _, fn, _, kw in _calls()]


@pytest.fixture(scope="module")
def stock_and_fold():
    calls = _calls()
    return run_interpreted(calls, stock_reduce=True), run_interpreted(calls)


def _same_bits(name: str, got, want, ctx: str) -> None:
    if got is None or want is None:
        assert got is None and want is None, f"{name}: {got!r} vs {want!r} {ctx}"
        return
    assert (got.dtype, got.shape, got.stride()) == (want.dtype, want.shape, want.stride()), f"{name} {ctx}"
    g, w = got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)
    n = int((g != w).sum())
    assert n == 0, f"{name}: {n}/{g.numel()} bytes differ between the fold and the stock reduce {ctx}"


@pytest.mark.parametrize("i", range(len(_IDS)), ids=_IDS)
def test_fold_reduce_gives_the_stock_bits(stock_and_fold, i):
    stock, fold = stock_and_fold[0][i], stock_and_fold[1][i]
    ctx = _IDS[i]
    assert (stock["reduce"], fold["reduce"]) == ("generic_reduce", "_fold_reduce"), ctx
    assert stock["nonfinite"] is not None and fold["nonfinite"] == stock["nonfinite"], ctx
    for j, (got, want) in enumerate(zip(fold["out"], stock["out"], strict=True)):
        _same_bits(f"output {j}", got, want, ctx)
    for j, (got, want) in enumerate(zip(fold["args"], stock["args"], strict=True)):
        if isinstance(want, torch.Tensor):  # the pre-cast buffer, and inputs left as they were
            _same_bits(f"argument {j}", got, want, ctx)
