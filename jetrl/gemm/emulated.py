"""The `emulated` backend: `jetrl.quant.gemm_emulated` (float64 block sums, one rounding), the CPU
backend and the numeric reference of the other two. Runs on any device."""

from __future__ import annotations

from jetrl.gemm.base import GemmBackend
from jetrl.quant import gemm_emulated


class EmulatedBackend(GemmBackend):
    name = "emulated"
    scale_layout = "row"
    device_type = "any"

    def _gemm(self, a, a_s, b, b_s, *, role, out_dtype, c):
        # Shapes: [M, K] @ [N, K]^T -> [M, N]
        # gemm_emulated reads scales by index, so any stride layout is accepted as is.
        return gemm_emulated(a, a_s, b, b_s, role=role, out_dtype=out_dtype, c=c)

    @staticmethod
    def unavailable_reason() -> str | None:
        return None
