"""The quantizers the FP8 Linear and `linear_fp8` call, routed to `jetrl.kernels` (interface A).

`jetrl.kernels` dispatches by device: CUDA -> Triton kernels, CPU -> its ``torch_<op>`` references,
which are built on `jetrl.quant` and bit-identical to it by definition. This module only adds the
routing: the functions below call the `jetrl.kernels` op of the same name. If `jetrl.kernels` does not
provide an op (an older tree), CPU tensors use the `jetrl.quant` composition that defines the op (the
same bytes), and CUDA tensors raise -- the eager-torch quantizers are ~20x slower than the kernels and
are used on a GPU only when asked for with ``set_quantize_impl("reference")`` (benchmarks say so).

Eager fast path. A ``jetrl::*`` custom op costs ~0.2 ms of host time per call in the dispatcher
(measured on an H200 with torch 2.11: more than the kernel itself for most Linear shapes), and an FP8
Linear calls four or five per fwd+bwd. So in plain eager execution on CUDA the functions below call
the op's Triton launcher (``jetrl.kernels.<op>.launch_<op>``, which is exactly what the op's CUDA
kernel registration runs: the same bytes) directly. The custom op is kept whenever something may
need to see it as one node: `eager_fast_path` is False under ``torch.compile`` / Dynamo, under any
TorchFunctionMode (the lint's `jetrl.lint.capture.Recorder`, ``with torch.device(...)``) or
TorchDispatchMode (FakeTensor, make_fx / AOT tracing, selective activation checkpointing,
FlopCounter), under functorch transforms, for tensor subclasses, and on CPU.
"""

from __future__ import annotations

import importlib

import torch

from jetrl import quant
from jetrl.gemm.base import to_scale_layout

__all__ = [
    "quantize_1x128",
    "quantize_128x128",
    "transpose_quantize",
    "transpose_requantize",
    "set_quantize_impl",
    "quantize_impl",
    "quantize_paths",
    "QUANTIZE_IMPLS",
    "eager_fast_path",
    "launcher",
]

QUANTIZE_IMPLS = ("kernels", "kernels+compose", "reference")
_IMPL = {"name": "kernels"}


def set_quantize_impl(name: str) -> None:
    """ "kernels" (default): `jetrl.kernels` ops. "reference": `jetrl.quant` eager torch everywhere
    (bit-identical, slow on GPU; for benchmarks of a tree whose kernels are not ready)."""
    if name not in QUANTIZE_IMPLS:
        raise ValueError(f"quantize impl {name!r}: choose one of {QUANTIZE_IMPLS}")
    _IMPL["name"] = name


def quantize_impl() -> str:
    """The selected implementation name (see `set_quantize_impl`)."""
    return _IMPL["name"]


def quantize_paths() -> dict[str, str]:
    """For each quantize op, what runs it on CUDA now: 'jetrl.kernels', 'composed' or 'jetrl.quant'."""
    out = {}
    for op in ("quantize_1x128", "quantize_128x128", "transpose_quantize", "transpose_requantize"):
        if _IMPL["name"] == "reference":
            out[op] = "jetrl.quant"
        elif _kernel(op) is not None:
            out[op] = "jetrl.kernels"
        elif _IMPL["name"] == "kernels+compose" and op.startswith("transpose"):
            out[op] = "composed from jetrl.kernels.quantize_1x128" + (" + eager dequantize" if "re" in op else "")
        else:
            out[op] = "missing (raises on CUDA)"
    return out


FAST_PATH_DEVICE_TYPES = ("cuda",)
"""Device types whose tensors may take the eager fast path (the launchers are Triton GPU code; the CPU
tests add "cpu" in a Triton-interpreter subprocess to run the same calls)."""

_LAUNCHERS: dict[str, object] = {}
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # exact types: any other subclass (FakeTensor, DTensor) is traced


def eager_fast_path(x: torch.Tensor) -> bool:
    """True when the Triton launcher of a quantize op may be called directly for `x` instead of the
    ``jetrl::`` custom op: the default "kernels" impl, a plain tensor on CUDA, and nothing tracing or
    intercepting torch calls (see the module docstring). Cheap: a few C-level queries."""
    # is_compiling first: Dynamo folds it to True and never traces the C queries after it
    return (
        not torch.compiler.is_compiling()
        and type(x) in _PLAIN
        and x.device.type in FAST_PATH_DEVICE_TYPES
        and _IMPL["name"] == "kernels"
        and torch._C._len_torch_function_stack() == 0
        and torch._C._len_torch_dispatch_stack() == 0
        and not torch._C._are_functorch_transforms_active()
    )


