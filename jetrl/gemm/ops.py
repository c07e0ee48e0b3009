"""`linear_fp8`: THE FP8 forward of a Linear, shared by the trainer (`jetrl.linear.JetFP8Linear`) and
the vLLM rollout method (`jetrl_fp8`), so that rollout == training forward by construction.

    y = fprop(quantize_1x128(x), (w_q, w_s)) + bias

x is quantized per token in 1x128 groups by `jetrl.kernels.quantize_1x128` (in the scale layout the
backend reads directly), W is already 128x128-quantized (the trainer's cached bytes or the engine's
synced copy of them), the GEMM is the backend's fprop and the output has x's dtype. `fprop` is the
same computation from an already quantized x (the fused RMSNorm/SwiGLU outputs carry theirs).
"""

from __future__ import annotations

import torch

from jetrl.gemm.base import GemmBackend
from jetrl.gemm.quantize import quantize_1x128
from jetrl.quant import FP8_DTYPE, ceil_div
from jetrl.recipe import BLOCK

__all__ = ["linear_fp8", "fprop"]


def _check_weight(w_q: torch.Tensor, w_s: torch.Tensor, k: int, name: str) -> int:
    if w_q.dtype != FP8_DTYPE or w_q.dim() != 2:
        raise TypeError(f"{name}: weight bytes must be 2-D float8_e4m3fn [N, K], got {w_q.dtype} {tuple(w_q.shape)}")
    n, kw = w_q.shape
    if kw != k:
        raise ValueError(f"{name}: input has K={k} features but the weight is [N={n}, K={kw}]")
    want = (ceil_div(n, BLOCK), ceil_div(k, BLOCK))
    if w_s.dtype != torch.float32 or tuple(w_s.shape) != want:
        raise ValueError(f"{name}: weight scales must be float32 {want} (128x128), got {w_s.dtype} {tuple(w_s.shape)}")
    return n


def fprop(
    x_q: torch.Tensor,
    x_s: torch.Tensor,
    w_q: torch.Tensor,
    w_s: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    backend: GemmBackend,
    out_dtype: torch.dtype,
    name: str = "x",
) -> torch.Tensor:
    """Y = X W^T (+ bias) from 1x128-quantized X ``[M, K]`` and 128x128-quantized W ``[N, K]``; Y ``[M, N]``
    in `out_dtype`. The bias is added in `out_dtype` after the GEMM, the same on every backend."""
    _check_weight(w_q, w_s, x_q.shape[-1], name)
    # Shapes: [M, K] @ [N, K]^T -> [M, N]
    y = backend.gemm(x_q, x_s, w_q, w_s, role="fprop", out_dtype=out_dtype)
    if bias is not None:
        y = y + bias.to(out_dtype)
    return y


def linear_fp8(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_s: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    backend: str | GemmBackend = "auto",
    name: str = "x",
    live: torch.Tensor | None = None,
) -> torch.Tensor:
    """FP8 Linear forward. Input: x ``[..., K]`` bf16/fp16/fp32; w_q e4m3 ``[N, K]``; w_s fp32
    ``[ceil(N/128), ceil(K/128)]``; bias ``[N]`` or None. Output: ``[..., N]`` in x.dtype.
    `name` names x in non-finite errors (e.g. "model.layers.3.mlp.down_proj:input"); `live`: see
    `jetrl.gemm.quantize.quantize_1x128`."""
    if isinstance(backend, GemmBackend):  # the hot path: callers hold the backend object
        be = backend
    else:
        from jetrl.gemm import get_backend  # jetrl.gemm imports this module

        be = get_backend(backend)
    if x.dim() < 1:
        raise ValueError(f"{name}: linear_fp8 input must have a feature dim, got shape {tuple(x.shape)}")
    k = x.shape[-1]
    n = _check_weight(w_q, w_s, k, name)
    x2 = x.reshape(-1, k)
    x_q, x_s = quantize_1x128(x2, scale_layout=be.scale_layout, name=name, live=live)
    y = fprop(x_q, x_s, w_q, w_s, bias, backend=be, out_dtype=x.dtype, name=name)
    return y.reshape(*x.shape[:-1], n)
