"""1x128 activation quantization (per token group along K), the fprop/dgrad activation format.

Math: `jetrl.quant.quantize_1x128` (NUMERICS.md section 1) — per group of 128 consecutive values of
a row, ``s = max(amax, eps) / 448`` and ``q = e4m3_rne(clamp(x / s, -448, 448))``. The kernel does
exactly that in fp32 with ``tl.math.div_rn`` for both divisions (Triton's ``/`` is approximate), clamps
before the cast (the cast does not saturate the way we want), and masks partial groups so the
padding lanes (zeros) never raise an amax.

Scale layouts: ``"row"`` is a contiguous ``[M, G]`` tensor; ``"deepgemm"`` is the MN-major layout
DeepGEMM's sm_90 kernels read, same shape ``[M, G]`` but strides ``(1, align(M, 4))`` — each
program writes its BLOCK_M scales of one group as one coalesced run.

Tiling: one program owns a ``[BLOCK_M, 128]`` tile (one group of BLOCK_M rows), so the amax is a
single in-register row reduction and every load and store is a full 128-wide coalesced segment.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jetrl import quant
from jetrl.recipe import BLOCK, DEFAULT_EPS, E4M3_MAX

from ._runtime import (
    SCALE_LAYOUTS,
    SCALE_STRIDE_UNALIGNED,
    abs_max,
    check_live,
    check_matrix,
    count_nonfinite,
    e4m3_grid,
    e4m3_scale,
    groups,
    live_row_mask,
    nonfinite_flag,
    scale_buffer,
    to_scale_layout,
)

__all__ = ["quantize_1x128", "torch_quantize_1x128", "launch_quantize_1x128"]

OP = "jetrl::quantize_1x128"


@triton.jit(do_not_specialize_on_alignment=SCALE_STRIDE_UNALIGNED)
def _quantize_1x128_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    pre_ptr,
    flag_ptr,
    flag_slot,
    live_ptr,
    M,
    K,
    G,
    stride_xm,
    stride_qm,
    stride_sm,
    stride_sg,
    EPS: tl.constexpr,
    FP8_MAX: tl.constexpr,
    BLOCK_M: tl.constexpr,
    GROUP: tl.constexpr,
    G_FASTEST: tl.constexpr,
    STORE_PRECAST: tl.constexpr,
    RCP: tl.constexpr,
    HAS_LIVE: tl.constexpr,
):
    # 1-D grid over [BLOCK_M, 128] tiles; G_FASTEST walks a band of rows group by group (the tiles
    # in flight at once cover whole contiguous rows), else each group column top to bottom
    pid = tl.program_id(0)
    if G_FASTEST:
        pid_g = pid % G
        pid_m = pid // G
    else:
        n_m = tl.cdiv(M, BLOCK_M)
        pid_m = pid % n_m
        pid_g = pid // n_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = pid_g * GROUP + tl.arange(0, GROUP)
    mask_m = offs_m < M
    mask = mask_m[:, None] & (offs_k[None, :] < K)
    rows = offs_m.to(tl.int64)[:, None]

    # load one group of BLOCK_M rows; padding lanes read 0 and cannot raise the amax
    x = tl.load(x_ptr + rows * stride_xm + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)

    # scale per group: max(amax, eps) / 448, correctly rounded; the NaN-propagating amax also
    # carries the non-finite test (one predicated store per program)
    amax = abs_max(x, 1)
    live = live_row_mask(live_ptr, offs_m, mask_m, HAS_LIVE)
    tl.store(flag_ptr + flag_slot, 1, mask=count_nonfinite(tl.where(live, amax, 0.0)) > 0)
    s = e4m3_scale(amax, EPS, FP8_MAX)

    # quantize: true division, clamp, then the RNE cast
    y = e4m3_grid(x, s[:, None], FP8_MAX, RCP)
    tl.store(q_ptr + rows * stride_qm + offs_k[None, :], y.to(tl.float8e4nv), mask=mask)
    tl.store(s_ptr + offs_m * stride_sm + pid_g * stride_sg, s, mask=mask_m)
    if STORE_PRECAST:
        tl.store(pre_ptr + rows * K + offs_k[None, :], y, mask=mask)


def launch_quantize_1x128(
    x: torch.Tensor,
    scale_layout: str = "row",
    name: str = "x",
    precast: torch.Tensor | None = None,
    block_m: int = 64,
    num_warps: int = 4,
    rcp: bool = True,
    g_fastest: bool = True,
    live: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the Triton kernel.

    Input:  x ``[M, K]`` float32/bfloat16/float16, last-dim stride 1, any row stride.
    Output: q float8_e4m3fn ``[M, K]`` contiguous.
    scales: fp32 ``[M, ceil(K/128)]``; strides ``(G, 1)`` for ``"row"``, ``(1, align(M, 4))`` for ``"deepgemm"``.
    ``precast`` (tests only): an fp32 ``[M, K]`` contiguous buffer that receives the clamped ``x / s``
    values before the e4m3 cast, so a harness can apply a known-correct cast.
    Tuning options (same bytes either way; defaults are the fastest of ``bench_kernels.py --sweep`` on
    the H200): ``block_m``, ``num_warps``, ``rcp`` (divide through the per-group reciprocal,
    `_runtime.e4m3_grid`), ``g_fastest`` (program order along the groups of a row band first).
    ``live``: an integer ``[M]`` tensor (vLLM's slot mapping): only rows whose entry is >= 0 set the
    non-finite flag (`_runtime.check_live`); the bytes are the same.
    """
    check_matrix(x, name, OP)
    check_live(live, x.shape[0], x, name, OP)
    assert scale_layout in SCALE_LAYOUTS, f"{OP}: scale_layout={scale_layout!r}, choose one of {SCALE_LAYOUTS}"
    m, k = x.shape
    g = groups(k)
    q = torch.empty((m, k), dtype=quant.FP8_DTYPE, device=x.device)
    s = scale_buffer(m, g, scale_layout, x.device)
    if precast is not None:
        assert precast.shape == (m, k) and precast.dtype == torch.float32 and precast.is_contiguous(), (
            f"{OP}: precast must be a contiguous float32 [{m}, {k}] buffer"
        )
    if x.numel() == 0:
        return q, s
    flag, slot = nonfinite_flag(OP, name, x.device)
    _quantize_1x128_kernel[(triton.cdiv(m, block_m) * g,)](
        x,
        q,
        s,
        precast if precast is not None else q,
        flag,
        slot,
        live if live is not None else flag,
        m,
        k,
        g,
        x.stride(0),
        q.stride(0),
        s.stride(0),
        s.stride(1),
        EPS=DEFAULT_EPS,
        FP8_MAX=E4M3_MAX,
        BLOCK_M=block_m,
        GROUP=BLOCK,
        G_FASTEST=bool(g_fastest),
        STORE_PRECAST=precast is not None,
        RCP=bool(rcp),
        HAS_LIVE=live is not None,
        num_warps=num_warps,
    )
    return q, s


