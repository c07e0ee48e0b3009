"""Fused SwiGLU + 1x128 quantization (the down_proj input), and the SwiGLU backward.

Forward numerics are HF's ``act_fn(gate) * up`` in the input dtype (``F.silu(gate) * up``)::

    a    = silu(gate_f32).to(dtype)            # silu(g) = g / (1 + exp(-g)), fp32 (torch's opmath)
    h    = (a.to(f32) * up.to(f32)).to(dtype)  # one rounding, as torch's elementwise mul does
    q, s = jetrl.quant.quantize_1x128(h)

One read of gate and up; h, q, s written once (h not at all with ``store_h=False``, the rollout
engine's launch: its down_proj takes the bytes alone). ``(q, s)`` are bit-equal to ``quantize_1x128(h)`` of
the kernel's own h; h matches eager torch up to the exp implementation (Triton's ``exp`` vs CUDA's
``expf``: at most a last-bit difference in dtype for rare elements), pinned by dtype-paired
tolerances in the tests.

Backward (fp32 math, outputs in the input dtype), with ``sg = sigmoid(gate)``::

    dup   = dh * silu(gate)
    dgate = dh * up * sg * (1 + gate * (1 - sg))

gate and up may be column slices of one fused ``[M, 2N]`` gate_up projection (any row stride, unit
inner stride). Tiles are ``[BLOCK_M, 128]`` (one group of BLOCK_M rows), like `quantize_1x128`.
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

__all__ = [
    "swiglu_quant",
    "torch_swiglu_quant",
    "launch_swiglu_quant",
    "swiglu_backward",
    "torch_swiglu_backward",
    "launch_swiglu_backward",
]

OP = "jetrl::swiglu_quant"
OP_BWD = "jetrl::swiglu_backward"


@triton.jit
def _silu_f32(g):
    # g / (1 + exp(-g)), correctly rounded division
    return tl.math.div_rn(g, 1.0 + tl.exp(-g))


@triton.jit(do_not_specialize_on_alignment=SCALE_STRIDE_UNALIGNED)
def _swiglu_quant_kernel(
    g_ptr,
    u_ptr,
    h_ptr,
    q_ptr,
    s_ptr,
    pre_ptr,
    flag_ptr,
    flag_slot,
    live_ptr,
    M,
    N,
    stride_gm,
    stride_um,
    stride_sm,
    stride_sg,
    EPS: tl.constexpr,
    FP8_MAX: tl.constexpr,
    BLOCK_M: tl.constexpr,
    GROUP: tl.constexpr,
    STORE_H: tl.constexpr,
    STORE_PRECAST: tl.constexpr,
    RCP: tl.constexpr,
    HAS_LIVE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_g = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_g * GROUP + tl.arange(0, GROUP)
    mask_m = offs_m < M
    mask = mask_m[:, None] & (offs_n[None, :] < N)
    rows = offs_m.to(tl.int64)[:, None]

    # load gate and up; padding lanes read 0 (silu(0) * 0 = 0 cannot raise the amax)
    g_raw = tl.load(g_ptr + rows * stride_gm + offs_n[None, :], mask=mask, other=0.0)
    u = tl.load(u_ptr + rows * stride_um + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)

    # h = silu(gate).to(dtype) * up, rounded to dtype
    a = _silu_f32(g_raw.to(tl.float32)).to(g_raw.dtype).to(tl.float32)
    h = (a * u).to(g_raw.dtype)
    if STORE_H:
        tl.store(h_ptr + rows * N + offs_n[None, :], h, mask=mask)
    hf = h.to(tl.float32)

    # 1x128 quantization of the stored h; its NaN-propagating amax carries the non-finite test
    # (NaN/Inf in gate or up always reach h: silu(+-inf) is inf/NaN, and 0 * inf is NaN)
    amax = abs_max(hf, 1)
    live = live_row_mask(live_ptr, offs_m, mask_m, HAS_LIVE)
    tl.store(flag_ptr + flag_slot, 1, mask=count_nonfinite(tl.where(live, amax, 0.0)) > 0)
    s = e4m3_scale(amax, EPS, FP8_MAX)
    y = e4m3_grid(hf, s[:, None], FP8_MAX, RCP)
    tl.store(q_ptr + rows * N + offs_n[None, :], y.to(tl.float8e4nv), mask=mask)
    tl.store(s_ptr + offs_m * stride_sm + pid_g * stride_sg, s, mask=mask_m)
    if STORE_PRECAST:
        tl.store(pre_ptr + rows * N + offs_n[None, :], y, mask=mask)


@triton.jit
def _swiglu_backward_kernel(
    dh_ptr,
    g_ptr,
    u_ptr,
    dg_ptr,
    du_ptr,
    M,
    N,
    stride_dhm,
    stride_gm,
    stride_um,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    rows = offs_m.to(tl.int64)[:, None]

    # load dh, gate, up
    dh = tl.load(dh_ptr + rows * stride_dhm + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    g_raw = tl.load(g_ptr + rows * stride_gm + offs_n[None, :], mask=mask, other=0.0)
    g = g_raw.to(tl.float32)
    u = tl.load(u_ptr + rows * stride_um + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)

    # dup = dh * silu(g); dgate = dh * up * sg * (1 + g * (1 - sg))
    sg = tl.math.div_rn(tl.full([BLOCK_M, BLOCK_N], 1.0, tl.float32), 1.0 + tl.exp(-g))
    du = dh * (g * sg)
    dg = dh * u * sg * (1.0 + g * (1.0 - sg))
    tl.store(du_ptr + rows * N + offs_n[None, :], du.to(g_raw.dtype), mask=mask)
    tl.store(dg_ptr + rows * N + offs_n[None, :], dg.to(g_raw.dtype), mask=mask)


def _check_pair(gate: torch.Tensor, up: torch.Tensor, op: str, inner_contiguous: bool, names=("gate", "up")) -> None:
    check_matrix(gate, names[0], op, inner_contiguous=inner_contiguous)
    check_matrix(up, names[1], op, inner_contiguous=inner_contiguous)
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device:
        raise ValueError(
            f"{op}: {names[0]} {gate.dtype} {tuple(gate.shape)} on {gate.device} and {names[1]} {up.dtype} "
            f"{tuple(up.shape)} on {up.device} must match"
        )


def launch_swiglu_quant(
    gate: torch.Tensor,
    up: torch.Tensor,
    scale_layout: str = "row",
    name: str = "x",
    precast: torch.Tensor | None = None,
    block_m: int = 16,
    num_warps: int = 4,
    rcp: bool = True,
    store_h: bool = True,
    live: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Run the fused forward kernel.

    Input:  gate, up ``[M, N]`` same float dtype, last-dim stride 1, any row strides.
    Output: h ``[M, N]`` dtype contiguous (None with ``store_h=False``: the kernel computes h and
    quantizes it but does not write it, for a consumer of the bytes alone, the rollout engine's
    down_proj); q float8_e4m3fn ``[M, N]`` contiguous.
    scales: fp32 ``[M, ceil(N/128)]``, strides ``(G, 1)`` (``"row"``) or ``(1, align(M, 4))`` (``"deepgemm"``).
    ``precast`` (tests only): fp32 ``[M, N]`` buffer receiving the clamped ``h / s`` before the cast.
    ``rcp``: divide through the per-group reciprocal (`_runtime.e4m3_grid`; same bytes; default: it
    measured faster on the H200). ``live``: an integer ``[M]`` tensor (vLLM's slot mapping): only rows whose
    entry is >= 0 set the non-finite flag (`_runtime.check_live`); the bytes are the same.
    """
    _check_pair(gate, up, OP, True)
    check_live(live, gate.shape[0], gate, name, OP)
    assert scale_layout in SCALE_LAYOUTS, f"{OP}: scale_layout={scale_layout!r}, choose one of {SCALE_LAYOUTS}"
    m, n = gate.shape
    dev = gate.device
    h = torch.empty((m, n), dtype=gate.dtype, device=dev) if store_h else None
    q = torch.empty((m, n), dtype=quant.FP8_DTYPE, device=dev)
    s = scale_buffer(m, groups(n), scale_layout, dev)
    if precast is not None:
        assert precast.shape == (m, n) and precast.dtype == torch.float32 and precast.is_contiguous(), (
            f"{OP}: precast must be a contiguous float32 [{m}, {n}] buffer"
        )
    if gate.numel() == 0:
        return h, q, s
    flag, slot = nonfinite_flag(OP, name, dev)
    _swiglu_quant_kernel[(triton.cdiv(m, block_m), groups(n))](
        gate,
        up,
        h if store_h else q,
        q,
        s,
        precast if precast is not None else q,
        flag,
        slot,
        live if live is not None else flag,
        m,
        n,
        gate.stride(0),
        up.stride(0),
        s.stride(0),
        s.stride(1),
        EPS=DEFAULT_EPS,
        FP8_MAX=E4M3_MAX,
        BLOCK_M=block_m,
        GROUP=BLOCK,
        STORE_H=bool(store_h),
        STORE_PRECAST=precast is not None,
        RCP=bool(rcp),
        HAS_LIVE=live is not None,
        num_warps=num_warps,
    )
    return h, q, s


