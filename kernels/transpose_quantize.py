"""Transpose-quantize for wgrad: ``X [M, K]`` -> ``X^T`` quantized 1x128 along the token axis.

wgrad computes ``dW += dY^T X`` with DeepGEMM's NT kernel, which wants both operands K-major where
K is now the token axis M: ``X^T [K, M]`` e4m3 with one fp32 scale per 128 consecutive tokens of a
column, ``s_t [K, ceil(M/128)]``. That is `jetrl.quant.quantize_128x1` (``quantize_1x128(x.t())``),
and `transpose_quantize` is bit-equal to it.

Kernel: a program loads a ``[GROUPS_M * 128, BLOCK_K]`` tile of X (GROUPS_M groups of 128 tokens by
BLOCK_K columns; launcher keywords, `default_config` picks them) with coalesced row reads, reduces the
amax over the token axis of each group (one scale per group and column),
divides with ``tl.math.div_rn``, clamps, casts, and stores the tile transposed at ``q_t[k, m]``
(Triton stages the transposed store through shared memory, so the writes are 128-byte rows too).
One read of X, one write of the bytes: no materialised ``X^T``.

`quantize_1x128_and_transpose` serves the backward's dY, which both dgrad (1x128 along N) and wgrad
(1x128 along M, transposed) consume: one program loads a ``[GROUPS_M * 128, 128]`` tile of dY once
and writes both quantizations — row scales over the tile's 128 columns, column scales over each
128-token group — with exactly the two ops' per-group math (so both are bit-equal to them).

`transpose_requantize` starts instead from the 1x128-quantized activation saved for backward
(``q [M, K]``, ``s [M, ceil(K/128)]``): it dequantizes in fp32 (``q * s``, the product
`jetrl.quant.dequantize_1x128` computes), then proceeds as above. Saving only the FP8 activation
halves activation memory, at the price of a second rounding — its EXTRA ERROR:

- every value is rounded twice: first to the e4m3 grid of its row group (scale = row-group amax/448),
  then to the e4m3 grid of its column group (scale = column-group amax/448). e4m3 has 3 mantissa
  bits, so each rounding has relative error <= 2^-4; the second rounding adds up to another 2^-4 of
  relative error (bounded by the column scale's grid, which can be coarser than the row's);
- values far below their column group's amax become subnormal or flush to zero in the second pass
  even when the first pass had kept them (and vice versa), exactly as in a direct 128x1 quantization;
- measured on randn bf16 ``[4096, 4096]`` (CPU, jetrl.quant; pinned by the test
  ``test_requantize_extra_error_matches_the_module_docstring``): direct ``quantize_128x1`` has SQNR
  31.8 dB against X; requantizing from the 1x128 bytes gives 28.8 dB (-3.0 dB: the two roundings
  add about equally); 29% of the bytes and 50% of the scales differ from the direct path (a column
  group's amax is itself a rounded value); the worst relative error of values above 0.1 grows from
  5.9% (one rounding, bound 2^-4 plus grid edges) to 12.0% (bound ~2 * 2^-4).
The reference `torch_transpose_requantize` composes `jetrl.quant.dequantize_1x128` and
`jetrl.quant.quantize_128x1`; the kernel is bit-equal to it (the fp32 product ``q * s`` is computed
identically).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from jetrl import quant
from jetrl.recipe import BLOCK, DEFAULT_EPS, E4M3_MAX

from ._runtime import (
    SCALE_LAYOUTS,
    check_matrix,
    count_nonfinite,
    e4m3_grid,
    e4m3_scale,
    groups,
    nonfinite_flag,
    scale_buffer,
)
from .quantize_1x128 import torch_quantize_1x128

__all__ = [
    "transpose_quantize",
    "torch_transpose_quantize",
    "launch_transpose_quantize",
    "transpose_requantize",
    "torch_transpose_requantize",
    "launch_transpose_requantize",
    "quantize_1x128_and_transpose",
    "torch_quantize_1x128_and_transpose",
    "launch_quantize_1x128_and_transpose",
]

OP = "jetrl::transpose_quantize"
OP_RE = "jetrl::transpose_requantize"
OP_DUAL = "jetrl::quantize_1x128_and_transpose"


@triton.jit
def _transpose_quantize_kernel(
    x_ptr,
    xs_ptr,
    qt_ptr,
    st_ptr,
    pre_ptr,
    flag_ptr,
    flag_slot,
    M,
    K,
    stride_xm,
    stride_xsm,
    stride_xsg,
    GM,
    EPS: tl.constexpr,
    FP8_MAX: tl.constexpr,
    GROUP: tl.constexpr,
    GROUPS_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FROM_FP8: tl.constexpr,
    STORE_PRECAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    # the tile is addressed as [GROUPS_M, 128 tokens, BLOCK_K] (no reshape): token groups on axis 0
    offs_gm = pid_m * GROUPS_M + tl.arange(0, GROUPS_M)
    offs_m = offs_gm[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_k = offs_k < K
    mask = (offs_m[:, :, None] < M) & mask_k[None, None, :]
    rows = offs_m.to(tl.int64)[:, :, None]
    cols = offs_k.to(tl.int64)[None, None, :]

    # load the tile (row reads); padding tokens read 0
    x = tl.load(x_ptr + rows * stride_xm + offs_k[None, None, :], mask=mask, other=0.0).to(tl.float32)
    if FROM_FP8:
        # dequantize the saved 1x128 activation: fp32 q * s; BLOCK_K divides 128, so the whole
        # tile lies in one K group and needs one scale per row
        g_col = (pid_k * BLOCK_K) // GROUP
        xs = tl.load(xs_ptr + offs_m * stride_xsm + g_col * stride_xsg, mask=offs_m < M, other=0.0)
        x = x * xs[:, :, None]

    # non-finite detection (exponent bits all ones)
    n_bad = count_nonfinite(x)
    tl.store(flag_ptr + flag_slot, 1, mask=n_bad > 0)

    # one scale per (128-token group, column): amax over the token axis
    s = e4m3_scale(tl.max(tl.abs(x), axis=1), EPS, FP8_MAX)

    # quantize: true division, clamp, RNE cast; store transposed at q_t[k, m]
    y = e4m3_grid(x, s[:, None, :], FP8_MAX)
    tl.store(qt_ptr + cols * M + offs_m[:, :, None], y.to(tl.float8e4nv), mask=mask)
    s_mask = (offs_gm[:, None] < GM) & mask_k[None, :]
    tl.store(st_ptr + offs_k.to(tl.int64)[None, :] * GM + offs_gm[:, None], s, mask=s_mask)
    if STORE_PRECAST:
        tl.store(pre_ptr + cols * M + offs_m[:, :, None], y, mask=mask)


@triton.jit
def _quantize_1x128_and_transpose_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    qt_ptr,
    st_ptr,
    pre_ptr,
    pret_ptr,
    flag_ptr,
    flag_slot,
    M,
    K,
    stride_xm,
    stride_sm,
    stride_sg,
    GM,
    EPS: tl.constexpr,
    FP8_MAX: tl.constexpr,
    GROUP: tl.constexpr,
    GROUPS_M: tl.constexpr,
    STORE_PRECAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    # a [GROUPS_M, 128 tokens, 128 columns] tile (one K group), token groups on axis 0
    offs_gm = pid_m * GROUPS_M + tl.arange(0, GROUPS_M)
    offs_m = offs_gm[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    offs_k = pid_k * GROUP + tl.arange(0, GROUP)
    mask_m = offs_m < M
    mask_k = offs_k < K
    mask = mask_m[:, :, None] & mask_k[None, None, :]
    rows = offs_m.to(tl.int64)[:, :, None]
    cols = offs_k.to(tl.int64)[None, None, :]

    # load the tile once (row reads); padding lanes read 0
    x = tl.load(x_ptr + rows * stride_xm + offs_k[None, None, :], mask=mask, other=0.0).to(tl.float32)

    # non-finite detection (exponent bits all ones)
    n_bad = count_nonfinite(x)
    tl.store(flag_ptr + flag_slot, 1, mask=n_bad > 0)

    # 1x128 along K: one scale per token (its 128 columns); divide, clamp, RNE cast
    s = e4m3_scale(tl.max(tl.abs(x), axis=2), EPS, FP8_MAX)
    y = e4m3_grid(x, s[:, :, None], FP8_MAX)
    tl.store(q_ptr + rows * K + cols, y.to(tl.float8e4nv), mask=mask)
    tl.store(s_ptr + offs_m * stride_sm + pid_k * stride_sg, s, mask=mask_m)

    # 128x1 along M: one scale per (128-token group, column); store transposed at q_t[k, m]
    s_t = e4m3_scale(tl.max(tl.abs(x), axis=1), EPS, FP8_MAX)
    y_t = e4m3_grid(x, s_t[:, None, :], FP8_MAX)
    tl.store(qt_ptr + cols * M + offs_m[:, :, None], y_t.to(tl.float8e4nv), mask=mask)
    s_mask = (offs_gm[:, None] < GM) & mask_k[None, :]
    tl.store(st_ptr + offs_k.to(tl.int64)[None, :] * GM + offs_gm[:, None], s_t, mask=s_mask)
    if STORE_PRECAST:
        tl.store(pre_ptr + rows * K + cols, y, mask=mask)
        tl.store(pret_ptr + cols * M + offs_m[:, :, None], y_t, mask=mask)


@functools.lru_cache(maxsize=256)
def default_config(m: int, k: int) -> tuple[int, int, int, int]:
    """``(groups_m, block_k, num_warps, num_stages)`` for an ``[m, k]`` input: a program owns
    ``groups_m`` 128-token groups by ``block_k`` columns. Last session's ``[128, 64]`` tiles with 4
    warps reached 51% of copy on the H200; the default doubles the tokens per program when M allows
    (``[256, 64]``, 8 warps: 32 KiB of bf16 read, q_t rows written as 256-byte runs).
    `bench_kernels.py --sweep` times `SWEEP_CONFIGS`."""
    if m <= BLOCK:
        return 1, 64, 4, 3
    return 2, 64, 8, 3


SWEEP_CONFIGS = [
    dict(groups_m=1, block_k=64, num_warps=4),
    dict(groups_m=1, block_k=128, num_warps=8),
    dict(groups_m=2, block_k=32, num_warps=4),
    dict(groups_m=2, block_k=64, num_warps=4),
    dict(groups_m=2, block_k=64, num_warps=8),
    dict(groups_m=2, block_k=128, num_warps=8),
    dict(groups_m=4, block_k=32, num_warps=8),
    dict(groups_m=4, block_k=64, num_warps=8),
]


def _launch(x, xs, name, op, precast, groups_m=None, block_k=None, num_warps=None, num_stages=None):
    m, k = x.shape
    gm = groups(m)
    dev = x.device
    q_t = torch.empty((k, m), dtype=quant.FP8_DTYPE, device=dev)
    s_t = torch.empty((k, gm), dtype=torch.float32, device=dev)
    if precast is not None:
        assert precast.shape == (k, m) and precast.dtype == torch.float32 and precast.is_contiguous(), (
            f"{op}: precast must be a contiguous float32 [{k}, {m}] buffer"
        )
    if x.numel() == 0:
        return q_t, s_t
    gmp, bk, nw, ns = default_config(m, k)
    gmp = gmp if groups_m is None else groups_m
    bk = bk if block_k is None else block_k
    nw = nw if num_warps is None else num_warps
    ns = ns if num_stages is None else num_stages
    assert BLOCK % bk == 0, f"{op}: block_k={bk} must divide {BLOCK}"
    flag, slot = nonfinite_flag(op, name, dev)
    _transpose_quantize_kernel[(triton.cdiv(gm, gmp), triton.cdiv(k, bk))](
        x,
        xs if xs is not None else x,
        q_t,
        s_t,
        precast if precast is not None else q_t,
        flag,
        slot,
        m,
        k,
        x.stride(0),
        xs.stride(0) if xs is not None else 0,
        xs.stride(1) if xs is not None else 0,
        gm,
        EPS=DEFAULT_EPS,
        FP8_MAX=E4M3_MAX,
        GROUP=BLOCK,
        GROUPS_M=gmp,
        BLOCK_K=bk,
        FROM_FP8=xs is not None,
        STORE_PRECAST=precast is not None,
        num_warps=nw,
        num_stages=ns,
    )
    return q_t, s_t


def launch_transpose_quantize(
    x: torch.Tensor, name: str = "x", precast: torch.Tensor | None = None, **config
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the Triton kernel.

    Input:  x ``[M, K]`` float32/bfloat16/float16, last-dim stride 1, any row stride.
    Output: q_t float8_e4m3fn ``[K, M]`` contiguous.
    scales: s_t fp32 ``[K, ceil(M/128)]`` contiguous (strides ``(ceil(M/128), 1)``).
    ``precast`` (tests only): fp32 ``[K, M]`` contiguous buffer receiving the clamped quotients.
    ``config``: ``groups_m``, ``block_k`` (divides 128), ``num_warps``, ``num_stages``; ``None`` or absent =
    `default_config`.
    """
    check_matrix(x, name, OP)
    return _launch(x, None, name, OP, precast, **config)


