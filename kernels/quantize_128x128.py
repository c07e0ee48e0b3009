"""128x128 weight quantization, optionally writing the transposed bytes in the same pass.

Math: `jetrl.quant.quantize_128x128` — one scale per 128x128 block of ``W [N, K]``,
``s = max(amax, eps) / 448`` (``tl.math.div_rn``), ``q = e4m3_rne(clamp(w / s, -448, 448))``;
edge blocks take the amax of their valid elements only (masked lanes load 0).

Block quantization is transpose invariant (NUMERICS.md section 1): the bytes of ``W^T`` are the
transpose of the bytes of ``W`` and its scale grid is the transpose of W's. DGrad needs ``W^T``
K-major (DeepGEMM on sm_90 only has the NT layout), so ``with_transpose=True`` makes each program
store its quantized tile twice — once at ``[n, k]`` and once at ``[k, n]`` (Triton routes the second
store through shared memory so both are coalesced) — and its scale at ``s[nb, kb]`` and
``s_t[kb, nb]``. One read of W, no second quantization.

Tiling: one program per 128x128 block (32 KiB of bf16 in registers across 8 warps).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jetrl import quant
from jetrl.recipe import BLOCK, DEFAULT_EPS, E4M3_MAX

from ._runtime import check_matrix, groups, nonfinite_flag

__all__ = ["quantize_128x128", "torch_quantize_128x128", "launch_quantize_128x128"]

OP = "jetrl::quantize_128x128"


@triton.jit
def _quantize_128x128_kernel(
    w_ptr,
    q_ptr,
    s_ptr,
    qt_ptr,
    st_ptr,
    pre_ptr,
    flag_ptr,
    flag_slot,
    N,
    K,
    stride_wn,
    NB,
    KB,
    EPS: tl.constexpr,
    FP8_MAX: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    WITH_T: tl.constexpr,
    STORE_PRECAST: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
    rows = offs_n.to(tl.int64)[:, None]

    # load the block; padding lanes read 0 and cannot raise the amax
    w = tl.load(w_ptr + rows * stride_wn + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
    aw = tl.abs(w)

    # non-finite detection (|w| < inf is false for NaN and +-Inf)
    n_bad = tl.sum(tl.sum(tl.where(aw < float("inf"), 0, 1), axis=1), axis=0)
    tl.store(flag_ptr + flag_slot, 1, mask=n_bad > 0)

    # one scale per block, correctly rounded
    amax = tl.max(tl.max(aw, axis=1), axis=0)
    s = tl.math.div_rn(tl.maximum(amax, EPS), FP8_MAX)

    # quantize: true division, clamp, RNE cast
    y = tl.math.div_rn(w, tl.full([BLOCK_N, BLOCK_K], 1.0, tl.float32) * s)
    y = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
    q = y.to(tl.float8e4nv)
    tl.store(q_ptr + rows * K + offs_k[None, :], q, mask=mask)
    tl.store(s_ptr + pid_n * KB + pid_k, s)
    if WITH_T:
        # the same bytes at [k, n] of the [K, N] transposed operand, and the transposed scale grid
        tl.store(qt_ptr + offs_k.to(tl.int64)[None, :] * N + offs_n[:, None], q, mask=mask)
        tl.store(st_ptr + pid_k * NB + pid_n, s)
    if STORE_PRECAST:
        tl.store(pre_ptr + rows * K + offs_k[None, :], y, mask=mask)


def launch_quantize_128x128(
    w: torch.Tensor,
    with_transpose: bool = False,
    name: str = "w",
    precast: torch.Tensor | None = None,
    num_warps: int = 8,
) -> tuple[torch.Tensor, ...]:
    """Run the Triton kernel.

    Input:  w ``[N, K]`` float32/bfloat16/float16, last-dim stride 1, any row stride.
    Output: q float8_e4m3fn ``[N, K]`` contiguous; with_transpose: also q_t ``[K, N]`` contiguous (= q.t()).
    scales: fp32 ``[ceil(N/128), ceil(K/128)]`` contiguous; with_transpose: also s_t ``[ceil(K/128), ceil(N/128)]``.
    ``precast`` (tests only): fp32 ``[N, K]`` contiguous buffer receiving the clamped ``w / s`` before the cast.
    """
    check_matrix(w, name, OP)
    n, k = w.shape
    nb, kb = groups(n), groups(k)
    dev = w.device
    q = torch.empty((n, k), dtype=quant.FP8_DTYPE, device=dev)
    s = torch.empty((nb, kb), dtype=torch.float32, device=dev)
    q_t = torch.empty((k, n), dtype=quant.FP8_DTYPE, device=dev) if with_transpose else q
    s_t = torch.empty((kb, nb), dtype=torch.float32, device=dev) if with_transpose else s
    if precast is not None:
        assert precast.shape == (n, k) and precast.dtype == torch.float32 and precast.is_contiguous(), (
            f"{OP}: precast must be a contiguous float32 [{n}, {k}] buffer"
        )
    if w.numel() != 0:
        flag, slot = nonfinite_flag(OP, name, dev)
        _quantize_128x128_kernel[(nb, kb)](
            w,
            q,
            s,
            q_t,
            s_t,
            precast if precast is not None else q,
            flag,
            slot,
            n,
            k,
            w.stride(0),
            nb,
            kb,
            EPS=DEFAULT_EPS,
            FP8_MAX=E4M3_MAX,
            BLOCK_N=BLOCK,
            BLOCK_K=BLOCK,
            WITH_T=with_transpose,
            STORE_PRECAST=precast is not None,
            num_warps=num_warps,
        )
    return (q, s, q_t, s_t) if with_transpose else (q, s)


def torch_quantize_128x128(
    w: torch.Tensor, *, with_transpose: bool = False, name: str = "w"
) -> tuple[torch.Tensor, ...]:
    """Reference: `jetrl.quant.quantize_128x128` (raises NonFiniteError at once); the transposed
    outputs are the contiguous transposes of its bytes and scales."""
    check_matrix(w, name, OP, inner_contiguous=False)
    q, s = quant.quantize_128x128(w, name=name)
    if with_transpose:
        # clone: for a single row/column block .t().contiguous() would alias q / s
        return q, s, q.t().contiguous().clone(), s.t().contiguous().clone()
    return q, s


@torch.library.custom_op(OP, mutates_args=(), device_types="cpu")
def _quantize_128x128_op(w: torch.Tensor, with_transpose: bool, name: str) -> list[torch.Tensor]:
    return list(torch_quantize_128x128(w, with_transpose=with_transpose, name=name))


@_quantize_128x128_op.register_kernel("cuda")
def _(w: torch.Tensor, with_transpose: bool, name: str) -> list[torch.Tensor]:
    return list(launch_quantize_128x128(w, with_transpose, name))


@_quantize_128x128_op.register_fake
def _(w: torch.Tensor, with_transpose: bool, name: str) -> list[torch.Tensor]:
    n, k = w.shape
    nb, kb = groups(n), groups(k)
    out = [w.new_empty((n, k), dtype=quant.FP8_DTYPE), w.new_empty((nb, kb), dtype=torch.float32)]
    if with_transpose:
        out += [w.new_empty((k, n), dtype=quant.FP8_DTYPE), w.new_empty((kb, nb), dtype=torch.float32)]
    return out


def quantize_128x128(w: torch.Tensor, *, with_transpose: bool = False, name: str = "w") -> tuple[torch.Tensor, ...]:
    """Quantize a weight ``[N, K]`` in 128x128 blocks (the `jetrl::quantize_128x128` op).

    Input:  w ``[N, K]`` float32/bfloat16/float16 (unit stride along K on CUDA).
    Output: ``(q, s)``: q float8_e4m3fn ``[N, K]`` contiguous, s fp32 ``[ceil(N/128), ceil(K/128)]``
    contiguous; with ``with_transpose=True`` also ``q_t = q.t()`` bytes contiguous ``[K, N]`` and
    ``s_t = s.t()`` contiguous, from the same pass.
    CUDA runs the Triton kernel (non-finite input sets the flag `check_nonfinite` reads); CPU runs
    `torch_quantize_128x128` (raises NonFiniteError at once).
    """
    check_matrix(w, name, OP, inner_contiguous=w.is_cuda)
    return tuple(_quantize_128x128_op(w, bool(with_transpose), name))