def launch_swiglu_backward(
    dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, block_m: int = 32, num_warps: int = 4
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the backward kernel.

    Input:  dh, gate, up ``[M, N]`` same float dtype, last-dim stride 1.
    Output: dgate, dup ``[M, N]`` dtype contiguous.
    """
    _check_pair(gate, up, OP_BWD, True)
    _check_pair(dh, gate, OP_BWD, True, names=("dh", "gate"))
    m, n = gate.shape
    dg = torch.empty((m, n), dtype=gate.dtype, device=gate.device)
    du = torch.empty_like(dg)
    if gate.numel() == 0:
        return dg, du
    _swiglu_backward_kernel[(triton.cdiv(m, block_m), groups(n))](
        dh,
        gate,
        up,
        dg,
        du,
        m,
        n,
        dh.stride(0),
        gate.stride(0),
        up.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=BLOCK,
        num_warps=num_warps,
    )
    return dg, du


def torch_swiglu_quant(
    gate: torch.Tensor, up: torch.Tensor, *, scale_layout: str = "row", name: str = "x"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference: eager ``F.silu(gate) * up`` in the input dtype, then `jetrl.quant.quantize_1x128`
    (raises NonFiniteError at once). Same signature and layouts as `swiglu_quant`."""
    _check_pair(gate, up, OP, False)
    if scale_layout not in SCALE_LAYOUTS:
        raise ValueError(f"{OP}: scale_layout={scale_layout!r}, choose one of {SCALE_LAYOUTS}")
    quant.check_finite(gate, f"{name} (swiglu gate)")
    quant.check_finite(up, f"{name} (swiglu up)")
    h = torch.nn.functional.silu(gate) * up
    q, s = quant.quantize_1x128(h, name=name)
    return h, q, to_scale_layout(s, scale_layout)


def torch_swiglu_backward(dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference backward in fp32 torch (the module docstring's formulas), outputs in the input dtype."""
    _check_pair(gate, up, OP_BWD, False)
    _check_pair(dh, gate, OP_BWD, False, names=("dh", "gate"))
    g, u, d = gate.to(torch.float32), up.to(torch.float32), dh.to(torch.float32)
    sg = torch.sigmoid(g)
    return (d * u * sg * (1.0 + g * (1.0 - sg))).to(gate.dtype), (d * (g * sg)).to(gate.dtype)


@torch.library.custom_op(OP, mutates_args=(), device_types="cpu")
def _swiglu_quant_op(
    gate: torch.Tensor, up: torch.Tensor, scale_layout: str, name: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch_swiglu_quant(gate, up, scale_layout=scale_layout, name=name)


@_swiglu_quant_op.register_kernel("cuda")
def _(gate, up, scale_layout, name):
    return launch_swiglu_quant(gate, up, scale_layout, name)


@_swiglu_quant_op.register_fake
def _(gate, up, scale_layout, name):
    m, n = gate.shape
    return (
        gate.new_empty((m, n)),
        gate.new_empty((m, n), dtype=quant.FP8_DTYPE),
        scale_buffer(m, groups(n), scale_layout, gate.device),
    )


@torch.library.custom_op(OP_BWD, mutates_args=(), device_types="cpu")
def _swiglu_backward_op(dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch_swiglu_backward(dh, gate, up)


@_swiglu_backward_op.register_kernel("cuda")
def _(dh, gate, up):
    return launch_swiglu_backward(dh, gate, up)


@_swiglu_backward_op.register_fake
def _(dh, gate, up):
    return gate.new_empty(gate.shape), gate.new_empty(gate.shape)


def _setup_context(ctx, inputs, output):
    gate, up, _, _ = inputs
    ctx.save_for_backward(gate, up)


def _backward(ctx, dh, dq, ds):
    gate, up = ctx.saved_tensors
    dg, du = _swiglu_backward_op(dh.contiguous(), gate, up)
    return dg, du, None, None


_swiglu_quant_op.register_autograd(_backward, setup_context=_setup_context)


def swiglu_quant(
    gate: torch.Tensor, up: torch.Tensor, *, scale_layout: str = "row", name: str = "x"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused ``h = silu(gate) * up`` (HF numerics) + 1x128 quantization of h (the `jetrl::swiglu_quant` op).

    Input:  gate, up ``[M, N]`` same float dtype (unit stride along N on CUDA; row strides free, so
            halves of a fused gate_up output work).
    Output: h ``[M, N]`` dtype contiguous; q float8_e4m3fn ``[M, N]`` = quantize_1x128(h) bytes.
    scales: fp32 ``[M, ceil(N/128)]``, ``"row"`` (default) or ``"deepgemm"`` strides ``(1, align(M, 4))``.
    Differentiable in h (to gate and up, via `swiglu_backward`).
    """
    _check_pair(gate, up, OP, gate.is_cuda)
    if scale_layout not in SCALE_LAYOUTS:
        raise ValueError(f"{OP}: scale_layout={scale_layout!r}, choose one of {SCALE_LAYOUTS}")
    return _swiglu_quant_op(gate, up, scale_layout, name)


def swiglu_backward(dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SwiGLU backward (the `jetrl::swiglu_backward` op): ``(dgate, dup)`` ``[M, N]`` in the input dtype."""
    return _swiglu_backward_op(dh, gate, up)