def launch_transpose_requantize(
    q: torch.Tensor, s: torch.Tensor, name: str = "x", precast: torch.Tensor | None = None, **config
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the Triton kernel on a 1x128-quantized activation.

    Input:  q float8_e4m3fn ``[M, K]``, last-dim stride 1; s fp32 ``[M, ceil(K/128)]``, any strides
            (row-major or DeepGEMM's ``(1, align(M, 4))``).
    Output: q_t float8_e4m3fn ``[K, M]`` contiguous.
    scales: s_t fp32 ``[K, ceil(M/128)]`` contiguous.
    """
    _check_fp8_pair(q, s, name)
    assert q.shape[1] <= 1 or q.stride(1) == 1, f"{OP_RE}: {name} bytes need unit stride along K, got {q.stride()}"
    return _launch(q, s, name, OP_RE, precast, **config)


# candidate (groups_m, num_warps) of the dual kernel timed by `bench_kernels.py --sweep`
DUAL_SWEEP_CONFIGS = [
    dict(groups_m=1, num_warps=4),
    dict(groups_m=1, num_warps=8),
    dict(groups_m=2, num_warps=8),
    dict(groups_m=2, num_warps=16),
]


def launch_quantize_1x128_and_transpose(
    x: torch.Tensor,
    scale_layout: str = "deepgemm",
    name: str = "dy",
    precast: torch.Tensor | None = None,
    precast_t: torch.Tensor | None = None,
    groups_m: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the dual Triton kernel: one read of x, both backward operand layouts.

    Input:  x ``[M, N]`` float32/bfloat16/float16, last-dim stride 1, any row stride (dY).
    Output: q float8_e4m3fn ``[M, N]`` contiguous (1x128 along N, dgrad's A operand) and
            q_t float8_e4m3fn ``[N, M]`` contiguous (1x128 along M, wgrad's A operand).
    scales: s fp32 ``[M, ceil(N/128)]`` in ``scale_layout`` (default ``"deepgemm"``: strides
            ``(1, align(M, 4))``; or ``"row"``); s_t fp32 ``[N, ceil(M/128)]`` contiguous.
    ``precast`` / ``precast_t`` (tests only): fp32 ``[M, N]`` / ``[N, M]`` contiguous buffers
    receiving the clamped quotients before the casts (both or neither).
    Launch: a program owns ``[groups_m * 128, 128]`` (``None``: 1 group, 8 warps; 4 when M <= 128).
    """
    check_matrix(x, name, OP_DUAL)
    assert scale_layout in SCALE_LAYOUTS, f"{OP_DUAL}: scale_layout={scale_layout!r}, choose one of {SCALE_LAYOUTS}"
    m, k = x.shape
    g, gm = groups(k), groups(m)
    dev = x.device
    q = torch.empty((m, k), dtype=quant.FP8_DTYPE, device=dev)
    s = scale_buffer(m, g, scale_layout, dev)
    q_t = torch.empty((k, m), dtype=quant.FP8_DTYPE, device=dev)
    s_t = torch.empty((k, gm), dtype=torch.float32, device=dev)
    if precast is not None or precast_t is not None:
        assert precast is not None and precast.shape == (m, k) and precast.dtype == torch.float32, (
            f"{OP_DUAL}: precast must be a contiguous float32 [{m}, {k}] buffer"
        )
        assert precast_t is not None and precast_t.shape == (k, m) and precast_t.dtype == torch.float32, (
            f"{OP_DUAL}: precast_t must be a contiguous float32 [{k}, {m}] buffer"
        )
        assert precast.is_contiguous() and precast_t.is_contiguous(), f"{OP_DUAL}: precast buffers must be contiguous"
    if x.numel() == 0:
        return q, s, q_t, s_t
    gmp = groups_m if groups_m is not None else 1
    nw = num_warps if num_warps is not None else (4 if m <= BLOCK else 8)
    flag, slot = nonfinite_flag(OP_DUAL, name, dev)
    _quantize_1x128_and_transpose_kernel[(triton.cdiv(gm, gmp), g)](
        x,
        q,
        s,
        q_t,
        s_t,
        precast if precast is not None else q,
        precast_t if precast_t is not None else q_t,
        flag,
        slot,
        m,
        k,
        x.stride(0),
        s.stride(0),
        s.stride(1),
        gm,
        EPS=DEFAULT_EPS,
        FP8_MAX=E4M3_MAX,
        GROUP=BLOCK,
        GROUPS_M=gmp,
        STORE_PRECAST=precast is not None,
        num_warps=nw,
        num_stages=num_stages if num_stages is not None else 3,
    )
    return q, s, q_t, s_t


def torch_quantize_1x128_and_transpose(
    x: torch.Tensor, *, scale_layout: str = "deepgemm", name: str = "dy"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference: `torch_quantize_1x128` then `torch_transpose_quantize` of the same x (each raises
    NonFiniteError at once). Same signature and output layouts as `quantize_1x128_and_transpose`."""
    q, s = torch_quantize_1x128(x, scale_layout=scale_layout, name=name)
    q_t, s_t = torch_transpose_quantize(x, name=name)
    return q, s, q_t, s_t


@torch.library.custom_op(OP_DUAL, mutates_args=(), device_types="cpu")
def _quantize_1x128_and_transpose_op(
    x: torch.Tensor, scale_layout: str, name: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch_quantize_1x128_and_transpose(x, scale_layout=scale_layout, name=name)


@_quantize_1x128_and_transpose_op.register_kernel("cuda")
def _(x: torch.Tensor, scale_layout: str, name: str):
    return launch_quantize_1x128_and_transpose(x, scale_layout, name)


@_quantize_1x128_and_transpose_op.register_fake
def _(x: torch.Tensor, scale_layout: str, name: str):
    m, k = x.shape
    return (
        x.new_empty((m, k), dtype=quant.FP8_DTYPE),
        scale_buffer(m, groups(k), scale_layout, x.device),
        x.new_empty((k, m), dtype=quant.FP8_DTYPE),
        x.new_empty((k, groups(m)), dtype=torch.float32),
    )


def quantize_1x128_and_transpose(
    x: torch.Tensor, *, scale_layout: str = "deepgemm", name: str = "dy"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """From ``dY [M, N]`` both backward operands in one read (the `jetrl::quantize_1x128_and_transpose`
    op): ``(q, s) = quantize_1x128(dY)`` (dgrad) and ``(q_t, s_t) = transpose_quantize(dY)`` (wgrad),
    each bit-equal to its own op. Scales of q default to DeepGEMM's layout (strides ``(1, align(M, 4))``).

    Input: x ``[M, N]`` float32/bfloat16/float16 (unit stride along N on CUDA). Outputs as
    `launch_quantize_1x128_and_transpose`.
    """
    if scale_layout not in SCALE_LAYOUTS:
        raise ValueError(f"{OP_DUAL}: scale_layout={scale_layout!r}, choose one of {SCALE_LAYOUTS}")
    check_matrix(x, name, OP_DUAL, inner_contiguous=x.is_cuda)
    return _quantize_1x128_and_transpose_op(x, scale_layout, name)


def _check_fp8_pair(q: torch.Tensor, s: torch.Tensor, name: str) -> None:
    if q.dim() != 2 or q.dtype != quant.FP8_DTYPE:
        raise ValueError(f"{OP_RE}: {name} bytes must be 2-D float8_e4m3fn, got {q.dtype} {tuple(q.shape)}")
    want = (q.shape[0], groups(q.shape[1]))
    if s.dtype != torch.float32 or tuple(s.shape) != want:
        raise ValueError(f"{OP_RE}: {name} scales must be float32 {want}, got {s.dtype} {tuple(s.shape)}")


def torch_transpose_quantize(x: torch.Tensor, *, name: str = "x") -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: `jetrl.quant.quantize_128x1` (raises NonFiniteError at once)."""
    check_matrix(x, name, OP, inner_contiguous=False)
    return quant.quantize_128x1(x, name=name)


def torch_transpose_requantize(
    q: torch.Tensor, s: torch.Tensor, *, name: str = "x"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: `jetrl.quant.quantize_128x1` of `jetrl.quant.dequantize_1x128` (fp32)."""
    _check_fp8_pair(q, s, name)
    return quant.quantize_128x1(quant.dequantize_1x128(q, s, torch.float32, name=name), name=name)


@torch.library.custom_op(OP, mutates_args=(), device_types="cpu")
def _transpose_quantize_op(x: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    return torch_transpose_quantize(x, name=name)


@_transpose_quantize_op.register_kernel("cuda")
def _(x: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    return launch_transpose_quantize(x, name)


@_transpose_quantize_op.register_fake
def _(x: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = x.shape
    return x.new_empty((k, m), dtype=quant.FP8_DTYPE), x.new_empty((k, groups(m)), dtype=torch.float32)


@torch.library.custom_op(OP_RE, mutates_args=(), device_types="cpu")
def _transpose_requantize_op(q: torch.Tensor, s: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    return torch_transpose_requantize(q, s, name=name)


@_transpose_requantize_op.register_kernel("cuda")
def _(q: torch.Tensor, s: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    return launch_transpose_requantize(q, s, name)


@_transpose_requantize_op.register_fake
def _(q: torch.Tensor, s: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = q.shape
    return q.new_empty((k, m)), q.new_empty((k, groups(m)), dtype=torch.float32)


def transpose_quantize(x: torch.Tensor, *, name: str = "x") -> tuple[torch.Tensor, torch.Tensor]:
    """``X [M, K]`` -> ``(q_t [K, M] e4m3, s_t [K, ceil(M/128)] fp32)``, bit-equal to
    `jetrl.quant.quantize_128x1(x)` (the `jetrl::transpose_quantize` op; wgrad's operand layout).

    Input: x ``[M, K]`` float32/bfloat16/float16 (unit stride along K on CUDA). Outputs contiguous.
    """
    check_matrix(x, name, OP, inner_contiguous=x.is_cuda)
    return _transpose_quantize_op(x, name)


def transpose_requantize(q: torch.Tensor, s: torch.Tensor, *, name: str = "x") -> tuple[torch.Tensor, torch.Tensor]:
    """From a 1x128-quantized ``(q [M, K], s [M, ceil(K/128)])`` produce the wgrad operand
    ``(q_t [K, M], s_t [K, ceil(M/128)])``: dequantize (fp32), transpose, requantize 1x128 along M
    (the `jetrl::transpose_requantize` op). Adds a second rounding: see the module docstring."""
    _check_fp8_pair(q, s, name)
    return _transpose_requantize_op(q, s, name)
