"""Block-scaled FP8 GEMM backends behind one interface, and `linear_fp8`, the shared FP8 fprop.

Backends (`get_backend(name)`):

- ``deepgemm``: DeepGEMM ``fp8_gemm_nt`` on sm_90 (from ``deep_gemm`` or ``vllm.third_party.deep_gemm``).
- ``torch-blockwise``: cuBLASLt 1x128 / 128x128 block scaling through ``torch._scaled_mm`` on sm_90.
- ``emulated``: `jetrl.quant.gemm_emulated`, float64 block sums; the CPU backend and the reference.

``auto`` picks deepgemm on sm_90 when importable, else torch-blockwise on CUDA, else emulated on a
machine without CUDA, and logs its choice once. An explicit name that cannot run raises
`BackendUnavailableError` with the reason: nothing falls back silently (not to BF16, not to emulation
on a GPU).
"""

from __future__ import annotations

import logging

import torch

from jetrl.gemm.base import BackendUnavailableError, GemmBackend
from jetrl.gemm.deepgemm import DeepGemmBackend
from jetrl.gemm.emulated import EmulatedBackend
from jetrl.gemm.ops import fprop, linear_fp8
from jetrl.gemm.torch_blockwise import TorchBlockwiseBackend

__all__ = [
    "BACKEND_NAMES",
    "BackendUnavailableError",
    "GemmBackend",
    "available_backends",
    "fprop",
    "get_backend",
    "linear_fp8",
]

_log = logging.getLogger(__name__)

_CLASSES = {"deepgemm": DeepGemmBackend, "torch-blockwise": TorchBlockwiseBackend, "emulated": EmulatedBackend}
BACKEND_NAMES = (*_CLASSES, "auto")
_INSTANCES: dict[str, GemmBackend] = {}


def available_backends() -> dict[str, str | None]:
    """Each backend name -> None if it can run here, else the reason it cannot."""
    return {name: cls.unavailable_reason() for name, cls in _CLASSES.items()}


def get_backend(name: str | GemmBackend = "auto") -> GemmBackend:
    """The GEMM backend called `name` (a `GemmBackend` passes through). Raises `BackendUnavailableError`
    with the reason if it cannot run here, `ValueError` for an unknown name."""
    if isinstance(name, GemmBackend):
        return name
    if name in _INSTANCES:
        return _INSTANCES[name]
    if name == "auto":
        order = ("deepgemm", "torch-blockwise") if torch.cuda.is_available() else ("emulated",)
        reasons = {}
        for cand in order:
            reasons[cand] = _CLASSES[cand].unavailable_reason()
            if reasons[cand] is None:
                backend = get_backend(cand)
                skipped = "; ".join(f"{k}: {v}" for k, v in reasons.items() if v)
                _log.warning("jetrl.gemm: backend 'auto' -> %r%s", cand, f" (skipped {skipped})" if skipped else "")
                _INSTANCES["auto"] = backend
                return backend
        raise BackendUnavailableError(
            "GEMM backend 'auto': no FP8 GEMM can run here: " + "; ".join(f"{k}: {v}" for k, v in reasons.items())
        )
    if name not in _CLASSES:
        raise ValueError(f"unknown GEMM backend {name!r}; choose one of {BACKEND_NAMES}")
    cls = _CLASSES[name]
    reason = cls.unavailable_reason()
    if reason is not None:
        raise BackendUnavailableError(f"GEMM backend {name!r} unavailable: {reason}")
    _INSTANCES[name] = cls()
    return _INSTANCES[name]
