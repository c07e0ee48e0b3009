"""Fused RMSNorm + 1x128 quantization (forward) and the RMSNorm backward.

Forward numerics are HF ``Qwen3RMSNorm`` / ``LlamaRMSNorm``::

    var  = mean(x_f32 ** 2, -1)                 # fp32
    rstd = rsqrt(var + eps)                     # fp32, returned [M] for the backward
    y    = weight * (x_f32 * rstd).to(x.dtype)  # computed in fp32, stored in x.dtype
    q, s = jetrl.quant.quantize_1x128(y)        # the next FP8 GEMM's input

One read of x and weight; y, q, s, rstd written once (y not at all with ``store_y=False``, the
rollout engine's launch: its qkv / gate_up take the bytes alone). The quantization is of the *stored* y (its
fp32 upcast), so ``(q, s)`` are bit-equal to ``quantize_1x128(y)`` of the kernel's own y. y itself
matches the eager HF module up to the fp32 reduction order of the variance and the rsqrt
implementation (at most a last-bit difference in x.dtype for a few elements); tests pin y with
dtype-paired tolerances and (q, s) bitwise.

Backward (fp32 math, outputs in the input dtypes), with ``xhat = x * rstd`` and ``g = dy * weight``::

    dx      = rstd * (g - xhat * mean(g * xhat, -1))
    dweight = sum_rows(dy * xhat.to(x.dtype))    # the rounded normalized value the forward multiplied

dweight is reduced in two deterministic stages: each program accumulates its rows in fp32 registers
and writes one partial row; the partials are summed in fp32 by torch.

The forward holds rows of up to 4096 in registers (``BLOCK_K = next_pow2(K)``, several rows per
program when K is small); longer rows go in two passes over 4096-wide chunks (sum of squares, then
normalize + quantize re-reading the chunk from L2), since a 16384-lane register row (K = 14336)
measured at most 2.7 TB/s on the H200 (the chunks 3.1). A tile is loaded as ``[rows, BLOCK_K/128,
128]`` so the per-group amax is a reduction along its last axis (no reshape of a loaded row).

`add_rmsnorm_quant` runs the same kernel on ``total = residual + x`` (each element added in fp32 and rounded
once to x.dtype, ties to even: eager torch's add) and also writes total, the residual stream out: what the
rollout engine's pre-norm add then `rmsnorm_quant` computed in two kernels (the add was a separate elementwise
kernel per norm, 68 launches and ~0.19 ms of an H200 decode step at batch 256 on the Llama-3.1-8B shape,
`rollout-mp-profile-nvidia-h200.json`). y / q / s are those of `rmsnorm_quant(total)` bit for bit (same
code, same reduction order). Forward only.

`rmsnorm_quant` is registered with autograd: the gradient of y flows to x and weight through
`rmsnorm_backward`; q, s and rstd are not differentiable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jetrl import quant
from jetrl.recipe import BLOCK, DEFAULT_EPS, E4M3_MAX

from ._runtime import (
    ROUND_MODES,
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
    round_to,
    scale_buffer,
    to_scale_layout,
)

__all__ = [
    "rmsnorm_quant",
    "add_rmsnorm_quant",
    "torch_add_rmsnorm_quant",
    "launch_add_rmsnorm_quant",
    "torch_rmsnorm",
    "torch_rmsnorm_quant",
    "launch_rmsnorm_quant",
    "rmsnorm_backward",
    "torch_rmsnorm_backward",
    "launch_rmsnorm_backward",
]

OP = "jetrl::rmsnorm_quant"
OP_ADD = "jetrl::add_rmsnorm_quant"
OP_BWD = "jetrl::rmsnorm_backward"


@triton.jit
def _norm_quant_chunk(
    x_raw,
    w,
    rstd,
    rows,
    cols,
    mask,
    offs_m,
    offs_g,
    mask_m,
    live,
    K,
    y_ptr,
    q_ptr,
    s_ptr,
    pre_ptr,
    stride_sm,
    stride_sg,
    EPS: tl.constexpr,
    FP8_MAX: tl.constexpr,
    GROUP: tl.constexpr,
    STORE_Y: tl.constexpr,
    STORE_PRECAST: tl.constexpr,
    RCP: tl.constexpr,
):
    # a [BLOCK_M rows, BLOCK_G groups, 128] tile: y = weight * (x * rstd).to(x.dtype), computed in
    # fp32 and stored in x.dtype
    x = x_raw.to(tl.float32)
    n = (x * rstd[:, None, None]).to(x_raw.dtype).to(tl.float32)
    y = (w[None, :, :] * n).to(x_raw.dtype)
    if STORE_Y:
        tl.store(y_ptr + rows * K + cols, y, mask=mask)
    yf = y.to(tl.float32)

    # 1x128 quantization of the stored y: the amax of each group is a reduction along the last axis
    # (NaN-propagating: it carries the non-finite test; NaN/Inf in x always reach y through rstd)
    amax = abs_max(yf, 2)
    s = e4m3_scale(amax, EPS, FP8_MAX)
    qv = e4m3_grid(yf, s[:, :, None], FP8_MAX, RCP)
    tl.store(q_ptr + rows * K + cols, qv.to(tl.float8e4nv), mask=mask)
    s_mask = mask_m[:, None] & (offs_g[None, :] * GROUP < K)
    tl.store(s_ptr + offs_m[:, None] * stride_sm + offs_g[None, :] * stride_sg, s, mask=s_mask)
    if STORE_PRECAST:
        tl.store(pre_ptr + rows * K + cols, qv, mask=mask)
    return count_nonfinite(tl.where(live[:, None], amax, 0.0))


@triton.jit
def _load_rows(x_ptr, r_ptr, sum_ptr, rows, cols, mask, stride_xm, stride_rm, K, HAS_RES: tl.constexpr,
               STORE_SUM: tl.constexpr, MODE: tl.constexpr):  # fmt: skip
    """A tile of x, or with HAS_RES of ``residual + x`` rounded to x.dtype as eager torch adds (stored to
    `sum_ptr` when STORE_SUM)."""
    x_raw = tl.load(x_ptr + rows * stride_xm + cols, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(r_ptr + rows * stride_rm + cols, mask=mask, other=0.0)
        x_raw = round_to(r.to(tl.float32) + x_raw.to(tl.float32), MODE).to(x_raw.dtype)
        if STORE_SUM:
            tl.store(sum_ptr + rows * K + cols, x_raw, mask=mask)
    return x_raw


@triton.jit(do_not_specialize_on_alignment=SCALE_STRIDE_UNALIGNED)
def _rmsnorm_quant_kernel(
    x_ptr,
    r_ptr,
    sum_ptr,
    w_ptr,
    y_ptr,
    q_ptr,
    s_ptr,
    rstd_ptr,
    pre_ptr,
    flag_ptr,
    flag_slot,
    live_ptr,
    M,
    K,
    stride_xm,
    stride_rm,
    stride_sm,
    stride_sg,
    rms_eps,
    EPS: tl.constexpr,
    FP8_MAX: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_G: tl.constexpr,
    GROUP: tl.constexpr,
    SINGLE: tl.constexpr,
    STORE_Y: tl.constexpr,
    STORE_PRECAST: tl.constexpr,
    RCP: tl.constexpr,
    HAS_RES: tl.constexpr,
    MODE: tl.constexpr,
    HAS_LIVE: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    live = live_row_mask(live_ptr, offs_m, mask_m, HAS_LIVE)
    rows = offs_m.to(tl.int64)[:, None, None]
    offs_c = tl.arange(0, GROUP)
    if SINGLE:
        # the whole row fits one tile: one read, kept in registers
        offs_g = tl.arange(0, BLOCK_G)
        cols2 = offs_g[:, None] * GROUP + offs_c[None, :]
        cols = cols2[None, :, :]
        mask = mask_m[:, None, None] & (cols < K)
        x_raw = _load_rows(x_ptr, r_ptr, sum_ptr, rows, cols, mask, stride_xm, stride_rm, K, HAS_RES, True, MODE)
        x = x_raw.to(tl.float32)
        # RMS statistics in fp32: var = sum(x^2) / K, rstd = rsqrt(var + eps)
        var = tl.math.div_rn(tl.sum(tl.sum(x * x, axis=2), axis=1), tl.full([BLOCK_M], K, tl.float32))
        rstd = tl.math.rsqrt(var + rms_eps)
        w = tl.load(w_ptr + cols2, mask=cols2 < K, other=0.0).to(tl.float32)
        n_bad = _norm_quant_chunk(
            x_raw, w, rstd, rows, cols, mask, offs_m, offs_g, mask_m, live, K, y_ptr, q_ptr, s_ptr, pre_ptr,
            stride_sm, stride_sg, EPS, FP8_MAX, GROUP, STORE_Y, STORE_PRECAST, RCP,
        )  # fmt: skip
    else:
        # long rows: pass 1 accumulates sum(x^2) over BLOCK_G-group chunks, pass 2 re-reads them (L2)
        acc = tl.zeros([BLOCK_M], dtype=tl.float32)
        for c in range(0, K, BLOCK_G * GROUP):
            cols = (c + tl.arange(0, BLOCK_G)[:, None] * GROUP + offs_c[None, :])[None, :, :]
            mask = mask_m[:, None, None] & (cols < K)
            x_raw = _load_rows(x_ptr, r_ptr, sum_ptr, rows, cols, mask, stride_xm, stride_rm, K, HAS_RES, False, MODE)
            x = x_raw.to(tl.float32)
            acc += tl.sum(tl.sum(x * x, axis=2), axis=1)
        var = tl.math.div_rn(acc, tl.full([BLOCK_M], K, tl.float32))
        rstd = tl.math.rsqrt(var + rms_eps)
        n_bad = tl.full([], 0, tl.int32)
        for c in range(0, K, BLOCK_G * GROUP):
            offs_g = c // GROUP + tl.arange(0, BLOCK_G)
            cols2 = offs_g[:, None] * GROUP + offs_c[None, :]
            cols = cols2[None, :, :]
            mask = mask_m[:, None, None] & (cols < K)
            x_raw = _load_rows(x_ptr, r_ptr, sum_ptr, rows, cols, mask, stride_xm, stride_rm, K, HAS_RES, True, MODE)
            w = tl.load(w_ptr + cols2, mask=cols2 < K, other=0.0).to(tl.float32)
            n_bad += _norm_quant_chunk(
                x_raw, w, rstd, rows, cols, mask, offs_m, offs_g, mask_m, live, K, y_ptr, q_ptr, s_ptr, pre_ptr,
                stride_sm, stride_sg, EPS, FP8_MAX, GROUP, STORE_Y, STORE_PRECAST, RCP,
            )  # fmt: skip
    tl.store(rstd_ptr + offs_m, rstd, mask=mask_m)
    tl.store(flag_ptr + flag_slot, 1, mask=n_bad > 0)


@triton.jit
def _rmsnorm_backward_kernel(
    dy_ptr,
    x_ptr,
    w_ptr,
    rstd_ptr,
    dx_ptr,
    dw_part_ptr,
    M,
    K,
    stride_dym,
    stride_xm,
    ROWS_PER_PROGRAM,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_k = tl.arange(0, BLOCK_K)
    mask_k = offs_k < K
    w = tl.load(w_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK_K], dtype=tl.float32)
    row_start = pid * ROWS_PER_PROGRAM
    row_end = tl.minimum(row_start + ROWS_PER_PROGRAM, M)
    row_start64 = row_start.to(tl.int64)
    for i in range(0, row_end - row_start):
        r = row_start64 + i
        # load one row of dy and x, and the saved rstd
        dy = tl.load(dy_ptr + r * stride_dym + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        x_raw = tl.load(x_ptr + r * stride_xm + offs_k, mask=mask_k, other=0.0)
        x = x_raw.to(tl.float32)
        rstd = tl.load(rstd_ptr + r)
        # dx = rstd * (g - xhat * mean(g * xhat)), g = dy * w
        xhat = x * rstd
        g = dy * w
        c = tl.math.div_rn(tl.sum(g * xhat, axis=0), tl.full([], K, tl.float32))
        dx = rstd * (g - xhat * c)
        tl.store(dx_ptr + r * K + offs_k, dx.to(x_raw.dtype), mask=mask_k)
        # dweight partial: dy * (x * rstd).to(x.dtype)
        dw_acc += dy * xhat.to(x_raw.dtype).to(tl.float32)
    tl.store(dw_part_ptr + pid.to(tl.int64) * K + offs_k, dw_acc, mask=mask_k)


def _fwd_config(k: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_K, num_warps), the fastest of ``bench_kernels.py --sweep`` on the H200: rows up
    to MAX_SINGLE_K stay in registers (4096-element tiles, 4 warps: 3.57 TB/s at K = 4096); longer
    rows are processed in MAX_SINGLE_K chunks with 8 warps (a 16384-lane register row measured
    1.4-2.7 TB/s at K = 14336, the chunks 3.1)."""
    if k <= MAX_SINGLE_K:
        block_k = max(BLOCK, triton.next_power_of_2(k))
        return max(1, MAX_SINGLE_K // block_k), block_k, 4
    return 1, MAX_SINGLE_K, 8


MAX_SINGLE_K = 4096


def launch_rmsnorm_quant(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    scale_layout: str = "row",
    name: str = "x",
    precast: torch.Tensor | None = None,
    store_y: bool = True,
    live: torch.Tensor | None = None,
    **config,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the fused forward kernel.

    Input:  x ``[M, K]`` float32/bfloat16/float16, last-dim stride 1; weight ``[K]`` contiguous, any float dtype.
    Output: y ``[M, K]`` x.dtype contiguous (None with ``store_y=False``: the kernel computes y and quantizes
    it but does not write it, for a consumer of the bytes alone, the rollout engine's qkv / gate_up);
    q float8_e4m3fn ``[M, K]`` contiguous; rstd fp32 ``[M]``.
    scales: fp32 ``[M, ceil(K/128)]``, strides ``(G, 1)`` (``"row"``) or ``(1, align(M, 4))`` (``"deepgemm"``).
    ``precast`` (tests only): fp32 ``[M, K]`` buffer receiving the clamped ``y / s`` before the cast.
    ``config``: launch overrides ``block_m``, ``block_k`` (a power of two >= 128: rows up to it stay in
    registers, longer rows go in chunks of it), ``num_warps`` (these three change the fp32 reduction
    order of the variance, so y may move by an ulp), and ``rcp`` (default on: divide through the
    per-group reciprocal, `_runtime.e4m3_grid`; same bytes). ``live``: an integer ``[M]`` tensor (vLLM's slot
    mapping): only rows whose entry is >= 0 set the non-finite flag (`_runtime.check_live`); the same bytes.
    """
    return _launch(x, None, weight, eps, scale_layout, name, precast, store_y, live, config)[:4]


def launch_add_rmsnorm_quant(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    scale_layout: str = "row",
    name: str = "x",
    precast: torch.Tensor | None = None,
    store_y: bool = True,
    live: torch.Tensor | None = None,
    **config,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`launch_rmsnorm_quant` of ``residual + x`` (added in x.dtype as eager torch adds, rounded once), in the
    same kernel: ``(y, q, s, sum)``, the sum ``[M, K]`` x.dtype contiguous (the residual stream out).
    `residual`: x's shape and dtype, last-dim stride 1."""
    check_matrix(residual, f"{name} (residual)", OP_ADD)
    _check_residual(x, residual, name)
    y, q, s, _, total = _launch(x, residual, weight, eps, scale_layout, name, precast, store_y, live, config)
    return y, q, s, total


def _launch(x, residual, weight, eps, scale_layout, name, precast, store_y, live, config):
    """(y or None, q, s, rstd, residual + x or None) of one `_rmsnorm_quant_kernel` launch."""
    op = OP if residual is None else OP_ADD
    check_matrix(x, name, op)
    check_live(live, x.shape[0], x, name, op)
    _check_weight(weight, x, name)
    assert scale_layout in SCALE_LAYOUTS, f"{op}: scale_layout={scale_layout!r}, choose one of {SCALE_LAYOUTS}"
    m, k = x.shape
    dev = x.device
    y = torch.empty((m, k), dtype=x.dtype, device=dev) if store_y else None
    q = torch.empty((m, k), dtype=quant.FP8_DTYPE, device=dev)
    s = scale_buffer(m, groups(k), scale_layout, dev)
    rstd = torch.empty((m,), dtype=torch.float32, device=dev)
    total = None if residual is None else torch.empty((m, k), dtype=x.dtype, device=dev)
    if precast is not None:
        assert precast.shape == (m, k) and precast.dtype == torch.float32 and precast.is_contiguous(), (
            f"{op}: precast must be a contiguous float32 [{m}, {k}] buffer"
        )
    unknown = set(config) - {"block_m", "block_k", "num_warps", "rcp"}
    assert not unknown, f"{op}: unknown launch options {sorted(unknown)}; use block_m, block_k, num_warps, rcp"
    if x.numel() == 0:
        return y, q, s, rstd, total
    block_m, block_k, num_warps = _fwd_config(k)
    block_m = config.get("block_m", block_m)
    block_k = config.get("block_k", block_k)
    num_warps = config.get("num_warps", num_warps)
    rcp = bool(config.get("rcp", True))
    assert block_k >= BLOCK and block_k & (block_k - 1) == 0, f"{op}: block_k={block_k}: a power of two >= {BLOCK}"
    single = block_k >= k
    flag, slot = nonfinite_flag(op, name, dev)
    _rmsnorm_quant_kernel[(triton.cdiv(m, block_m),)](
        x,
        x if residual is None else residual,
        q if total is None else total,
        weight,
        y if store_y else q,
        q,
        s,
        rstd,
        precast if precast is not None else q,
        flag,
        slot,
        live if live is not None else flag,
        m,
        k,
        x.stride(0),
        x.stride(0) if residual is None else residual.stride(0),
        s.stride(0),
        s.stride(1),
        float(eps),
        EPS=DEFAULT_EPS,
        FP8_MAX=E4M3_MAX,
        BLOCK_M=block_m,
        BLOCK_G=block_k // BLOCK,
        GROUP=BLOCK,
        SINGLE=single,
        STORE_Y=bool(store_y),
        STORE_PRECAST=precast is not None,
        RCP=rcp,
        HAS_RES=residual is not None,
        MODE=ROUND_MODES[x.dtype],
        HAS_LIVE=live is not None,
        num_warps=num_warps,
    )
    return y, q, s, rstd, total


def launch_rmsnorm_backward(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, num_programs: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the backward kernel.

    Input:  dy, x ``[M, K]`` (same dtype, last-dim stride 1); weight ``[K]`` contiguous; rstd fp32 ``[M]`` contiguous.
    Output: dx ``[M, K]`` x.dtype contiguous; dweight ``[K]`` weight.dtype (fp32 partials summed in fp32).
    """
    _check_backward(dy, x, weight, rstd)
    m, k = x.shape
    dev = x.device
    dx = torch.empty((m, k), dtype=x.dtype, device=dev)
    if x.numel() == 0:
        return dx, torch.zeros_like(weight)
    if num_programs is None:
        sms = torch.cuda.get_device_properties(dev).multi_processor_count if x.is_cuda else 4
        num_programs = 4 * sms
    rows_per = triton.cdiv(m, min(num_programs, m))
    n_prog = triton.cdiv(m, rows_per)
    block_k = max(BLOCK, triton.next_power_of_2(k))
    part = torch.empty((n_prog, k), dtype=torch.float32, device=dev)
    _rmsnorm_backward_kernel[(n_prog,)](
        dy,
        x,
        weight,
        rstd,
        dx,
        part,
        m,
        k,
        dy.stride(0),
        x.stride(0),
        rows_per,
        BLOCK_K=block_k,
        num_warps=16 if block_k >= 8192 else 8,
    )
    return dx, part.sum(0).to(weight.dtype)


def _check_weight(weight: torch.Tensor, x: torch.Tensor, name: str) -> None:
    k = x.shape[1]
    if weight.dim() != 1 or weight.shape[0] != k or not weight.is_floating_point():
        raise ValueError(
            f"{OP}: weight for {name} must be a float [{k}] vector, got {weight.dtype} {tuple(weight.shape)}"
        )
    if weight.device != x.device:
        raise ValueError(f"{OP}: weight on {weight.device} but {name} on {x.device}")
    if x.is_cuda and weight.stride(0) != 1:
        raise ValueError(f"{OP}: weight for {name} must be contiguous")


def _check_residual(x: torch.Tensor, residual: torch.Tensor, name: str) -> None:
    if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
        raise ValueError(
            f"{OP_ADD}: residual {residual.dtype} {tuple(residual.shape)} on {residual.device} must match {name} "
            f"{x.dtype} {tuple(x.shape)} on {x.device}"
        )


def _check_backward(dy, x, weight, rstd) -> None:
    check_matrix(x, "x", OP_BWD)
    check_matrix(dy, "dy", OP_BWD)
    if dy.shape != x.shape or dy.dtype != x.dtype:
        raise ValueError(f"{OP_BWD}: dy {dy.dtype} {tuple(dy.shape)} must match x {x.dtype} {tuple(x.shape)}")
    _check_weight(weight, x, "x")
    if rstd.dtype != torch.float32 or tuple(rstd.shape) != (x.shape[0],) or not rstd.is_contiguous():
        raise ValueError(
            f"{OP_BWD}: rstd must be contiguous float32 [{x.shape[0]}], got {rstd.dtype} {tuple(rstd.shape)}"
        )


def torch_rmsnorm_quant(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, scale_layout: str = "row", name: str = "x"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference: eager HF RMSNorm numerics, then `jetrl.quant.quantize_1x128` of y (raises
    NonFiniteError at once, on x or on y). Same signature and layouts as `rmsnorm_quant`."""
    check_matrix(x, name, OP, inner_contiguous=False)
    _check_weight(weight, x, name)
    if scale_layout not in SCALE_LAYOUTS:
        raise ValueError(f"{OP}: scale_layout={scale_layout!r}, choose one of {SCALE_LAYOUTS}")
    quant.check_finite(x, name)
    y, rstd = torch_rmsnorm(x, weight, eps)
    q, s = quant.quantize_1x128(y, name=f"{name} (rmsnorm output)")
    return y, q, to_scale_layout(s, scale_layout), rstd.squeeze(-1)


def torch_add_rmsnorm_quant(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    scale_layout: str = "row",
    name: str = "x",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference: ``total = residual + x`` in eager torch, then `torch_rmsnorm_quant` of it: (y, q, s, total)."""
    _check_residual(x, residual, name)
    total = residual + x
    y, q, s, _ = torch_rmsnorm_quant(total, weight, eps, scale_layout=scale_layout, name=name)
    return y, q, s, total


def torch_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager HF Llama/Qwen RMSNorm of the last dim, any leading shape: (``weight * (x_f32 * rstd).to(x.dtype)``
    in x.dtype, rstd ``[..., 1]`` fp32) -- transformers' formula, the reference of the fused kernel."""
    xf = x.to(torch.float32)
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * (xf * rstd).to(x.dtype)).to(x.dtype), rstd


def torch_rmsnorm_backward(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference backward in fp32 torch (the module docstring's formulas); dx in x.dtype, dweight in weight.dtype."""
    _check_backward(dy, x, weight, rstd)
    xhat = x.to(torch.float32) * rstd[:, None]
    g = dy.to(torch.float32) * weight.to(torch.float32)
    dx = rstd[:, None] * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    dw = (dy.to(torch.float32) * xhat.to(x.dtype).to(torch.float32)).sum(0)
    return dx.to(x.dtype), dw.to(weight.dtype)


@torch.library.custom_op(OP, mutates_args=(), device_types="cpu")
def _rmsnorm_quant_op(
    x: torch.Tensor, weight: torch.Tensor, eps: float, scale_layout: str, name: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch_rmsnorm_quant(x, weight, eps, scale_layout=scale_layout, name=name)


@_rmsnorm_quant_op.register_kernel("cuda")
def _(x, weight, eps, scale_layout, name):
    return launch_rmsnorm_quant(x, weight, eps, scale_layout, name)


@_rmsnorm_quant_op.register_fake
def _(x, weight, eps, scale_layout, name):
    m, k = x.shape
    return (
        torch.empty_like(x, memory_format=torch.contiguous_format),
        x.new_empty((m, k), dtype=quant.FP8_DTYPE),
        scale_buffer(m, groups(k), scale_layout, x.device),
        x.new_empty((m,), dtype=torch.float32),
    )


@torch.library.custom_op(OP_ADD, mutates_args=(), device_types="cpu")
def _add_rmsnorm_quant_op(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, scale_layout: str, name: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch_add_rmsnorm_quant(x, residual, weight, eps, scale_layout=scale_layout, name=name)


@_add_rmsnorm_quant_op.register_kernel("cuda")
def _(x, residual, weight, eps, scale_layout, name):
    return launch_add_rmsnorm_quant(x, residual, weight, eps, scale_layout, name)


@_add_rmsnorm_quant_op.register_fake
def _(x, residual, weight, eps, scale_layout, name):
    m, k = x.shape
    return (
        torch.empty_like(x, memory_format=torch.contiguous_format),
        x.new_empty((m, k), dtype=quant.FP8_DTYPE),
        scale_buffer(m, groups(k), scale_layout, x.device),
        torch.empty_like(x, memory_format=torch.contiguous_format),
    )


@torch.library.custom_op(OP_BWD, mutates_args=(), device_types="cpu")
def _rmsnorm_backward_op(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch_rmsnorm_backward(dy, x, weight, rstd)


@_rmsnorm_backward_op.register_kernel("cuda")
def _(dy, x, weight, rstd):
    return launch_rmsnorm_backward(dy, x, weight, rstd)


@_rmsnorm_backward_op.register_fake
def _(dy, x, weight, rstd):
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(weight)


def _setup_context(ctx, inputs, output):
    x, weight, _, _, _ = inputs
    ctx.save_for_backward(x, weight, output[3])


def _backward(ctx, dy, dq, ds, drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = _rmsnorm_backward_op(dy.contiguous(), x, weight, rstd)
    return dx, dw, None, None, None


_rmsnorm_quant_op.register_autograd(_backward, setup_context=_setup_context)


def rmsnorm_quant(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, scale_layout: str = "row", name: str = "x"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused RMSNorm (HF numerics) + 1x128 quantization of its output (the `jetrl::rmsnorm_quant` op).

    Input:  x ``[M, K]`` float32/bfloat16/float16 (unit stride along K on CUDA); weight ``[K]``; eps float.
    Output: y ``[M, K]`` x.dtype; q float8_e4m3fn ``[M, K]`` = quantize_1x128(y) bytes; rstd fp32 ``[M]``.
    scales: fp32 ``[M, ceil(K/128)]``, ``"row"`` (default) or ``"deepgemm"`` strides ``(1, align(M, 4))``.
    Differentiable in y (to x and weight, via `rmsnorm_backward`).
    """
    check_matrix(x, name, OP, inner_contiguous=x.is_cuda)
    _check_weight(weight, x, name)
    if scale_layout not in SCALE_LAYOUTS:
        raise ValueError(f"{OP}: scale_layout={scale_layout!r}, choose one of {SCALE_LAYOUTS}")
    return _rmsnorm_quant_op(x, weight, float(eps), scale_layout, name)


def add_rmsnorm_quant(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    scale_layout: str = "row",
    name: str = "x",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`rmsnorm_quant` of ``total = residual + x`` in one kernel (the `jetrl::add_rmsnorm_quant` op, forward
    only: the rollout engine's pre-norm residual add, `jetrl.rollout.vllm_model`): ``(y, q, s, total)``, total
    bit-equal to eager torch's ``residual + x``, y / q / s what `rmsnorm_quant` gives for total.

    Input:  x, residual ``[M, K]`` one float dtype (unit stride along K on CUDA); weight ``[K]``; eps float.
    """
    check_matrix(x, name, OP_ADD, inner_contiguous=x.is_cuda)
    check_matrix(residual, f"{name} (residual)", OP_ADD, inner_contiguous=x.is_cuda)
    _check_weight(weight, x, name)
    if scale_layout not in SCALE_LAYOUTS:
        raise ValueError(f"{OP_ADD}: scale_layout={scale_layout!r}, choose one of {SCALE_LAYOUTS}")
    return _add_rmsnorm_quant_op(x, residual, weight, float(eps), scale_layout, name)


def rmsnorm_backward(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm backward (the `jetrl::rmsnorm_backward` op): ``(dx [M, K] x.dtype, dweight [K] weight.dtype)``."""
    return _rmsnorm_backward_op(dy, x, weight, rstd)
