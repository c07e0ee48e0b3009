"""1x128 activation quantization (per token group along K), the fprop/dgrad activation format.

Math: `jetrl.quant.quantize_1x128` (NUMERICS.md section 1) — per group of 128 consecutive values of
a row, ``s = max(amax, eps) / 448`` and ``q = e4m3_rne(clamp(x / s, -448, 448))``. The kernel does
exactly that in fp32 with ``tl.math.div_rn`` for both divisions (Triton's ``/`` is approximate), clamps
before the cast (the cast does not saturate the way we want), and masks partial groups so the
padding lanes (zeros) never raise an amax.

Scale layouts: ``"row"`` is a contiguous ``[M, G]`` tensor; ``"deepgemm"`` is the MN-major layout
DeepGEMM's sm_90 kernels read, same shape ``[M, G]`` but strides ``(1, align(M, 4))`` — each
program writes its BLOCK_M scales of one group as one coalesced run.

Tiling: a program owns a ``[BLOCK_M, GROUPS_K * 128]`` tile (GROUPS_K groups of BLOCK_M rows),
addressed as a ``[BLOCK_M, GROUPS_K, 128]`` block so each amax is an in-register reduction over the
last axis (no reshape, no layout shuffle); every load and store
is a run of whole 128-wide coalesced segments. Optionally persistent (a grid-stride loop over the
tiles). The tile and launch parameters are launcher keywords; `default_config` picks them from the
shape, and ``scripts/bench_kernels.py --sweep`` times the candidates in `SWEEP_CONFIGS`.
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
    num_sms,
    scale_buffer,
    to_scale_layout,
)

__all__ = ["quantize_1x128", "torch_quantize_1x128", "launch_quantize_1x128"]

OP = "jetrl::quantize_1x128"


@triton.jit
def _quantize_tile(
    x_ptr,
    q_ptr,
    s_ptr,
    pre_ptr,
    tile_m,
    tile_k,
    M,
    K,
    stride_xm,
    stride_qm,
    stride_sm,
    stride_sg,
    EPS: tl.constexpr,
    FP8_MAX: tl.constexpr,
    BLOCK_M: tl.constexpr,
    GROUP: tl.constexpr,
    GROUPS_K: tl.constexpr,
    STORE_PRECAST: tl.constexpr,
):
    # one [BLOCK_M, GROUPS_K * 128] tile: GROUPS_K groups of BLOCK_M rows, addressed as a
    # [BLOCK_M, GROUPS_K, 128] block (no reshape); returns its non-finite count
    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_g = tile_k * GROUPS_K + tl.arange(0, GROUPS_K)
    offs_k = offs_g[None, :, None] * GROUP + tl.arange(0, GROUP)[None, None, :]
    mask_m = offs_m < M
    mask = mask_m[:, None, None] & (offs_k < K)
    rows = offs_m.to(tl.int64)[:, None, None]

    # load; padding lanes read as 0 and cannot raise the amax
    x = tl.load(x_ptr + rows * stride_xm + offs_k, mask=mask, other=0.0).to(tl.float32)

    # scale per group: max(amax, eps) / 448, correctly rounded
    s = e4m3_scale(tl.max(tl.abs(x), axis=2), EPS, FP8_MAX)

    # quantize: true division, clamp, then the RNE cast
    y = e4m3_grid(x, s[:, :, None], FP8_MAX)
    tl.store(q_ptr + rows * stride_qm + offs_k, y.to(tl.float8e4nv), mask=mask)
    s_mask = mask_m[:, None] & (offs_g[None, :] * GROUP < K)
    tl.store(s_ptr + offs_m[:, None] * stride_sm + offs_g[None, :] * stride_sg, s, mask=s_mask)
    if STORE_PRECAST:
        tl.store(pre_ptr + rows * K + offs_k, y, mask=mask)
    # non-finite detection: exponent bits all ones
    return count_nonfinite(x)


@triton.jit
def _quantize_1x128_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    pre_ptr,
    flag_ptr,
    flag_slot,
    M,
    K,
    stride_xm,
    stride_qm,
    stride_sm,
    stride_sg,
    TILES_M,
    TILES_K,
    EPS: tl.constexpr,
    FP8_MAX: tl.constexpr,
    BLOCK_M: tl.constexpr,
    GROUP: tl.constexpr,
    GROUPS_K: tl.constexpr,
    PERSISTENT: tl.constexpr,
    STORE_PRECAST: tl.constexpr,
):
    if PERSISTENT:
        # grid-stride loop over the tiles, K-tiles of a row block adjacent
        n_bad = tl.full([], 0, tl.int32)
        for t in range(tl.program_id(0), TILES_M * TILES_K, tl.num_programs(0)):
            n_bad += _quantize_tile(
                x_ptr, q_ptr, s_ptr, pre_ptr, t // TILES_K, t % TILES_K, M, K, stride_xm, stride_qm, stride_sm,
                stride_sg, EPS, FP8_MAX, BLOCK_M, GROUP, GROUPS_K, STORE_PRECAST,
            )  # fmt: skip
    else:
        n_bad = _quantize_tile(
            x_ptr, q_ptr, s_ptr, pre_ptr, tl.program_id(0), tl.program_id(1), M, K, stride_xm, stride_qm, stride_sm,
            stride_sg, EPS, FP8_MAX, BLOCK_M, GROUP, GROUPS_K, STORE_PRECAST,
        )  # fmt: skip
    # one predicated flag store per program
    tl.store(flag_ptr + flag_slot, 1, mask=n_bad > 0)


@functools.lru_cache(maxsize=256)
def default_config(m: int, k: int) -> tuple[int, int, int, int, bool]:
    """``(block_m, groups_k, num_warps, num_stages, persistent)`` for an ``[m, k]`` input.

    A program quantizes a ``[block_m, groups_k * 128]`` tile. Last session's ``[32, 128]`` tiles
    (4 warps) reached 74% of copy bandwidth on the H200: too little work per program. Default:
    32 rows by up to 4 groups (``[32, 512]``, 32 KiB of bf16 per program) with 8 warps; narrower
    for small K (``groups_k`` is the power of two covering K, at most 4) and 16 rows when M is tiny.
    ``scripts/bench_kernels.py --sweep`` times the alternatives (``SWEEP_CONFIGS``).
    """
    g = groups(k)
    groups_k = min(4, triton.next_power_of_2(g))
    block_m = 16 if m <= 16 else 32
    num_warps = 8 if block_m * groups_k >= 64 else 4
    return block_m, groups_k, num_warps, 3, False


# candidate configs timed by `bench_kernels.py --sweep` (keyword arguments of the launcher)
SWEEP_CONFIGS = [
    dict(block_m=32, groups_k=1, num_warps=4),
    dict(block_m=64, groups_k=1, num_warps=8),
    dict(block_m=128, groups_k=1, num_warps=8),
    dict(block_m=16, groups_k=4, num_warps=4),
    dict(block_m=32, groups_k=2, num_warps=4),
    dict(block_m=32, groups_k=4, num_warps=8),
    dict(block_m=64, groups_k=2, num_warps=8),
    dict(block_m=64, groups_k=4, num_warps=8),
    dict(block_m=32, groups_k=8, num_warps=8),
    dict(block_m=32, groups_k=4, num_warps=8, persistent=True),
    dict(block_m=64, groups_k=2, num_warps=8, persistent=True),
]


def launch_quantize_1x128(
    x: torch.Tensor,
    scale_layout: str = "row",
    name: str = "x",
    precast: torch.Tensor | None = None,
    block_m: int | None = None,
    num_warps: int | None = None,
    groups_k: int | None = None,
    num_stages: int | None = None,
    persistent: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the Triton kernel.

    Input:  x ``[M, K]`` float32/bfloat16/float16, last-dim stride 1, any row stride.
    Output: q float8_e4m3fn ``[M, K]`` contiguous.
    scales: fp32 ``[M, ceil(K/128)]``; strides ``(G, 1)`` for ``"row"``, ``(1, align(M, 4))`` for ``"deepgemm"``.
    ``precast`` (tests only): an fp32 ``[M, K]`` contiguous buffer that receives the clamped ``x / s``
    values before the e4m3 cast, so a harness can apply a known-correct cast.
    Tiling (``None`` = `default_config`): a program owns ``[block_m, groups_k * 128]`` (both powers of
    two); ``persistent`` launches ``4 * SMs`` programs that loop over the tiles.
    """
    check_matrix(x, name, OP)
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
    bm, gk, nw, ns, pers = default_config(m, k)
    bm = bm if block_m is None else block_m
    gk = gk if groups_k is None else groups_k
    nw = nw if num_warps is None else num_warps
    ns = ns if num_stages is None else num_stages
    pers = pers if persistent is None else persistent
    flag, slot = nonfinite_flag(OP, name, x.device)
    tiles_m, tiles_k = triton.cdiv(m, bm), triton.cdiv(g, gk)
    grid = (min(tiles_m * tiles_k, 4 * num_sms(x.device)),) if pers else (tiles_m, tiles_k)
    _quantize_1x128_kernel[grid](
        x,
        q,
        s,
        precast if precast is not None else q,
        flag,
        slot,
        m,
        k,
        x.stride(0),
        q.stride(0),
        s.stride(0),
        s.stride(1),
        tiles_m,
        tiles_k,
        EPS=DEFAULT_EPS,
        FP8_MAX=E4M3_MAX,
        BLOCK_M=bm,
        GROUP=BLOCK,
        GROUPS_K=gk,
        PERSISTENT=pers,
        STORE_PRECAST=precast is not None,
        num_warps=nw,
        num_stages=ns,
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