def launcher(module: str, fn: str):
    """``jetrl.kernels.<module>.<fn>`` (the package re-exports each op under its module's name, so
    the module is imported by its dotted path); cached after the first call."""
    key = f"{module}.{fn}"
    f = _LAUNCHERS.get(key)
    if f is None:
        f = _LAUNCHERS[key] = getattr(importlib.import_module(f"jetrl.kernels.{module}"), fn)
    return f


def _kernel(op: str):
    try:
        import jetrl.kernels as k
    except ImportError:
        return None
    return getattr(k, op, None)


def _route(op: str, x: torch.Tensor):
    """The jetrl.kernels op, or None when the jetrl.quant composition must be used."""
    if _IMPL["name"] == "reference":
        return None
    fn = _kernel(op)
    if fn is None and x.device.type != "cpu":
        raise RuntimeError(
            f"jetrl.kernels.{op} is not available for {x.device} tensors; refusing to quantize with eager "
            "torch silently. Call jetrl.gemm.quantize.set_quantize_impl('reference') to use jetrl.quant."
        )
    return fn


def quantize_1x128(x: torch.Tensor, *, scale_layout: str = "row", name: str = "x", live: torch.Tensor | None = None):
    """x [M, K] -> (q e4m3 [M, K], s fp32 [M, ceil(K/128)] in `scale_layout`). `live` (the rollout engine's
    step rows, `jetrl.rollout.methods.live_rows`): an integer [M] tensor whose rows < 0 set no non-finite
    flag, honoured by the launcher of the eager fast path; every other path tests every row."""
    if eager_fast_path(x):
        return launcher("quantize_1x128", "launch_quantize_1x128")(x, scale_layout, name, live=live)
    fn = _route("quantize_1x128", x)
    if fn is not None:
        return fn(x, scale_layout=scale_layout, name=name)
    q, s = quant.quantize_1x128(x, name=name)
    return q, to_scale_layout(s, scale_layout)


def quantize_128x128(w: torch.Tensor, *, with_transpose: bool = False, name: str = "w"):
    """w [N, K] -> (q, s) or (q, s, q_t [K, N], s_t [ceil(K/128), ceil(N/128)]), all contiguous."""
    if eager_fast_path(w):
        return launcher("quantize_128x128", "launch_quantize_128x128")(w, bool(with_transpose), name)
    fn = _route("quantize_128x128", w)
    if fn is not None:
        return fn(w, with_transpose=with_transpose, name=name)
    q, s = quant.quantize_128x128(w, name=name)
    if not with_transpose:
        return q, s
    return q, s, q.t().contiguous(), s.t().contiguous()


def _composable(op: str, x: torch.Tensor) -> bool:
    return _IMPL["name"] == "kernels+compose" and x.device.type != "cpu" and _kernel(op) is None


def transpose_quantize(x: torch.Tensor, *, name: str = "x"):
    """x [M, K] -> quantize_128x1(x): (q_t [K, M], s_t [K, ceil(M/128)])."""
    if eager_fast_path(x):
        return launcher("transpose_quantize", "launch_transpose_quantize")(x, name)
    if _composable("transpose_quantize", x):
        return _kernel("quantize_1x128")(x.t().contiguous(), scale_layout="row", name=name)
    fn = _route("transpose_quantize", x)
    if fn is not None:
        return fn(x, name=name)
    return quant.quantize_128x1(x, name=name)


def transpose_requantize(q: torch.Tensor, s: torch.Tensor, *, name: str = "x"):
    """1x128-quantized [M, K] -> dequantize, transpose, requantize 1x128 along M: (q_t [K, M], s_t).
    `s` may be in either scale layout (row-major or DeepGEMM's MN-major): no copy is made for it."""
    if eager_fast_path(q) and type(s) in _PLAIN:
        return launcher("transpose_quantize", "launch_transpose_requantize")(q, s, name)
    if _composable("transpose_requantize", q):
        x = quant.dequantize_1x128(q, s.contiguous(), name=name)
        return _kernel("quantize_1x128")(x.t().contiguous(), scale_layout="row", name=name)
    fn = _route("transpose_requantize", q)
    if fn is not None:
        return fn(q, s, name=name)
    return quant.quantize_128x1(quant.dequantize_1x128(q, s.contiguous(), name=name), name=name)
