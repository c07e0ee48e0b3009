"""Dual quantization: ``X [M, K]`` -> its 1x128 bytes (along K) AND its 128x1 wgrad operand (along M),
from one read of X.

An FP8 Linear quantizes two tensors both ways every step: X in the forward (1x128 for fprop, 128x1
saved for wgrad) and dY in the backward (1x128 for dgrad, 128x1 for wgrad). Done by
`quantize_1x128` and `transpose_quantize` separately, X is read twice (6 bytes moved per bf16 element)
and two kernels are launched; here a program owns a ``[128, 128]`` tile — one 1x128 group of each
of 128 rows AND one 128x1 group of each of 128 columns — and writes both, in one launch, reading X
from HBM once (4 bytes moved per element). It walks the tile twice: pass 1 in ``[CHUNK_M, 128]``
row chunks (1x128 along K, `quantize_1x128`'s computation), pass 2 in ``[128, CHUNK_K]`` column
chunks read again — from L2, the same program just read them — (128x1 along M, stored transposed:
`transpose_quantize`'s computation). Measured on the H200 and dropped: the whole tile held in
registers for one pass (1500-1650 GB/s, slower than the two separate kernels), and a pass 2 in row
chunks using column amaxes carried over from pass 1 (at most 1635 GB/s: short transposed stores).

Math: exactly `jetrl.quant.quantize_1x128` and `jetrl.quant.quantize_128x1` (the outputs are
bit-equal to `quantize_1x128(x)` and `transpose_quantize(x)`): per group ``s = max(amax, eps) / 448``
and ``q = e4m3_rne(clamp(x / s, -448, 448))`` in fp32 with correctly rounded division
(`_runtime.e4m3_scale` / `e4m3_grid`, shared with every kernel), partial groups masked (padding reads 0).

Scale layouts (``scale_layout``, for BOTH outputs, since both are read by the same GEMM backend as
1x128 operands along their K): ``"row"`` contiguous; ``"deepgemm"`` strides ``(1, align(rows, 4))``
— ``s [M, ceil(K/128)]`` and ``s_t [K, ceil(M/128)]`` — so DeepGEMM's wgrad reads ``s_t`` without the
copy it needs from `transpose_quantize`'s row-major scales.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jetrl import quant
from jetrl.recipe import BLOCK, DEFAULT_EPS, E4M3_MAX

from ._runtime import (
    SCALE_LAYOUTS,
    abs_max,
    check_matrix,
    count_nonfinite,
    e4m3_grid,
    e4m3_scale,
    groups,
    nonfinite_flag,
    scale_buffer,
    to_scale_layout,
)

__all__ = ["quantize_dual", "torch_quantize_dual", "launch_quantize_dual"]

OP = "jetrl::quantize_dual"


@triton.jit
def _quantize_dual_kernel(
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
    G,
    GM,
    stride_xm,
    stride_sm,
    stride_sg,
    stride_stk,
    stride_stg,
    EPS: tl.constexpr,
    FP8_MAX: tl.constexpr,
    GROUP: tl.constexpr,
    CHUNK_M: tl.constexpr,
    CHUNK_K: tl.constexpr,
    K_FASTEST: tl.constexpr,
    STORE_PRECAST: tl.constexpr,
    RCP: tl.constexpr,
):
    # 1-D grid over [128, 128] tiles; K_FASTEST walks a 128-token band across K, else a column strip
    # down the tokens
    pid = tl.program_id(0)
    if K_FASTEST:
        pid_k = pid % G
        pid_m = pid // G
    else:
        pid_m = pid % GM
        pid_k = pid // GM
    offs_k = pid_k * GROUP + tl.arange(0, GROUP)
    mask_k = offs_k < K

    # pass 1, in [CHUNK_M, 128] row chunks: 1x128 along K, one scale per row. The NaN-propagating row
    # amaxes cover every element, so they alone carry the non-finite test; padding lanes read 0
    bad = 0
    for c in tl.static_range(0, GROUP, CHUNK_M):
        offs_m = pid_m * GROUP + c + tl.arange(0, CHUNK_M)
        mask_m = offs_m < M
        mask = mask_m[:, None] & mask_k[None, :]
        rows = offs_m.to(tl.int64)[:, None]
        x = tl.load(x_ptr + rows * stride_xm + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
        amax = abs_max(x, 1)
        bad += count_nonfinite(amax)
        s = e4m3_scale(amax, EPS, FP8_MAX)
        y = e4m3_grid(x, s[:, None], FP8_MAX, RCP)
        tl.store(q_ptr + rows * K + offs_k[None, :], y.to(tl.float8e4nv), mask=mask)
        tl.store(s_ptr + offs_m * stride_sm + pid_k * stride_sg, s, mask=mask_m)
        if STORE_PRECAST:
            tl.store(pre_ptr + rows * K + offs_k[None, :], y, mask=mask)
    tl.store(flag_ptr + flag_slot, 1, mask=bad > 0)

    # pass 2, in [128, CHUNK_K] column chunks read again (from L2: this program just read them):
    # 128x1 along M, one scale per column, bytes stored transposed at q_t[k, m]
    offs_m = pid_m * GROUP + tl.arange(0, GROUP)
    mask_m = offs_m < M
    rows = offs_m.to(tl.int64)[:, None]
    for c in tl.static_range(0, GROUP, CHUNK_K):
        offs_kc = pid_k * GROUP + c + tl.arange(0, CHUNK_K)
        mask_kc = offs_kc < K
        mask = mask_m[:, None] & mask_kc[None, :]
        x = tl.load(x_ptr + rows * stride_xm + offs_kc[None, :], mask=mask, other=0.0).to(tl.float32)
        s_t = e4m3_scale(abs_max(x, 0), EPS, FP8_MAX)
        y_t = e4m3_grid(x, s_t[None, :], FP8_MAX, RCP)
        dst = offs_kc.to(tl.int64)[None, :] * M + offs_m[:, None]
        tl.store(qt_ptr + dst, y_t.to(tl.float8e4nv), mask=mask)
        tl.store(st_ptr + offs_kc * stride_stk + pid_m * stride_stg, s_t, mask=mask_kc)
        if STORE_PRECAST:
            tl.store(pret_ptr + dst, y_t, mask=mask)


def launch_quantize_dual(
    x: torch.Tensor,
    scale_layout: str = "row",
    name: str = "x",
    precast: tuple[torch.Tensor, torch.Tensor] | None = None,
    chunk_m: int = 64,
    chunk_k: int = 64,
    num_warps: int = 4,
    rcp: bool = True,
    k_fastest: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the Triton kernel.

    Input:  x ``[M, K]`` float32/bfloat16/float16, last-dim stride 1, any row stride.
    Output: q float8_e4m3fn ``[M, K]`` and q_t float8_e4m3fn ``[K, M]``, contiguous.
    scales: s fp32 ``[M, ceil(K/128)]`` and s_t fp32 ``[K, ceil(M/128)]``, both in `scale_layout`
    (``"row"``: contiguous; ``"deepgemm"``: strides ``(1, align(rows, 4))``).
    ``precast`` (tests only): two contiguous fp32 buffers ``([M, K], [K, M])`` receiving the clamped
    quotients before the e4m3 casts, so a harness can apply a known-correct cast.
    Tuning options (same bytes either way): ``chunk_m`` / ``chunk_k`` (rows / columns per chunk of
    the two passes, each divides 128), ``num_warps``,
    ``rcp`` (`_runtime.e4m3_grid`), ``k_fastest`` (program order).
    """
    check_matrix(x, name, OP)
    assert scale_layout in SCALE_LAYOUTS, f"{OP}: scale_layout={scale_layout!r}, choose one of {SCALE_LAYOUTS}"
    m, k = x.shape
    g, gm = groups(k), groups(m)
    dev = x.device
    q = torch.empty((m, k), dtype=quant.FP8_DTYPE, device=dev)
    q_t = torch.empty((k, m), dtype=quant.FP8_DTYPE, device=dev)
    s = scale_buffer(m, g, scale_layout, dev)
    s_t = scale_buffer(k, gm, scale_layout, dev)
    if precast is not None:
        for buf, shape in zip(precast, ((m, k), (k, m)), strict=True):
            assert tuple(buf.shape) == shape and buf.dtype == torch.float32 and buf.is_contiguous(), (
                f"{OP}: precast buffers must be contiguous float32 [{m}, {k}] and [{k}, {m}]"
            )
    assert BLOCK % chunk_m == 0 and BLOCK % chunk_k == 0, (
        f"{OP}: chunk_m={chunk_m}, chunk_k={chunk_k} must divide {BLOCK}"
    )
    if x.numel() == 0:
        return q, s, q_t, s_t
    flag, slot = nonfinite_flag(OP, name, dev)
    _quantize_dual_kernel[(gm * g,)](
        x,
        q,
        s,
        q_t,
        s_t,
        precast[0] if precast is not None else q,
        precast[1] if precast is not None else q_t,
        flag,
        slot,
        m,
        k,
        g,
        gm,
        x.stride(0),
        s.stride(0),
        s.stride(1),
        s_t.stride(0),
        s_t.stride(1),
        EPS=DEFAULT_EPS,
        FP8_MAX=E4M3_MAX,
        GROUP=BLOCK,
        CHUNK_M=chunk_m,
        CHUNK_K=chunk_k,
        K_FASTEST=bool(k_fastest),
        STORE_PRECAST=precast is not None,
        RCP=bool(rcp),
        num_warps=num_warps,
    )
    return q, s, q_t, s_t