def torch_quantize_1x128(
    x: torch.Tensor, *, scale_layout: str = "row", name: str = "x"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: `jetrl.quant.quantize_1x128` (raises NonFiniteError at once), scales copied into
    the requested layout. Same signature and output layout as `quantize_1x128`."""
    if scale_layout not in SCALE_LAYOUTS:
        raise ValueError(f"{OP}: scale_layout={scale_layout!r}, choose one of {SCALE_LAYOUTS}")
    check_matrix(x, name, OP, inner_contiguous=False)
    q, s = quant.quantize_1x128(x, name=name)
    return q, to_scale_layout(s, scale_layout)


@torch.library.custom_op(OP, mutates_args=(), device_types="cpu")
def _quantize_1x128_op(x: torch.Tensor, scale_layout: str, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    return torch_quantize_1x128(x, scale_layout=scale_layout, name=name)


@_quantize_1x128_op.register_kernel("cuda")
def _(x: torch.Tensor, scale_layout: str, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    return launch_quantize_1x128(x, scale_layout, name)


@_quantize_1x128_op.register_fake
def _(x: torch.Tensor, scale_layout: str, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = x.shape
    return x.new_empty((m, k), dtype=quant.FP8_DTYPE), scale_buffer(m, groups(k), scale_layout, x.device)


def quantize_1x128(x: torch.Tensor, *, scale_layout: str = "row", name: str = "x") -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [M, K]`` in 1x128 groups along K (the `jetrl::quantize_1x128` op).

    Input:  x ``[M, K]`` float32/bfloat16/float16, unit stride along K on CUDA.
    Output: q float8_e4m3fn ``[M, K]`` contiguous.
    scales: fp32 ``[M, ceil(K/128)]``, row-major (``"row"``) or strides ``(1, align(M, 4))`` (``"deepgemm"``).
    CUDA runs the Triton kernel (non-finite input sets the flag `check_nonfinite` reads); CPU runs
    `torch_quantize_1x128` (non-finite input raises NonFiniteError at once).
    """
    if scale_layout not in SCALE_LAYOUTS:
        raise ValueError(f"{OP}: scale_layout={scale_layout!r}, choose one of {SCALE_LAYOUTS}")
    check_matrix(x, name, OP, inner_contiguous=x.is_cuda)
    return _quantize_1x128_op(x, scale_layout, name)
