"""Shared launcher plumbing for the jetrl Triton kernels: the non-finite flag, scale layouts, checks.

Non-finite detection on CUDA costs one predicated store per program: every kernel tests the
NaN-propagating amax of each of its groups (`abs_max`, then `count_nonfinite`: exponent bits all
ones, an integer test no fast-math folding can drop; NaN/Inf anywhere in a group makes its amax
non-finite) and, if anything failed, writes 1 into its own int32 slot
of a per-device flag buffer. A slot belongs to one ``(op, tensor name)`` pair (registered on the host
when the launcher runs, reused on the next step), so `check_nonfinite` — one device-to-host copy the
caller makes once per step — can say which op saw which tensor go bad. Nothing synchronises inside
the kernels' launchers. The CPU path (the ``torch_<op>`` references) raises at once instead.

A launcher given ``live`` (an integer ``[M]`` tensor, e.g. vLLM's slot mapping) flags only the rows whose
entry is >= 0: a CUDA-graph batch padded to its captured size carries rows of stale memory (entry -1)
that are no input, and whose NaN bit patterns must not fail the step (`live_row_mask`, `check_live`).

A kernel that saw non-finite input still writes outputs (garbage for the affected groups); they must
not be used, which is why `check_nonfinite` raises rather than returns.
"""

from __future__ import annotations

import threading

import torch
import triton
import triton.language as tl

from jetrl.quant import NonFiniteError, ceil_div
from jetrl.recipe import BLOCK

__all__ = [
    "SCALE_LAYOUTS",
    "SCALE_STRIDE_UNALIGNED",
    "check_nonfinite",
    "nonfinite_flag",
    "reset_nonfinite",
    "scale_buffer",
    "to_scale_layout",
    "check_matrix",
    "check_live",
    "live_row_mask",
    "count_nonfinite",
    "abs_max",
    "e4m3_scale",
    "e4m3_grid",
    "ROUND_MODES",
    "round_to",
]

SCALE_LAYOUTS = ("row", "deepgemm")
SCALE_STRIDE_UNALIGNED = ("stride_sg",)
"""``do_not_specialize_on_alignment`` of the kernels that write `scale_buffer`'s ``"deepgemm"`` layout. Triton
compiles one variant per (M % 16 == 0, stride % 16 == 0) pair of its int arguments; the group stride there is
``align(M, 4)``, so M = 13..15 (mod 16) makes a pair no CUDA-graph capture size (1, 2, 4, 8, 16, 24, ...) compiles,
and vLLM's first prefill of such a token count stopped to JIT-compile each producer mid-rollout (its JIT monitor
named them on the H200). Without the stride's alignment in the key, M's variants are the only ones: those the
capture sizes compile (`tests/kernels/test_specialization.py`). Only the scale stores lose the 16-byte alignment
hint: 4 bytes per 128 of quantized output; their speed with and without it was not timed."""
_FLOAT_INPUTS = (torch.float32, torch.bfloat16, torch.float16)

_lock = threading.Lock()
_slots: dict[tuple[str, str], int] = {}  # (op, name) -> slot index, shared by all devices
_names: list[tuple[str, str]] = []  # slot index -> (op, name)
_flags: dict[torch.device, torch.Tensor] = {}  # device -> int32 [capacity]
_retired: dict[torch.device, list[torch.Tensor]] = {}  # device -> buffers outgrown, still checked (see below)


def _slot(op: str, name: str) -> int:
    key = (op, name)
    slot = _slots.get(key)
    if slot is None:
        slot = len(_names)
        _slots[key] = slot
        _names.append(key)
    return slot


def nonfinite_flag(op: str, name: str, device: torch.device) -> tuple[torch.Tensor, int]:
    """The device flag buffer and the slot a kernel launched by `op` on tensor `name` sets to 1.

    The buffer grows (copied on the current stream, so pending writes are kept in order) when new
    names appear; steady-state steps reuse their slots and allocate nothing. An outgrown buffer is kept
    and checked too: a CUDA graph captured before the growth still writes to it (its address is baked
    into the graph), and a NaN it flags there must not go unreported.
    """
    device = torch.device(device)
    with _lock:
        slot = _slot(op, name)
        buf = _flags.get(device)
        if buf is None or buf.numel() <= slot:
            cap = max(256, 2 * (slot + 1))
            new = torch.zeros(cap, dtype=torch.int32, device=device)
            if buf is not None:
                new[: buf.numel()].copy_(buf)
                _retired.setdefault(device, []).append(buf)
            _flags[device] = buf = new
    return buf, slot


