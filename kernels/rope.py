"""transformers' rotary position embedding of flat q / k rows in one kernel, bit for bit.

Numerics are transformers' ``apply_rotary_pos_emb`` (Llama, Qwen2, Qwen3) in the input dtype, each op
rounded as eager torch rounds it::

    cos, sin = table[0, pos], table[1, pos]          # the rotary module's cos / sin, in dtype
    out      = (x * cos).to(dtype) + (rotate_half(x) * sin).to(dtype)   # the add rounded to dtype too
    rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])

Products of two dtype values are exact in fp32, so each op is "compute in fp32, round once", which the
kernel does with explicit round-to-nearest-even (bfloat16: integer rounding of the fp32 bits, so the
Triton CPU interpreter, whose bf16 cast truncates, computes the same bytes as the GPU; float16: the
cast; float32: no rounding, and the launch disables FMA contraction). ``table`` ``[2, P, D]`` holds the
module's cos and sin for positions ``0..P-1`` (`rope_table`): transformers computes them per position
(``pos * inv_freq`` in fp32, then cos / sin, scaled, cast), so a row of the table is what the module
returns for that position in any call -- for the rope types whose frequencies do not depend on the
sequence length (``dynamic`` and ``longrope`` do: `rope_table` refuses them).

Why a kernel: vLLM's engine with the trainer's ops (`jetrl.rollout.vllm_model`) ran transformers' module
and ``apply_rotary_pos_emb`` as separate elementwise kernels in every layer (cos / sin recomputed, then 4
multiplies, 2 adds, 2 concatenations); on the H200 at a batch of 256 decode rows (Llama-3.1-8B shape) the
BF16 elementwise kernels, these and the residual adds, took ~1.3 ms of an 11.5 ms GPU step
(`scripts/results/rollout-engine-ops-nvidia-h200.json`).

q / k rows may be column slices of vLLM's fused qkv output (any row stride, unit inner stride); the
outputs are contiguous ``[T, H * D]``. A position outside ``[0, P)`` reads nothing and yields NaN rows on
the GPU (the CPU reference raises IndexError naming the row); vLLM never passes positions beyond its max_model_len, the
length `rope_table` is built for.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._runtime import ROUND_MODES, check_matrix, round_to

__all__ = ["rope", "rope_pair", "torch_rope", "launch_rope", "launch_rope_pair", "rope_table", "DYNAMIC_ROPE_TYPES"]

OP = "jetrl::rope"
DYNAMIC_ROPE_TYPES = ("dynamic", "longrope")
"""transformers rope types whose frequencies change with the sequence length (``dynamic_rope_update``)."""


@triton.jit
def _rope_heads(x_ptr, out_ptr, table_ptr, pos, t, hb, H, P, stride_xt, stride_tab, D: tl.constexpr,
                BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, MODE: tl.constexpr):  # fmt: skip
    """Heads ``hb * BLOCK_H ..`` of row `t` of one tensor."""
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    half = D // 2
    mask_d = offs_d < D
    mask = (offs_h < H)[:, None] & mask_d[None, :]

    # x and its rotated partner (rotate_half: -x2 in the first half, x1 in the second)
    first = offs_d < half
    partner = tl.where(first, offs_d + half, offs_d - half)
    row = x_ptr + t.to(tl.int64) * stride_xt + offs_h[:, None] * D
    x = tl.load(row + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    xr = tl.load(row + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    rot = tl.where(first[None, :], -xr, xr)

    # cos / sin of this token's position; NaN for a position outside the table
    cmask = mask_d & (pos >= 0) & (pos < P)
    c = tl.load(table_ptr + pos * D + offs_d, mask=cmask, other=float("nan")).to(tl.float32)
    s = tl.load(table_ptr + stride_tab + pos * D + offs_d, mask=cmask, other=float("nan")).to(tl.float32)

    # (x * cos).to(dtype) + (rotate_half(x) * sin).to(dtype), the sum rounded to dtype
    y = round_to(round_to(x * c[None, :], MODE) + round_to(rot * s[None, :], MODE), MODE)
    out = out_ptr + t.to(tl.int64) * (H * D) + offs_h[:, None] * D + offs_d[None, :]
    tl.store(out, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    x_ptr,
    out_ptr,
    k_ptr,
    kout_ptr,
    table_ptr,
    pos_ptr,
    H,
    HK,
    NXB,
    P,
    stride_xt,
    stride_kt,
    stride_tab,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    MODE: tl.constexpr,
):
    # programs (t, 0..NXB-1) rotate x's heads, (t, NXB..) the second tensor's (`rope_pair`'s k)
    t = tl.program_id(0)
    hb = tl.program_id(1)
    pos = tl.load(pos_ptr + t).to(tl.int64) + tl.zeros([BLOCK_D], tl.int64)
    if hb < NXB:
        _rope_heads(x_ptr, out_ptr, table_ptr, pos, t, hb, H, P, stride_xt, stride_tab, D, BLOCK_D, BLOCK_H, MODE)
    else:
        _rope_heads(k_ptr, kout_ptr, table_ptr, pos, t, hb - NXB, HK, P, stride_kt, stride_tab, D, BLOCK_D, BLOCK_H,
                    MODE)  # fmt: skip


def _check(x: torch.Tensor, table: torch.Tensor, positions: torch.Tensor, head_dim: int, name: str) -> None:
    check_matrix(x, name, OP)
    if head_dim < 2 or head_dim % 2 or x.shape[1] % head_dim:
        raise ValueError(f"{OP}: {name} {tuple(x.shape)} is not whole heads of an even head_dim={head_dim}")
    if table.dim() != 3 or table.shape[0] != 2 or table.shape[2] != head_dim or not table.is_contiguous():
        raise ValueError(
            f"{OP}: table must be a contiguous [2, positions, {head_dim}] tensor, got {tuple(table.shape)}"
        )
    if table.dtype != x.dtype or table.device != x.device:
        raise ValueError(f"{OP}: table {table.dtype} on {table.device} must match {name} {x.dtype} on {x.device}")
    if positions.dim() != 1 or positions.shape[0] != x.shape[0] or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"{OP}: positions must be int32/int64 [{x.shape[0]}] (one per row of {name}), "
            f"got {positions.dtype} {tuple(positions.shape)}"
        )


def launch_rope(
    x: torch.Tensor,
    table: torch.Tensor,
    positions: torch.Tensor,
    head_dim: int,
    name: str = "x",
    block_h: int = 4,
    num_warps: int = 4,
) -> torch.Tensor:
    """Rotate the ``[T, H * head_dim]`` rows of `x` (last-dim stride 1, any row stride) at `positions`
    ``[T]`` with `table` ``[2, P, head_dim]`` (`rope_table`); returns a contiguous ``[T, H * head_dim]``.
    `block_h` heads per program and `num_warps` change speed only (`scripts/bench_kernels.py --sweep`)."""
    _check(x, table, positions, head_dim, name)
    return _launch(x, None, table, positions, head_dim, block_h, num_warps)[0]


def launch_rope_pair(
    q: torch.Tensor,
    k: torch.Tensor,
    table: torch.Tensor,
    positions: torch.Tensor,
    head_dim: int,
    name: str = "x",
    block_h: int = 4,
    num_warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`launch_rope` of `q` and of `k` (the same rows and positions, any head counts) in one launch:
    ``(q_out, k_out)``, each what `launch_rope` returns for it."""
    _check(q, table, positions, head_dim, f"{name}:q")
    _check(k, table, positions, head_dim, f"{name}:k")
    return _launch(q, k, table, positions, head_dim, block_h, num_warps)


