"""jetrl.kernels: fused Triton FP8 kernels, each bit-exact against its ``torch_<op>`` reference.

Every public function is a torch custom op ``jetrl::<op>`` (one node in a traced graph, with a fake
implementation): on CUDA it launches the Triton kernel, on CPU it runs the reference built on
`jetrl.quant`. Non-finite input raises `jetrl.quant.NonFiniteError` at once on CPU; on CUDA it sets
a device flag that `check_nonfinite()` (call once per step) turns into the same error, naming the op
and the tensor.

Ops (one file each): `quantize_1x128`, `quantize_128x128`, `transpose_quantize` /
`transpose_requantize`, `rmsnorm_quant` / `add_rmsnorm_quant` (the residual add fused in,
forward only) / `rmsnorm_backward`, `swiglu_quant` / `swiglu_backward`, and `rope` /
`rope_pair` (transformers' rotary embedding, not FP8: the trainer-matched rollout engine's RoPE).
Not an op: `jetrl.kernels.digest`, the weight sync's byte digest (`jetrl.rollout.sync.tensor_digest`).
"""

if __name__ != "jetrl.kernels":
    # This folder was found as a bare top-level `kernels` package: the checkout's root is on sys.path
    # (`python -m ...` run from it). transformers probes the unrelated PyPI package `kernels` by
    # importing it; stay inert (no version, no ops) so that probe reads "not installed" and the
    # jetrl:: custom ops are registered once, by jetrl.kernels, never by a second copy of this code.
    __all__: list[str] = []
else:
    from ._runtime import check_nonfinite, reset_nonfinite
    from .quantize_1x128 import quantize_1x128, torch_quantize_1x128
    from .quantize_128x128 import quantize_128x128, torch_quantize_128x128
    from .rmsnorm_quant import (
        add_rmsnorm_quant,
        rmsnorm_backward,
        rmsnorm_quant,
        torch_add_rmsnorm_quant,
        torch_rmsnorm,
        torch_rmsnorm_backward,
        torch_rmsnorm_quant,
    )
    from .rope import rope, rope_pair, rope_table, torch_rope
    from .swiglu_quant import swiglu_backward, swiglu_quant, torch_swiglu_backward, torch_swiglu_quant
    from .transpose_quantize import (
        torch_transpose_quantize,
        torch_transpose_requantize,
        transpose_quantize,
        transpose_requantize,
    )

    __all__ = [
        "check_nonfinite",
        "reset_nonfinite",
        "quantize_1x128",
        "torch_quantize_1x128",
        "quantize_128x128",
        "torch_quantize_128x128",
        "transpose_quantize",
        "torch_transpose_quantize",
        "transpose_requantize",
        "torch_transpose_requantize",
        "rmsnorm_quant",
        "add_rmsnorm_quant",
        "torch_add_rmsnorm_quant",
        "torch_rmsnorm",
        "torch_rmsnorm_quant",
        "rmsnorm_backward",
        "torch_rmsnorm_backward",
        "swiglu_quant",
        "torch_swiglu_quant",
        "swiglu_backward",
        "torch_swiglu_backward",
        "rope",
        "rope_pair",
        "rope_table",
        "torch_rope",
    ]