def check_nonfinite(reset: bool = True) -> None:
    """Raise `jetrl.quant.NonFiniteError` if any kernel since the last check saw NaN or Inf input.

    Call once per step (it synchronises with the device). The message names every (op, tensor) that
    tripped. With ``reset`` (default) the flags are cleared, also when raising.
    """
    bad: list[str] = []
    with _lock:
        for device, buf in _flags.items():
            retired = _retired.get(device, [])
            seen = buf
            if retired:  # slot indices are the same in every buffer of a device (each a prefix of the next)
                seen = buf.clone()
                for old in retired:
                    seen[: old.numel()] += old
            hits = torch.nonzero(seen).flatten().tolist()  # the one device->host sync
            for slot in hits:
                op, name = _names[slot]
                bad.append(f"{op} on {name} ({device})")
            if reset and hits:
                for b in (buf, *retired):
                    b.zero_()
    if bad:
        raise NonFiniteError(
            "non-finite values (NaN/Inf) reached FP8 kernels; their outputs are invalid: " + "; ".join(bad)
        )


def reset_nonfinite() -> None:
    """Clear every device flag without checking."""
    with _lock:
        for device, buf in _flags.items():
            for b in (buf, *_retired.get(device, [])):
                b.zero_()


def scale_buffer(m: int, g: int, layout: str, device: torch.device) -> torch.Tensor:
    """An fp32 ``[m, g]`` scale tensor: row-major (``"row"``) or DeepGEMM's MN-major layout
    (``"deepgemm"``: strides ``(1, align(m, 4))``, a column view of a ``[g, align(m, 4)]`` buffer)."""
    if layout == "row":
        return torch.empty((m, g), dtype=torch.float32, device=device)
    if layout == "deepgemm":
        m_pad = ceil_div(m, 4) * 4
        return torch.empty((g, m_pad), dtype=torch.float32, device=device).t()[:m]
    raise ValueError(f"scale_layout={layout!r}: choose one of {SCALE_LAYOUTS}")


def to_scale_layout(s: torch.Tensor, layout: str) -> torch.Tensor:
    """Copy row-major scales ``[m, g]`` into `scale_buffer`'s layout (used by the references)."""
    out = scale_buffer(s.shape[0], s.shape[1], layout, s.device)
    out.copy_(s)
    return out


