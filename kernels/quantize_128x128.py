"""128x128 weight quantization, optionally also returning the transposed bytes and scale grid.

Math: `jetrl.quant.quantize_128x128` — one scale per 128x128 block of ``W [N, K]``,
``s = max(amax, eps) / 448`` (``tl.math.div_rn``), ``q = e4m3_rne(clamp(w / s, -448, 448))``;
edge blocks take the amax of their valid elements only (masked lanes load 0).

Block quantization is transpose invariant (NUMERICS.md section 1): the bytes of ``W^T`` are the
transpose of the bytes of ``W`` and its scale grid is the transpose of W's. DGrad needs ``W^T``
K-major (DeepGEMM on sm_90 only has the NT layout), so ``with_transpose=True`` also returns
``q_t [K, N]`` and ``s_t``, with no second quantization: the quantize kernel writes ``s_t`` beside
``s`` and, for bfloat16/float16 input, stores each chunk's bytes a second time transposed at
``q_t[k, n]`` (one read of W, 4 bytes moved per element: 3386 GB/s at 16384x14336 on the H200,
80% of copy).

For float32 input (fp8_param's fp32 master weights) that second store miscompiles on Triton 3.6:
on the H200 25-37% of the q_t bytes come out wrong while q is right, whichever way the store is
written (an fp8 store at ``[k, n]``, ``tl.trans`` then a row store, either on the bytes bitcast to
uint8; with or without a barrier; sweep-15/16 in scripts/results/kernels-nvidia-h200.json). So for
float32 a separate byte-transpose kernel writes q_t from q (one extra read and write of N*K bytes;
weights are quantized once per optimizer step), and asking for the fused store with float32 input
raises.

Tiling: one program per 128x128 block, in two passes over CHUNK_N-row chunks (amax, then divide
and store; the second read hits L2), which keeps registers low enough for several programs per SM
(CHUNK_N = 128 holds the block in registers and reads it once; measured 0-4% slower on the H200).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jetrl import quant
from jetrl.recipe import BLOCK, DEFAULT_EPS, E4M3_MAX

from ._runtime import abs_max, check_matrix, count_nonfinite, e4m3_grid, e4m3_scale, groups, nonfinite_flag

__all__ = ["quantize_128x128", "torch_quantize_128x128", "launch_quantize_128x128"]

OP = "jetrl::quantize_128x128"


@triton.jit
def _quantize_128x128_kernel(
    w_ptr,
    q_ptr,
    qt_ptr,
    s_ptr,
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
    BLOCK: tl.constexpr,
    CHUNK_N: tl.constexpr,
    WITH_T: tl.constexpr,
    STORE_PRECAST: tl.constexpr,
    RCP: tl.constexpr,
    FUSED_T: tl.constexpr,
    K_FASTEST: tl.constexpr,
):
    # grid (NB, KB), or (KB, NB) with K_FASTEST (consecutive programs walk along K)
    if K_FASTEST:
        pid_k = tl.program_id(0)
        pid_n = tl.program_id(1)
    else:
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
    offs_k = pid_k * BLOCK + tl.arange(0, BLOCK)
    mask_k = offs_k < K

    # pass 1: amax of the block, CHUNK_N rows at a time (padding lanes read 0), NaN-propagating so
    # that it also carries the non-finite test; CHUNK_N == BLOCK keeps the block in registers
    amax = tl.zeros([CHUNK_N], dtype=tl.float32)
    w = tl.zeros([CHUNK_N, BLOCK], dtype=tl.float32)
    for c in range(0, BLOCK, CHUNK_N):
        offs_n = pid_n * BLOCK + c + tl.arange(0, CHUNK_N)
        mask = (offs_n[:, None] < N) & mask_k[None, :]
        w = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :], mask=mask, other=0.0)
        w = w.to(tl.float32)
        amax = tl.maximum(amax, abs_max(w, 1), propagate_nan=tl.PropagateNan.ALL)
    tl.store(flag_ptr + flag_slot, 1, mask=count_nonfinite(amax) > 0)

    # one scale per block, correctly rounded
    s = e4m3_scale(abs_max(amax, 0), EPS, FP8_MAX)
    tl.store(s_ptr + pid_n * KB + pid_k, s)
    if WITH_T:
        tl.store(st_ptr + pid_k * NB + pid_n, s)

    # pass 2: re-read the chunks (L2-resident) and quantize: true division, clamp, RNE cast
    for c in range(0, BLOCK, CHUNK_N):
        offs_n = pid_n * BLOCK + c + tl.arange(0, CHUNK_N)
        mask = (offs_n[:, None] < N) & mask_k[None, :]
        rows = offs_n.to(tl.int64)[:, None]
        if CHUNK_N < BLOCK:
            w = tl.load(w_ptr + rows * stride_wn + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
        y = e4m3_grid(w, s, FP8_MAX, RCP)
        tl.store(q_ptr + rows * K + offs_k[None, :], y.to(tl.float8e4nv), mask=mask)
        if FUSED_T:
            # the same bytes again at q_t[k, n] (Triton stages the transposed store through shared memory)
            tl.store(qt_ptr + offs_k.to(tl.int64)[None, :] * N + offs_n[:, None], y.to(tl.float8e4nv), mask=mask)
        if STORE_PRECAST:
            tl.store(pre_ptr + rows * K + offs_k[None, :], y, mask=mask)


@triton.jit
def _transpose_bytes_kernel(q_ptr, qt_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # q_t[k, n] = q[n, k] for a [BLOCK_N, BLOCK_K] tile of raw bytes
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
    b = tl.load(q_ptr + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :], mask=mask, other=0)
    tl.store(qt_ptr + offs_k.to(tl.int64)[None, :] * N + offs_n[:, None], b, mask=mask)


def launch_quantize_128x128(
    w: torch.Tensor,
    with_transpose: bool = False,
    name: str = "w",
    precast: torch.Tensor | None = None,
    num_warps: int | None = None,
    chunk_n: int = 64,
    rcp: bool = True,
    fused_t: bool | None = None,
    k_fastest: bool | None = None,
    t_block: int = 128,
    t_warps: int = 8,
) -> tuple[torch.Tensor, ...]:
    """Run the Triton kernel.

    Input:  w ``[N, K]`` float32/bfloat16/float16, last-dim stride 1, any row stride.
    Output: q float8_e4m3fn ``[N, K]`` contiguous; with_transpose: also q_t ``[K, N]`` contiguous (= q.t()).
    scales: fp32 ``[ceil(N/128), ceil(K/128)]`` contiguous; with_transpose: also s_t ``[ceil(K/128), ceil(N/128)]``.
    ``precast`` (tests only): fp32 ``[N, K]`` contiguous buffer receiving the clamped ``w / s`` before the cast.
    Tuning options (same bytes either way): ``num_warps``, ``chunk_n`` (rows per pass-1 load; 128 keeps
    the whole block in registers, one read), ``rcp`` (divide through the block's reciprocal),
    ``k_fastest`` (program order along K), ``fused_t`` (with_transpose only: the quantize kernel
    stores q_t itself; on by default for bfloat16/float16 input, refused for float32, which Triton 3.6
    miscompiles: see the module docstring), ``t_block`` / ``t_warps`` (square tile and warps of the
    separate byte transpose used without ``fused_t``). Defaults: the fastest of ``bench_kernels.py
    --sweep`` on the H200 (scripts/results/kernels-nvidia-h200.json): 64-row chunks; without the
    fused store 16 warps, K-fastest (sweep-17: 3945 vs 3650 GB/s at 16384x14336); with it 8 warps,
    N-fastest (sweep-15, sweep-17: 3393 vs 3351); byte transpose 128 with 8 warps (sweep-12).
    """
    check_matrix(w, name, OP)
    if fused_t is None:
        fused_t = w.dtype != torch.float32
    if fused_t and with_transpose and w.dtype == torch.float32:
        raise ValueError(
            f"{OP}: fused_t=True with float32 {name}: Triton 3.6 stores wrong q_t bytes for float32 input in "
            f"the fused kernel (measured on sm_90); use fused_t=False (the separate byte transpose)"
        )
    fused_t = bool(fused_t and with_transpose)
    if num_warps is None:
        num_warps = 8 if fused_t else 16
    if k_fastest is None:
        k_fastest = not fused_t
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
        _quantize_128x128_kernel[(kb, nb) if k_fastest else (nb, kb)](
            w,
            q,
            q_t,
            s,
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
            BLOCK=BLOCK,
            CHUNK_N=chunk_n,
            RCP=bool(rcp),
            WITH_T=with_transpose,
            STORE_PRECAST=precast is not None,
            FUSED_T=fused_t,
            K_FASTEST=bool(k_fastest),
            num_warps=num_warps,
        )
        if with_transpose and not fused_t:
            # float32 input: the bytes transposed by a second kernel (see the module docstring)
            _transpose_bytes_kernel[(triton.cdiv(n, t_block), triton.cdiv(k, t_block))](
                q.view(torch.uint8), q_t.view(torch.uint8), n, k, BLOCK_N=t_block, BLOCK_K=t_block, num_warps=t_warps
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