def _launch(x, k, table, positions, head_dim, block_h, num_warps):
    t = x.shape[0]
    out = torch.empty((t, x.shape[1]), dtype=x.dtype, device=x.device)
    kout = None if k is None else torch.empty((t, k.shape[1]), dtype=k.dtype, device=k.device)
    h = x.shape[1] // head_dim
    hk = 0 if k is None else k.shape[1] // head_dim
    if t == 0 or h + hk == 0:
        return out, kout
    nxb = triton.cdiv(h, block_h)
    _rope_kernel[(t, nxb + triton.cdiv(hk, block_h))](
        x,
        out,
        x if k is None else k,
        out if k is None else kout,
        table,
        positions,
        h,
        hk,
        nxb,
        table.shape[1],
        x.stride(0),
        x.stride(0) if k is None else k.stride(0),
        table.stride(0),
        D=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_H=block_h,
        MODE=ROUND_MODES[x.dtype],
        num_warps=num_warps,
        enable_fp_fusion=False,
    )
    return out, kout


def torch_rope(x: torch.Tensor, table: torch.Tensor, positions: torch.Tensor, head_dim: int, name: str = "x"):
    """Reference: transformers' formula in eager torch (the module docstring), same contract as `rope`."""
    _check(x, table, positions, head_dim, name)
    bad = (positions < 0) | (positions >= table.shape[1])
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise IndexError(
            f"{OP}: {name} row {i} has position {int(positions[i])}, outside the table's 0..{table.shape[1] - 1}"
        )
    x3 = x.reshape(x.shape[0], -1, head_dim)
    cos, sin = table[0][positions][:, None, :], table[1][positions][:, None, :]
    x1, x2 = x3[..., : head_dim // 2], x3[..., head_dim // 2 :]
    return ((x3 * cos) + (torch.cat((-x2, x1), dim=-1) * sin)).reshape(x.shape)


@torch.library.custom_op(OP, mutates_args=(), device_types="cpu")
def _rope_op(x: torch.Tensor, table: torch.Tensor, positions: torch.Tensor, head_dim: int, name: str) -> torch.Tensor:
    return torch_rope(x, table, positions, head_dim, name).contiguous()


@_rope_op.register_kernel("cuda")
def _(x, table, positions, head_dim, name):
    return launch_rope(x, table, positions, head_dim, name)


@_rope_op.register_fake
def _(x, table, positions, head_dim, name):
    return x.new_empty(x.shape)


OP_PAIR = "jetrl::rope_pair"


@torch.library.custom_op(OP_PAIR, mutates_args=(), device_types="cpu")
def _rope_pair_op(
    q: torch.Tensor, k: torch.Tensor, table: torch.Tensor, positions: torch.Tensor, head_dim: int, name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch_rope(q, table, positions, head_dim, f"{name}:q").contiguous(),
        torch_rope(k, table, positions, head_dim, f"{name}:k").contiguous(),
    )


@_rope_pair_op.register_kernel("cuda")
def _(q, k, table, positions, head_dim, name):
    return launch_rope_pair(q, k, table, positions, head_dim, name)


@_rope_pair_op.register_fake
def _(q, k, table, positions, head_dim, name):
    return q.new_empty(q.shape), k.new_empty(k.shape)


def rope_pair(
    q: torch.Tensor, k: torch.Tensor, table: torch.Tensor, positions: torch.Tensor, head_dim: int, *, name: str = "x"
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rope` of q ``[T, Hq * head_dim]`` and k ``[T, Hk * head_dim]`` at the same `positions` in one kernel
    launch (the torch op ``jetrl::rope_pair``): ``(q_out, k_out)``, each bit-equal to `rope` of it. The rollout
    engine rotates every layer's q and k this way (one launch where two were, `jetrl.rollout.vllm_model`);
    errors name ``<name>:q`` / ``<name>:k``."""
    return _rope_pair_op(q, k, table, positions, head_dim, name)


def rope(x: torch.Tensor, table: torch.Tensor, positions: torch.Tensor, head_dim: int, *, name: str = "x"):
    """transformers' rotary embedding of the ``[T, H * head_dim]`` rows of `x` at `positions` ``[T]``,
    from `table` ``[2, P, head_dim]`` (`rope_table`); a contiguous ``[T, H * head_dim]``. The torch op
    ``jetrl::rope``: the Triton kernel on CUDA, `torch_rope` on CPU; bit-equal to each other."""
    return _rope_op(x, table, positions, head_dim, name)


@torch.no_grad()
def rope_table(rotary: torch.nn.Module, positions: int, dtype: torch.dtype, *, name: str = "rotary") -> torch.Tensor:
    """``[2, positions, head_dim]`` cos and sin of transformers' rotary module `rotary` (a
    ``*RotaryEmbedding``) for positions ``0..positions-1``, in `dtype`, on the module's device: one call of
    the module, the values any of its calls returns for those positions. Refuses the rope types whose
    frequencies depend on the sequence length (`DYNAMIC_ROPE_TYPES`), naming `name`."""
    kind = getattr(rotary, "rope_type", None)
    if kind in DYNAMIC_ROPE_TYPES:
        raise ValueError(
            f"{name}: rope_type={kind!r} changes its frequencies with the sequence length; "
            f"a per-position cos/sin table (jetrl::rope) cannot reproduce it"
        )
    if positions < 1:
        raise ValueError(f"{name}: a rope table needs >= 1 position, got {positions}")
    inv_freq = rotary.inv_freq
    probe = torch.empty(0, dtype=dtype, device=inv_freq.device)
    ids = torch.arange(positions, device=inv_freq.device)[None]
    cos, sin = rotary(probe, ids)
    return torch.stack((cos[0], sin[0])).contiguous()
