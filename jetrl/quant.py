"""Reference FP8 quantizers and the emulated block-scaled GEMM: the executable spec.

Every other implementation in jetrl (Triton kernels, GEMM backends, the vLLM method, the lint's
numeric mode) is tested bit for bit against the functions here. They are plain torch, run the same
on CPU and CUDA, and favour obviousness over speed.

The formula (`../shared/NUMERICS.md` section 1), for a group g of values computed in fp32::

    amax = max(|g|)
    s    = max(amax, eps) / 448          # IEEE division, correctly rounded to fp32
    q    = e4m3_rne(clamp(g / s, -448, 448))
    x ~= q * s                           # s is the DEQUANT multiplier (vLLM's weight_scale_inv)

Pitfalls handled here and nowhere else:

- On CUDA, ``t / 448.0`` with a Python scalar multiplies by the reciprocal (not IEEE): 55% of scales
  would differ. We always divide by a tensor (``torch.full_like``), which is IEEE on CPU and CUDA.
- ``.to(torch.float8_e4m3fn)`` does not saturate (448 < |x| <= 464 -> 448, above -> NaN): we clamp
  first.
- Non-finite input is never quantized: it raises `NonFiniteError` naming the tensor.
- Partial groups/blocks (K or N not a multiple of 128) use the amax of their valid elements only
  (padding is zeros, which cannot raise an amax).

Variants that are *not* the jetrl truth (power-of-two scales, ``x * (1/s)``, other eps values, per
tensor / per token) are selectable through `QuantSpec` so tests and the lint can build them; the
defaults are the truth.

The emulated GEMM computes ``D = C + A @ B.T`` (DeepGEMM's NT convention) from fp8 bytes and scales:
each 128-wide K block's product of e4m3 values is exact in float64 (at most 43 significant bits),
blocks are scaled and summed in float64 and the result rounded once. It is therefore deterministic
and batch-size invariant (a row's output does not depend on the other rows), which is what lets a
CPU rollout engine and a CPU trainer agree bit for bit.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

from jetrl.recipe import BLOCK, DEFAULT_EPS, E4M3_MAX, Division, Granularity, QuantSpec, ScaleFormat

__all__ = [
    "FP8_DTYPE",
    "NonFiniteError",
    "check_finite",
    "defer_finite_checks",
    "compute_scale",
    "quantize_1x128",
    "quantize_128x1",
    "quantize_128x128",
    "quantize_per_token",
    "quantize_per_tensor",
    "quantize",
    "dequantize_1x128",
    "dequantize_128x1",
    "dequantize_128x128",
    "dequantize",
    "gemm_emulated",
    "GEMM_ROLES",
    "ceil_div",
]

FP8_DTYPE = torch.float8_e4m3fn
GEMM_ROLES = ("fprop", "dgrad", "wgrad")
_FLOAT_INPUTS = (torch.float32, torch.bfloat16, torch.float16)


class NonFiniteError(ValueError):
    """A tensor handed to a quantizer holds NaN or Inf. The message names the tensor."""


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


_finite_sink: contextvars.ContextVar = contextvars.ContextVar("jetrl_finite_sink", default=None)


@contextlib.contextmanager
def defer_finite_checks(sink):
    """Within the block, `check_finite(x, name)` calls ``sink(x, name)`` instead of testing `x` on the host.

    For code that must not synchronise with the device (a CUDA-graph capture, a compiled region):
    the sink records the test on the device (e.g. ORs ``~isfinite(x).any()`` into a flag) and its
    owner raises `NonFiniteError` with the name after the graph ran. The check is moved, never
    dropped: the sink is required (None is refused)."""
    if sink is None or not callable(sink):
        raise TypeError(f"defer_finite_checks: sink must be callable(x, name), got {sink!r}")
    token = _finite_sink.set(sink)
    try:
        yield
    finally:
        _finite_sink.reset(token)


def check_finite(x: torch.Tensor, name: str) -> None:
    """Raise `NonFiniteError` naming `name` if `x` holds a NaN or an Inf (inside `defer_finite_checks`,
    hand the test to its sink instead)."""
    sink = _finite_sink.get()
    if sink is not None:
        sink(x, name)
        return
    if x.numel() and not bool(torch.isfinite(x).all()):
        n_nan = int(torch.isnan(x).sum())
        n_inf = int(torch.isinf(x).sum())
        raise NonFiniteError(
            f"non-finite values in {name}: {n_nan} NaN, {n_inf} Inf out of {x.numel()} "
            f"(shape {tuple(x.shape)}, dtype {x.dtype}); refusing to quantize"
        )


def _check_input(x: torch.Tensor, name: str, min_dim: int = 1) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_INPUTS:
        raise TypeError(f"{name}: dtype {x.dtype} not supported; use float32, bfloat16 or float16")
    if x.dim() < min_dim:
        raise ValueError(f"{name}: expected at least {min_dim} dim(s), got shape {tuple(x.shape)}")
    check_finite(x, name)


def compute_scale(
    amax: torch.Tensor, eps: float = DEFAULT_EPS, scale_format: ScaleFormat | str = ScaleFormat.FP32
) -> torch.Tensor:
    """Dequant scale of a group from its fp32 amax: ``max(amax, eps) / 448`` (IEEE), optionally
    rounded up to a power of two (exact powers of two are kept; this is the bit-ceil formula)."""
    amax = amax.to(torch.float32)
    s = torch.clamp_min(amax, eps) / torch.full_like(amax, E4M3_MAX)
    if ScaleFormat(scale_format) is ScaleFormat.POW2:
        mant, exp = torch.frexp(s)  # s = mant * 2**exp, mant in [0.5, 1)
        pow2 = torch.ldexp(torch.ones_like(s), exp)
        s = torch.where((mant == 0.5) | (s == 0), s, pow2)  # exact powers and zero are kept
    return s


def _to_e4m3(x: torch.Tensor, s: torch.Tensor, division: Division | str) -> torch.Tensor:
    """Map fp32 values onto the e4m3 grid given a broadcastable scale: divide, clamp, RNE cast."""
    if Division(division) is Division.TRUE:
        # an all-zero group with eps=0 has s == 0: 0/0 -> NaN; such a group quantizes to 0
        y = x / s
    else:
        y = x * (torch.ones_like(s) / s)
    y = torch.where(s == 0, torch.zeros_like(y), y)
    return torch.clamp(y, -E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)


def _pad_last(x: torch.Tensor, multiple: int) -> torch.Tensor:
    k = x.shape[-1]
    pad = ceil_div(k, multiple) * multiple - k
    return torch.nn.functional.pad(x, (0, pad)) if pad else x


def quantize_1x128(
    x: torch.Tensor,
    *,
    name: str = "x",
    scale_format: ScaleFormat | str = ScaleFormat.FP32,
    eps: float = DEFAULT_EPS,
    division: Division | str = Division.TRUE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize groups of 128 consecutive values along the last dim (per token group).

    Input:  x ``[..., K]`` float32/bfloat16/float16, any strides; K need not be a multiple of 128.
    Output: q float8_e4m3fn ``[..., K]`` contiguous; s float32 ``[..., ceil(K/128)]`` contiguous.
    """
    _check_input(x, name)
    k = x.shape[-1]
    lead = x.shape[:-1]
    g = ceil_div(k, BLOCK)
    if x.numel() == 0:
        return torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device), torch.empty(
            (*lead, g), dtype=torch.float32, device=x.device
        )
    xf = _pad_last(x.to(torch.float32), BLOCK).reshape(*lead, g, BLOCK)
    s = compute_scale(xf.abs().amax(dim=-1), eps, scale_format)
    q = _to_e4m3(xf, s.unsqueeze(-1), division).reshape(*lead, g * BLOCK)[..., :k].contiguous()
    return q, s.contiguous()