def torch_quantize_dual(
    x: torch.Tensor, *, scale_layout: str = "row", name: str = "x"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference: `jetrl.quant.quantize_1x128` and `jetrl.quant.quantize_128x1` (raise NonFiniteError
    at once), scales copied into `scale_layout`. Same signature and outputs as `quantize_dual`."""
    if scale_layout not in SCALE_LAYOUTS:
        raise ValueError(f"{OP}: scale_layout={scale_layout!r}, choose one of {SCALE_LAYOUTS}")
    check_matrix(x, name, OP, inner_contiguous=False)
    q, s = quant.quantize_1x128(x, name=name)
    q_t, s_t = quant.quantize_128x1(x, name=name)
    return q, to_scale_layout(s, scale_layout), q_t, to_scale_layout(s_t, scale_layout)


@torch.library.custom_op(OP, mutates_args=(), device_types="cpu")
def _quantize_dual_op(
    x: torch.Tensor, scale_layout: str, name: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch_quantize_dual(x, scale_layout=scale_layout, name=name)


@_quantize_dual_op.register_kernel("cuda")
def _(x: torch.Tensor, scale_layout: str, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return launch_quantize_dual(x, scale_layout, name)


@_quantize_dual_op.register_fake
def _(x: torch.Tensor, scale_layout: str, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    m, k = x.shape
    return (
        x.new_empty((m, k), dtype=quant.FP8_DTYPE),
        scale_buffer(m, groups(k), scale_layout, x.device),
        x.new_empty((k, m), dtype=quant.FP8_DTYPE),
        scale_buffer(k, groups(m), scale_layout, x.device),
    )


def quantize_dual(
    x: torch.Tensor, *, scale_layout: str = "row", name: str = "x"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``X [M, K]`` -> ``(q [M, K], s [M, ceil(K/128)], q_t [K, M], s_t [K, ceil(M/128)])``: bit-equal to
    ``quantize_1x128(x) + transpose_quantize(x)`` (the `jetrl::quantize_dual` op), from one read of X.

    Input: x ``[M, K]`` float32/bfloat16/float16 (unit stride along K on CUDA). Bytes contiguous;
    both scale tensors in `scale_layout` (``"row"`` or ``"deepgemm"``). CUDA runs the Triton kernel
    (non-finite input sets the flag `check_nonfinite` reads); CPU runs `torch_quantize_dual`.
    """
    if scale_layout not in SCALE_LAYOUTS:
        raise ValueError(f"{OP}: scale_layout={scale_layout!r}, choose one of {SCALE_LAYOUTS}")
    check_matrix(x, name, OP, inner_contiguous=x.is_cuda)
    return _quantize_dual_op(x, scale_layout, name)
