"""jetrl.kernels: fused Triton FP8 kernels, each bit-exact against its ``torch_<op>`` reference.

Every public function is a torch custom op ``jetrl::<op>`` (one node in a traced graph, with a fake
implementation): on CUDA it launches the Triton kernel, on CPU it runs the reference built on
`jetrl.quant`. Non-finite input raises `jetrl.quant.NonFiniteError` at once on CPU; on CUDA it sets
a device flag that `check_nonfinite()` (call once per step) turns into the same error, naming the op
and the tensor.
"""

from ._runtime import check_nonfinite, reset_nonfinite
from .quantize_1x128 import quantize_1x128, torch_quantize_1x128
from .quantize_128x128 import quantize_128x128, torch_quantize_128x128

__all__ = [
    "check_nonfinite",
    "reset_nonfinite",
    "quantize_1x128",
    "torch_quantize_1x128",
    "quantize_128x128",
    "torch_quantize_128x128",
]
