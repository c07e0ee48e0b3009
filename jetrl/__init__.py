"""jetrl: on-policy FP8 reinforcement learning of LLMs.

One FP8 precision flow (1x128 activations, 128x128 weights, e4m3 with fp32 scales) shared by the
trainer and the vLLM rollout engine, and a lint that proves the two agree.
"""

from jetrl.quant import (
    NonFiniteError,
    dequantize_1x128,
    dequantize_128x128,
    gemm_emulated,
    quantize_1x128,
    quantize_128x128,
)
from jetrl.recipe import QuantSpec, Recipe, RecipeError

__version__ = "0.1.0"

__all__ = [
    "Recipe",
    "RecipeError",
    "QuantSpec",
    "NonFiniteError",
    "quantize_1x128",
    "quantize_128x128",
    "dequantize_1x128",
    "dequantize_128x128",
    "gemm_emulated",
]
