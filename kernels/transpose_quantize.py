"""Transpose-quantize for wgrad: ``X [M, K]`` -> ``X^T`` quantized 1x128 along the token axis.

wgrad computes ``dW += dY^T X`` with DeepGEMM's NT kernel, which wants both operands K-major where
K is now the token axis M: ``X^T [K, M]`` e4m3 with one fp32 scale per 128 consecutive tokens of a
column, ``s_t [K, ceil(M/128)]``. That is `jetrl.quant.quantize_128x1` (``quantize_1x128(x.t())``),
and `transpose_quantize` is bit-equal to it.

Kernel: a program loads a ``[128, BLOCK_K]`` tile of X (128 tokens — one group — by BLOCK_K
columns) with coalesced row reads, reduces the amax over the token axis (one scale per column),
divides with ``tl.math.div_rn``, clamps, casts, and stores the tile transposed at ``q_t[k, m]``
(Triton stages the transposed store through shared memory, so the writes are 128-byte rows too).
One read of X, one write of the bytes: no materialised ``X^T``.

`transpose_requantize` starts instead from a 1x128-quantized activation (``q [M, K]``,
``s [M, ceil(K/128)]``), for a trainer that saved only those bytes: it dequantizes in fp32 (``q * s``,
the product `jetrl.quant.dequantize_1x128` computes), then proceeds as above. jetrl's FP8 Linear does
not use it: it saves wgrad's 128x1 operand itself, quantized from the BF16 X in the forward (the same
memory), and so avoids the second rounding — the variant's EXTRA ERROR:

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

import torch
import triton
import triton.language as tl

from jetrl import quant
from jetrl.recipe import BLOCK, DEFAULT_EPS, E4M3_MAX

from ._runtime import abs_max, check_matrix, count_nonfinite, e4m3_grid, e4m3_scale, groups, nonfinite_flag

__all__ = [
    "transpose_quantize",
    "torch_transpose_quantize",
    "launch_transpose_quantize",
    "transpose_requantize",
    "torch_transpose_requantize",
    "launch_transpose_requantize",
]

OP = "jetrl::transpose_quantize"
OP_RE = "jetrl::transpose_requantize"


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
    BLOCK_K: tl.constexpr,
    K_FASTEST: tl.constexpr,
    TRANS: tl.constexpr,
    FROM_FP8: tl.constexpr,
    STORE_PRECAST: tl.constexpr,
    RCP: tl.constexpr,
):
    # 1-D grid over [128, BLOCK_K] tiles: K_FASTEST walks a 128-token band across K (reads of whole
    # rows in flight), else each column strip down the tokens (writes of whole q_t rows in flight)
    pid = tl.program_id(0)
    if K_FASTEST:
        n_k = tl.cdiv(K, BLOCK_K)
        pid_k = pid % n_k
        pid_m = pid // n_k
    else:
        pid_m = pid % GM
        pid_k = pid // GM
    offs_m = pid_m * GROUP + tl.arange(0, GROUP)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_k = offs_k < K
    mask = (offs_m[:, None] < M) & mask_k[None, :]
    rows = offs_m.to(tl.int64)[:, None]

    # load a [128 tokens, BLOCK_K] tile (row reads); padding tokens read 0
    x = tl.load(x_ptr + rows * stride_xm + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
    if FROM_FP8:
        # dequantize the saved 1x128 activation: fp32 q * s; BLOCK_K divides 128, so the whole
        # tile lies in one K group and needs one scale per row
        g_col = (pid_k * BLOCK_K) // GROUP
        xs = tl.load(xs_ptr + offs_m * stride_xsm + g_col * stride_xsg, mask=offs_m < M, other=0.0)
        x = x * xs[:, None]

    # one scale per column of the tile (a 128-token group of X^T's row k); the NaN-propagating
    # amax carries the non-finite test. Then: true division, clamp, RNE cast; store transposed at q_t[k, m]
    if TRANS:
        xt = tl.trans(x)
        amax = abs_max(xt, 1)
        s = e4m3_scale(amax, EPS, FP8_MAX)
        y = e4m3_grid(xt, s[:, None], FP8_MAX, RCP)
        dst = offs_k.to(tl.int64)[:, None] * M + offs_m[None, :]
        mask = tl.trans(mask)
    else:
        amax = abs_max(x, 0)
        s = e4m3_scale(amax, EPS, FP8_MAX)
        y = e4m3_grid(x, s[None, :], FP8_MAX, RCP)
        dst = offs_k.to(tl.int64)[None, :] * M + offs_m[:, None]
    tl.store(flag_ptr + flag_slot, 1, mask=count_nonfinite(amax) > 0)
    tl.store(qt_ptr + dst, y.to(tl.float8e4nv), mask=mask)
    tl.store(st_ptr + offs_k * GM + pid_m, s, mask=mask_k)
    if STORE_PRECAST:
        tl.store(pre_ptr + dst, y, mask=mask)


def _launch(x, xs, name, op, precast, block_k=64, num_warps=2, rcp=True, k_fastest=False, trans=False):
    m, k = x.shape
    gm = groups(m)
    dev = x.device
    q_t = torch.empty((k, m), dtype=quant.FP8_DTYPE, device=dev)
    s_t = torch.empty((k, gm), dtype=torch.float32, device=dev)
    if precast is not None:
        assert precast.shape == (k, m) and precast.dtype == torch.float32 and precast.is_contiguous(), (
            f"{op}: precast must be a contiguous float32 [{k}, {m}] buffer"
        )
    assert BLOCK % block_k == 0, f"{op}: block_k={block_k} must divide {BLOCK}"
    if x.numel() == 0:
        return q_t, s_t
    flag, slot = nonfinite_flag(op, name, dev)
    _transpose_quantize_kernel[(gm * triton.cdiv(k, block_k),)](
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
        BLOCK_K=block_k,
        K_FASTEST=bool(k_fastest),
        TRANS=bool(trans),
        FROM_FP8=xs is not None,
        STORE_PRECAST=precast is not None,
        RCP=bool(rcp),
        num_warps=num_warps,
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
    ``config`` (tuning; same bytes either way; defaults are the fastest of ``bench_kernels.py --sweep``
    on the H200): ``block_k`` (divides 128), ``num_warps``, ``rcp`` (per-group reciprocal division,
    `_runtime.e4m3_grid`), ``k_fastest`` (program order), ``trans`` (transpose the tile in registers
    before the reduction, so the amax runs along the stored axis).
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
