"""Comparison metrics (SQNR, max error), hardware probes and a memory probe used by tests, benchmarks and the lint."""

from __future__ import annotations

import gc
import math

import torch


def sqnr_db(ref: torch.Tensor, test: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of `test` against `ref` in dB, computed in float64;
    +inf for an exact match, -inf when the noise is not finite (Inf/NaN in `test` or `ref`)."""
    if ref.shape != test.shape:
        raise ValueError(f"sqnr_db: shapes differ, {tuple(ref.shape)} vs {tuple(test.shape)}")
    ref64, test64 = ref.detach().to(torch.float64), test.detach().to(torch.float64)
    noise = float(((ref64 - test64) ** 2).sum())
    signal = float((ref64**2).sum())
    if noise == 0.0:
        return math.inf
    if signal == 0.0 or not math.isfinite(noise):
        return -math.inf
    return 10.0 * math.log10(signal / noise)


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().to(torch.float64) - b.detach().to(torch.float64)).abs().max()) if a.numel() else 0.0


def has_sm90() -> bool:
    """True when a CUDA device of compute capability 9.x (Hopper) is visible."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def fp8_weights_alive(*linears, exclude: dict | None = None) -> list[torch.Tensor]:
    """The live e4m3 tensors with storage shaped like a weight ``[N, K]`` of `linears` or its transpose, other
    than those whose ids key `exclude` (e.g. what was alive before a forward), as the garbage collector sees them:
    held by a module, an autograd node's context or anything else; one scan of the heap. Fake and meta tensors
    (left by tracing elsewhere in the process) hold no memory and are not counted."""
    from torch._subclasses.fake_tensor import FakeTensor

    shapes = {s for m in linears for s in ((m.out_features, m.in_features), (m.in_features, m.out_features))}
    exclude = exclude or {}
    return [
        o
        for o in gc.get_objects()
        if issubclass(type(o), torch.Tensor)  # not isinstance: that asks a dead weakref.proxy for its class
        and o.dtype == torch.float8_e4m3fn
        and tuple(o.shape) in shapes
        and id(o) not in exclude
        and not issubclass(type(o), FakeTensor)
        and o.device.type != "meta"
    ]
