"""The GEMM backend contract shared by every backend, and the scale-layout helpers.

Every backend computes DeepGEMM's NT product ``D = C + A @ B.T`` from e4m3 operands and fp32
scales, with `jetrl.quant.gemm_emulated`'s contract (that function is the reference):

    Shapes: [M, K] @ [N, K]^T -> [M, N]
    fprop  A = X   [M, K] 1x128,          B = W       [N, K] 128x128  -> Y  [M, N]
    dgrad  A = dY  [M, N] 1x128,          B = W^T     [K, N] 128x128  -> dX [M, K]
    wgrad  A = dY^T [N, M] 1x128 (tokens), B = X^T   [K, M] 1x128     -> dW [N, K] fp32 (C += ...)

Scales of an A operand are ``[rows, ceil(K/128)]`` fp32 and may come in either of two layouts:
``"row"`` (row-major, what `jetrl.quant` returns) or ``"deepgemm"`` (same shape, strides
``(1, align(rows, 4))``: the MN-major, TMA-aligned layout DeepGEMM and cuBLAS read without a
transpose). A backend accepts both and converts when it must; `GemmBackend.scale_layout` says which
one it prefers, so producers (the quantize kernels) can write it directly.
"""

from __future__ import annotations

import torch

from jetrl.quant import FP8_DTYPE, GEMM_ROLES, ceil_div
from jetrl.recipe import BLOCK

__all__ = [
    "GemmBackend",
    "BackendUnavailableError",
    "SCALE_LAYOUTS",
    "align",
    "to_scale_layout",
    "is_scale_layout",
    "pad_k",
]

SCALE_LAYOUTS = ("row", "deepgemm")


class BackendUnavailableError(RuntimeError):
    """A GEMM backend was asked for explicitly but cannot run here; the message says why."""


def align(x: int, multiple: int) -> int:
    return ceil_div(x, multiple) * multiple


def is_scale_layout(s: torch.Tensor, layout: str) -> bool:
    """True when the 2-D scale tensor `s` ``[rows, G]`` is stored in `layout`."""
    rows, g = s.shape
    if layout == "row":
        return s.is_contiguous()
    if layout == "deepgemm":
        return (rows <= 1 or s.stride(0) == 1) and (g <= 1 or s.stride(1) == align(rows, 4))
    raise ValueError(f"scale layout {layout!r}: choose one of {SCALE_LAYOUTS}")


def to_scale_layout(s: torch.Tensor, layout: str) -> torch.Tensor:
    """The same scales ``[rows, G]`` stored in `layout` (a copy only when the layout differs).
    Input: s fp32 [rows, G], any strides. Output: fp32 [rows, G], row-major or strides (1, align(rows, 4))."""
    if s.dim() != 2:
        raise ValueError(f"scales must be 2-D [rows, groups], got shape {tuple(s.shape)}")
    if is_scale_layout(s, layout):
        return s
    if layout == "row":
        return s.contiguous()
    rows, g = s.shape
    out = torch.empty_strided((rows, g), (1, align(rows, 4)), dtype=s.dtype, device=s.device)
    out.copy_(s)
    return out


def pad_k(q: torch.Tensor, multiple: int = BLOCK) -> torch.Tensor:
    """Zero-pad the bytes ``[rows, K]`` along K to a multiple of `multiple`. Zero bytes add nothing
    to a product whatever their group's scale, so the result is unchanged; the scale tensor already
    has ``ceil(K/128)`` groups and needs no padding."""
    k = q.shape[1]
    kp = align(k, multiple)
    if kp == k:
        return q
    out = torch.zeros((q.shape[0], kp), dtype=q.dtype, device=q.device)
    out[:, :k] = q
    return out


def empty_result(m: int, n: int, out_dtype: torch.dtype, c: torch.Tensor | None, device) -> torch.Tensor:
    """``C + A @ B.T`` when M, N or K is 0: C (or zeros) in `out_dtype`."""
    if c is not None:
        return c.clone().to(out_dtype)
    return torch.zeros((m, n), dtype=out_dtype, device=device)