def quantize_128x1(
    x: torch.Tensor, *, name: str = "x", scale_format=ScaleFormat.FP32, eps=DEFAULT_EPS, division=Division.TRUE
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [M, K]`` in groups of 128 rows of one column and return the TRANSPOSED result,
    the operand layout wgrad wants: q ``[K, M]`` e4m3 and s ``[K, ceil(M/128)]`` float32
    (i.e. ``quantize_1x128(x.t())``)."""
    _check_input(x, name, min_dim=2)
    if x.dim() != 2:
        raise ValueError(f"{name}: quantize_128x1 takes a 2-D [M, K] tensor, got shape {tuple(x.shape)}")
    return quantize_1x128(x.t(), name=name, scale_format=scale_format, eps=eps, division=division)


def quantize_128x128(
    w: torch.Tensor,
    *,
    name: str = "w",
    scale_format: ScaleFormat | str = ScaleFormat.FP32,
    eps: float = DEFAULT_EPS,
    division: Division | str = Division.TRUE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a weight in 128x128 blocks.

    Input:  w ``[N, K]`` float32/bfloat16/float16, any strides.
    Output: q float8_e4m3fn ``[N, K]`` contiguous; s float32 ``[ceil(N/128), ceil(K/128)]`` (vLLM's
    ``weight_scale_inv``). Transpose invariant: ``quantize_128x128(w.t()) == (q.t(), s.t())``.
    """
    _check_input(w, name, min_dim=2)
    if w.dim() != 2:
        raise ValueError(f"{name}: quantize_128x128 takes a 2-D [N, K] tensor, got shape {tuple(w.shape)}")
    n, k = w.shape
    nb, kb = ceil_div(n, BLOCK), ceil_div(k, BLOCK)
    if w.numel() == 0:
        return torch.empty((n, k), dtype=FP8_DTYPE, device=w.device), torch.empty(
            (nb, kb), dtype=torch.float32, device=w.device
        )
    wf = _pad_last(_pad_last(w.to(torch.float32), BLOCK).t(), BLOCK).t()  # [nb*128, kb*128]
    blocks = wf.reshape(nb, BLOCK, kb, BLOCK)
    s = compute_scale(blocks.abs().amax(dim=(1, 3)), eps, scale_format)  # [nb, kb]
    q = _to_e4m3(blocks, s[:, None, :, None], division).reshape(nb * BLOCK, kb * BLOCK)[:n, :k].contiguous()
    return q, s.contiguous()


def quantize_per_token(
    x: torch.Tensor, *, name: str = "x", eps: float = 1.0 / 512.0, scale_format=ScaleFormat.FP32, division=Division.TRUE
) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per row (vLLM dynamic per-token activations; its scale floor is 1/(448*512), i.e.
    eps=1/512 on the amax). Output: q ``[..., K]``, s float32 ``[..., 1]``."""
    _check_input(x, name)
    if x.numel() == 0:
        return torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device), torch.empty(
            (*x.shape[:-1], 1), dtype=torch.float32, device=x.device
        )
    xf = x.to(torch.float32)
    s = compute_scale(xf.abs().amax(dim=-1, keepdim=True), eps, scale_format)
    return _to_e4m3(xf, s, division).contiguous(), s.contiguous()


def quantize_per_tensor(
    w: torch.Tensor, *, name: str = "w", eps: float = 0.0, scale_format=ScaleFormat.FP32, division=Division.TRUE
) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale for the whole tensor (vLLM online fp8 weights). Output: q like w, s float32 ``[]``."""
    _check_input(w, name)
    if w.numel() == 0:
        return torch.empty(w.shape, dtype=FP8_DTYPE, device=w.device), torch.ones((), device=w.device)
    wf = w.to(torch.float32)
    s = compute_scale(wf.abs().amax(), eps, scale_format)
    return _to_e4m3(wf, s, division).contiguous(), s


_QUANTIZERS = {
    Granularity.G1x128: quantize_1x128,
    Granularity.G128x1: quantize_128x1,
    Granularity.G128x128: quantize_128x128,
    Granularity.PER_TOKEN: quantize_per_token,
    Granularity.PER_TENSOR: quantize_per_tensor,
}


def quantize(x: torch.Tensor, spec: QuantSpec, *, name: str = "x") -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize `x` as `spec` says (dispatch on its granularity)."""
    fn = _QUANTIZERS[spec.granularity]
    return fn(x, name=name, scale_format=spec.scale_format, eps=spec.eps, division=spec.division)


# ---------------------------------------------------------------------------------------------
# Dequantization
# ---------------------------------------------------------------------------------------------


def _check_pair(q: torch.Tensor, s: torch.Tensor, want_s: tuple[int, ...], name: str) -> None:
    if q.dtype != FP8_DTYPE:
        raise TypeError(f"{name}: expected float8_e4m3fn bytes, got {q.dtype}")
    if s.dtype != torch.float32:
        raise TypeError(f"{name}: expected float32 scales, got {s.dtype}")
    if tuple(s.shape) != want_s:
        raise ValueError(f"{name}: scale shape {tuple(s.shape)} does not match bytes {tuple(q.shape)}; want {want_s}")


def dequantize_1x128(
    q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype = torch.float32, *, name: str = "x"
) -> torch.Tensor:
    """Inverse of `quantize_1x128`: ``q [..., K]`` times its group scale ``s [..., ceil(K/128)]``."""
    k = q.shape[-1]
    _check_pair(q, s, (*q.shape[:-1], ceil_div(k, BLOCK)), name)
    s_full = s.repeat_interleave(BLOCK, dim=-1)[..., :k]
    return (q.to(torch.float32) * s_full).to(dtype)


def dequantize_128x1(q_t: torch.Tensor, s_t: torch.Tensor, dtype: torch.dtype = torch.float32, *, name="x"):
    """Inverse of `quantize_128x1`: takes the transposed ``[K, M]`` operand, returns ``[M, K]``."""
    return dequantize_1x128(q_t, s_t, dtype, name=name).t()


def dequantize_128x128(
    q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype = torch.float32, *, name: str = "w"
) -> torch.Tensor:
    """Inverse of `quantize_128x128`: ``q [N, K]`` times its block scale ``s [ceil(N/128), ceil(K/128)]``."""
    if q.dim() != 2:
        raise ValueError(f"{name}: expected [N, K] bytes, got shape {tuple(q.shape)}")
    n, k = q.shape
    _check_pair(q, s, (ceil_div(n, BLOCK), ceil_div(k, BLOCK)), name)
    s_full = s.repeat_interleave(BLOCK, dim=0)[:n].repeat_interleave(BLOCK, dim=1)[:, :k]
    return (q.to(torch.float32) * s_full).to(dtype)


def dequantize(q: torch.Tensor, s: torch.Tensor, spec: QuantSpec, dtype=torch.float32, *, name="x") -> torch.Tensor:
    """Inverse of `quantize(x, spec)` for any granularity."""
    g = spec.granularity
    if g is Granularity.G1x128:
        return dequantize_1x128(q, s, dtype, name=name)
    if g is Granularity.G128x1:
        return dequantize_128x1(q, s, dtype, name=name)
    if g is Granularity.G128x128:
        return dequantize_128x128(q, s, dtype, name=name)
    return (q.to(torch.float32) * s).to(dtype)  # per-token [...,1] and per-tensor [] broadcast


# ---------------------------------------------------------------------------------------------
# Emulated block-scaled GEMM (the CPU backend)
# ---------------------------------------------------------------------------------------------


def gemm_emulated(
    a: torch.Tensor,
    a_s: torch.Tensor,
    b: torch.Tensor,
    b_s: torch.Tensor,
    *,
    role: str,
    out_dtype: torch.dtype = torch.bfloat16,
    c: torch.Tensor | None = None,
) -> torch.Tensor:
    """``D = C + A @ B.T`` from fp8 operands, as DeepGEMM's ``fp8_gemm_nt`` computes it.

    Shapes: ``[M, K] @ [N, K]^T -> [M, N]``.
      a: e4m3 ``[M, K]``, a_s: fp32 ``[M, ceil(K/128)]`` (1x128 along K) in every role.
      b: e4m3 ``[N, K]``; b_s: fp32 ``[ceil(N/128), ceil(K/128)]`` (128x128) for role fprop
         (B = W) and dgrad (B = W^T bytes), or ``[N, ceil(K/128)]`` (1x128 along K) for wgrad
         (B = X^T quantized along the token axis; A = dY^T likewise).
      c: optional fp32 ``[M, N]`` accumulator (wgrad's ``dW += ...``); the result is ``out_dtype``.
    """
    if role not in GEMM_ROLES:
        raise ValueError(f"gemm role {role!r}: choose one of {GEMM_ROLES}")
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"gemm_emulated[{role}]: A and B must be 2-D, got {tuple(a.shape)} and {tuple(b.shape)}")
    m, k = a.shape
    n, kb_ = b.shape
    if k != kb_:
        raise ValueError(f"gemm_emulated[{role}]: K mismatch, A {tuple(a.shape)} vs B {tuple(b.shape)}")
    kb = ceil_div(k, BLOCK)
    _check_pair(a, a_s, (m, kb), f"gemm_emulated[{role}].A")
    if role == "wgrad":
        _check_pair(b, b_s, (n, kb), f"gemm_emulated[{role}].B")
        b_s_rows = b_s  # [N, kb]
    else:
        _check_pair(b, b_s, (ceil_div(n, BLOCK), kb), f"gemm_emulated[{role}].B")
        b_s_rows = b_s.repeat_interleave(BLOCK, dim=0)[:n]  # [N, kb]
    if c is not None and (tuple(c.shape) != (m, n) or c.dtype != torch.float32):
        raise ValueError(f"gemm_emulated[{role}]: C must be float32 [{m}, {n}], got {c.dtype} {tuple(c.shape)}")

    a64 = _pad_last(a.to(torch.float64), BLOCK)
    b64 = _pad_last(b.to(torch.float64), BLOCK)
    acc = torch.zeros((m, n), dtype=torch.float64, device=a.device)
    for j in range(kb):
        sl = slice(j * BLOCK, (j + 1) * BLOCK)
        part = a64[:, sl] @ b64[:, sl].t()  # exact: e4m3 products summed over 128 fit in 53 bits
        acc += part * (a_s[:, j : j + 1].to(torch.float64) * b_s_rows[:, j].to(torch.float64)[None, :])
    out = acc.to(torch.float32)
    if c is not None:
        out = c + out
    return out.to(out_dtype)