def check_matrix(x: torch.Tensor, name: str, op: str, *, inner_contiguous: bool = True) -> None:
    """Layout contract shared by the launchers: a 2-D float tensor whose last dim has unit stride."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"{op}: {name} must be 2-D [M, K], got shape {tuple(x.shape)}")
    if x.dtype not in _FLOAT_INPUTS:
        raise TypeError(f"{op}: {name} has dtype {x.dtype}; use float32, bfloat16 or float16")
    if inner_contiguous and x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError(
            f"{op}: {name} must have unit stride along its last dim, got strides {x.stride()} "
            f"(call .contiguous() first)"
        )


def check_live(live: torch.Tensor | None, m: int, x: torch.Tensor, name: str, op: str) -> None:
    """`live` (None, or an integer ``[m]`` tensor on x's device: rows whose entry is < 0 set no flag) or a
    ValueError naming the op and the tensor."""
    if live is None:
        return
    if live.dim() != 1 or live.shape[0] != m or live.dtype.is_floating_point or live.dtype == torch.bool:
        raise ValueError(
            f"{op}: live rows of {name} must be an integer [{m}] tensor (entry < 0: a padding row), got "
            f"{live.dtype} {tuple(live.shape)}"
        )
    if live.device != x.device or live.stride(0) != 1:
        raise ValueError(
            f"{op}: live rows of {name} must be contiguous on {x.device}, got stride {live.stride(0)} on {live.device}"
        )


@triton.jit
def live_row_mask(live_ptr, offs_m, mask_m, HAS_LIVE: tl.constexpr):
    """Per row of a tile, whether its non-finite values set the flag: every row in range, or with HAS_LIVE
    only those whose `live_ptr` entry is >= 0 (`check_live`)."""
    if HAS_LIVE:
        return mask_m & (tl.load(live_ptr + offs_m, mask=mask_m, other=-1) >= 0)
    else:
        return mask_m


def groups(k: int) -> int:
    """Number of 128-wide groups covering k."""
    return ceil_div(k, BLOCK)


@triton.jit
def e4m3_scale(amax, EPS: tl.constexpr, FP8_MAX: tl.constexpr):
    """Dequant scale of groups from their fp32 amax: ``max(amax, eps) / 448``, correctly rounded
    (``tl.math.div_rn``: Triton's ``/`` is approximate). `jetrl.quant.compute_scale` in Triton; every
    kernel computes its scales here."""
    return tl.math.div_rn(tl.maximum(amax, EPS), tl.full(amax.shape, FP8_MAX, tl.float32))


@triton.jit
def e4m3_grid(x, s, FP8_MAX: tl.constexpr, RCP: tl.constexpr):
    """``clamp(x / s, -448, 448)`` with a correctly rounded division (`s` already broadcastable to `x`,
    one value per group): the fp32 values whose round-to-nearest-even cast ``.to(tl.float8e4nv)`` are
    the e4m3 bytes. `jetrl.quant`'s divide-then-clamp in Triton; every kernel maps values onto the grid here.

    ``RCP=False``: ``div.rn.f32`` per element. ``RCP=True``: the reciprocal once per group,
    ``r = RN(1/s)``, then per element ``q0 = RN(x*r)`` and Markstein's correction
    ``q = fma(fma(-q0, s, x), r, q0)`` (two FMAs instead of an IEEE division sequence). That is
    ``RN(x/s)`` unless the quotient or its remainder underflows, i.e. for every ``|x/s| >= 2^-11``
    (s >= eps/448 keeps the remainder normal there); below that both round to an e4m3 zero of x's
    sign (zeros themselves are passed through), so the bytes are the same either way. Checked exactly
    (`tests/kernels/test_rcp_division.py`: exact emulation, the interpreter, and on sm_90 the compiled
    kernels bit for bit against ``RCP=False``)."""
    if RCP:
        r = tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)
        q0 = x * r
        y = tl.math.fma(tl.math.fma(-q0, s, x), r, q0)
        y = tl.where(x == 0.0, x, y)
    else:
        y = tl.math.div_rn(x, s)
    return tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)


@triton.jit
def _max_keep_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def abs_max(x, axis):
    """``max(|x|)`` along `axis`, NaN-propagating (``tl.max`` drops NaN): a group holding NaN or Inf
    gets a non-finite amax. So the kernels test only their amaxes with `count_nonfinite` — one test per
    group instead of per element (these kernels move 3-7 bytes per element; an element-wise test
    costs four instructions each) — and still flag exactly the launches a per-element test would."""
    return tl.reduce(tl.abs(x), axis, _max_keep_nan)


@triton.jit
def count_nonfinite(x):
    """Number of NaN/Inf elements of an fp32 tile, tested on the exponent bits (all ones) so no
    floating-point comparison can be folded away by the compiler."""
    bits = x.to(tl.int32, bitcast=True) & 0x7F800000
    return tl.sum(tl.ravel(tl.where(bits == 0x7F800000, 1, 0)), axis=0)


ROUND_MODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
"""The ``MODE`` constexpr of `round_to` for a tensor dtype."""


@triton.jit
def _round_bf16(x):
    """fp32 -> the nearest bfloat16 (ties to even), as an fp32 value; NaN stays NaN."""
    u = x.to(tl.uint32, bitcast=True)
    r = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return tl.where(x != x, x, r.to(tl.float32, bitcast=True))


@triton.jit
def round_to(x, MODE: tl.constexpr):
    """fp32 `x` rounded to the dtype of `MODE` (`ROUND_MODES`), ties to even, as fp32: what eager torch's
    "compute in fp32, round once" gives. bfloat16 rounds through the fp32 bits, because the Triton CPU
    interpreter's fp32 -> bf16 cast truncates (the compiled cast rounds: both then compute the same bytes)."""
    if MODE == 1:
        x = _round_bf16(x)
    elif MODE == 2:
        x = x.to(tl.float16).to(tl.float32)
    return x