class GemmBackend:
    """One implementation of the three block-scaled FP8 GEMM roles. Subclasses set `name`,
    `scale_layout`, implement `_gemm` and may override `check_linear_shape`."""

    name: str = "?"
    scale_layout: str = "row"
    """Layout of activation scales the backend reads without converting ("row" or "deepgemm")."""
    device_type: str = "cpu"
    """Device type of the operands this backend runs on ("cpu" or "cuda"); emulated runs on any."""
    needs_block_multiples: bool = False
    """The kernels take only in/out features that are multiples of 128 (K of fprop and of dgrad)."""
    compiles_per_shape: bool = False
    """The kernels are compiled at the first call of each shape (`warm_up` compiles them ahead)."""

    def __repr__(self) -> str:
        return f"<jetrl GEMM backend {self.name!r}>"

    # -- shape policy ----------------------------------------------------------------------------
    def check_linear_shape(self, out_features: int, in_features: int) -> str | None:
        """None if a Linear ``[out_features, in_features]`` can run fprop, dgrad and wgrad on this
        backend, else the reason it cannot."""
        if self.needs_block_multiples and (in_features % BLOCK or out_features % BLOCK):
            return (
                f"{self.name} needs in_features and out_features multiples of {BLOCK} (K of fprop and of dgrad), "
                f"got out_features={out_features} in_features={in_features}"
            )
        return None

    # -- the GEMM --------------------------------------------------------------------------------
    def gemm(
        self,
        a: torch.Tensor,
        a_s: torch.Tensor,
        b: torch.Tensor,
        b_s: torch.Tensor,
        *,
        role: str,
        out_dtype: torch.dtype = torch.bfloat16,
        c: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``D = C + A @ B.T`` (a new tensor; C is not modified). Contract of `jetrl.quant.gemm_emulated`."""
        self._validate(a, a_s, b, b_s, role, c)
        return self._gemm(a, a_s, b, b_s, role=role, out_dtype=out_dtype, c=c)

    def gemm_accumulate_(
        self, a: torch.Tensor, a_s: torch.Tensor, b: torch.Tensor, b_s: torch.Tensor, acc: torch.Tensor
    ) -> torch.Tensor:
        """wgrad into an fp32 accumulator in place: ``acc += A @ B.T`` (e.g. ``weight.main_grad``)."""
        self._validate(a, a_s, b, b_s, "wgrad", acc)
        out = self._gemm(a, a_s, b, b_s, role="wgrad", out_dtype=torch.float32, c=acc)
        if out.data_ptr() != acc.data_ptr():
            acc.copy_(out)
        return acc

    def warm_up(self, n: int, k: int, max_rows: int, device: torch.device | str) -> int:
        """Compile now whatever an fprop ``[m, k] x [n, k]^T`` for any ``m <= max_rows`` would compile at its first
        call (a rollout engine calls this at load, before it serves: a compile in the middle of a decode stalls
        it); returns the number of GEMMs run. Backends that compile nothing per shape (`compiles_per_shape` False)
        run none."""
        return 0

    def _gemm(self, a, a_s, b, b_s, *, role, out_dtype, c):  # pragma: no cover - abstract
        raise NotImplementedError

    def _validate(self, a, a_s, b, b_s, role, c) -> None:
        where = f"{self.name}[{role}]"
        if role not in GEMM_ROLES:
            raise ValueError(f"gemm role {role!r}: choose one of {GEMM_ROLES}")
        for t, nm in ((a, "A"), (b, "B")):
            if t.dtype != FP8_DTYPE or t.dim() != 2:
                raise TypeError(f"{where}: {nm} must be 2-D float8_e4m3fn, got {t.dtype} {tuple(t.shape)}")
        for t, nm in ((a_s, "A scales"), (b_s, "B scales")):
            if t.dtype != torch.float32 or t.dim() != 2:
                raise TypeError(f"{where}: {nm} must be 2-D float32, got {t.dtype} {tuple(t.shape)}")
        m, k = a.shape
        n, k2 = b.shape
        if k != k2:
            raise ValueError(f"{where}: K mismatch, A {tuple(a.shape)} vs B {tuple(b.shape)}")
        kb = ceil_div(k, BLOCK)
        if tuple(a_s.shape) != (m, kb):
            raise ValueError(f"{where}: A scales {tuple(a_s.shape)}, want {(m, kb)} (1x128 along K)")
        want_b = (n, kb) if role == "wgrad" else (ceil_div(n, BLOCK), kb)
        if tuple(b_s.shape) != want_b:
            raise ValueError(f"{where}: B scales {tuple(b_s.shape)}, want {want_b}")
        if c is not None and (tuple(c.shape) != (m, n) or c.dtype != torch.float32):
            raise ValueError(f"{where}: C must be float32 [{m}, {n}], got {c.dtype} {tuple(c.shape)}")
        if self.device_type != "any":
            for t, nm in ((a, "A"), (b, "B"), (a_s, "A scales"), (b_s, "B scales")):
                if t.device.type != self.device_type:
                    raise ValueError(f"{where}: {nm} is on {t.device}, this backend runs on {self.device_type}")
