"""The `torch-blockwise` backend: cuBLASLt block-scaled FP8 through ``torch._scaled_mm`` (torch >= 2.10
on sm_90, cuBLASLt >= 12.9).

``torch._scaled_mm(A [M, K] row-major, B [K, N] column-major, scale_a, scale_b)`` recognises the
DeepSeek recipe by the scale shapes and strides:

- 1x128 A: scale_a ``[M, ceil(K/128)]`` with strides ``(1, M)`` (outer-dim-major);
- 128x128 B: ``scale_b.t()`` is ``[ceil(N/128), ceil(K/128)]`` row-major (our weight scales, transposed view);
- 1x128 B (wgrad): ``scale_b.t()`` is ``[N, ceil(K/128)]`` with strides ``(1, N)``.

cuBLASLt wants M a multiple of 4 (M = 1 or 129 fail), so odd M is zero-padded and sliced off (rows are
independent: the padding cannot change the real rows). K is zero-padded to a multiple of 128 for
wgrad's token axis. With 128x128 B scales (fprop, dgrad), ceil(K/128) must also be a multiple of 4:
otherwise cuBLASLt returns wrong products without an error (seen on the H200 with torch 2.11.0+cu130
at K = 128, 256, 384, 640 and 1152, correct at K = 512; `tests/gemm/test_backends.py` pins it with the
raw call), so there K is zero-padded to a multiple of 512 (zero bytes, padding scales 1: exact).
The fp32 accumulate of wgrad is an fp32 output plus a separate add (cuBLASLt's
beta is not exposed by ``_scaled_mm``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from jetrl.gemm.base import GemmBackend, align, empty_result, pad_k, to_scale_layout
from jetrl.recipe import BLOCK


class TorchBlockwiseBackend(GemmBackend):
    name = "torch-blockwise"
    needs_block_multiples = True
    scale_layout = "deepgemm"
    device_type = "cuda"

    @staticmethod
    def unavailable_reason() -> str | None:
        if not hasattr(torch, "_scaled_mm"):
            return f"torch {torch.__version__} has no torch._scaled_mm"
        if not torch.cuda.is_available():
            return "no CUDA device (cuBLASLt block-scaled FP8 needs an sm_90 GPU)"
        major, minor = torch.cuda.get_device_capability()
        if major != 9:
            return f"cuBLASLt 1x128/128x128 block scaling runs on sm_90 only; this GPU is sm_{major}{minor}"
        return None

    def _gemm(self, a, a_s, b, b_s, *, role, out_dtype, c):
        m, n = a.shape[0], b.shape[0]
        if m == 0 or n == 0 or a.shape[1] == 0:
            return empty_result(m, n, out_dtype, c, a.device)
        kb = a_s.shape[1]
        if role != "wgrad" and kb % 4:  # see the module docstring: ceil(K/128) a multiple of 4
            a, b = pad_k(a, 4 * BLOCK), pad_k(b, 4 * BLOCK)
            a_s = F.pad(a_s, (0, align(kb, 4) - kb), value=1.0)
            b_s = F.pad(b_s, (0, align(kb, 4) - kb), value=1.0)
        a, b = pad_k(a), pad_k(b)
        mp = align(m, 4)
        if mp != m:
            a = torch.cat([a, torch.zeros((mp - m, a.shape[1]), dtype=a.dtype, device=a.device)])
            a_s = torch.cat([a_s, torch.ones((mp - m, a_s.shape[1]), dtype=a_s.dtype, device=a_s.device)])
        scale_a = to_scale_layout(a_s, "deepgemm")  # [mp, kb], strides (1, mp)
        if role == "wgrad":
            scale_b = to_scale_layout(b_s, "deepgemm").t()  # .t() is [N, kb] strides (1, N)
        else:
            scale_b = b_s.contiguous().t()  # .t() is [ceil(N/128), kb] row-major
        gemm_dtype = torch.float32 if (c is not None or role == "wgrad") else out_dtype
        # Shapes: [M, K] @ [N, K]^T -> [M, N]
        d = torch._scaled_mm(a, b.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=gemm_dtype)
        if mp != m:
            d = d[:m]
        if c is not None:
            d = c + d
        return d.to(out_dtype)
