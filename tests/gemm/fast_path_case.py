"""Run JetFP8Linear fwd+bwd through the eager fast path under the Triton CPU interpreter (a script).

The fast path calls the Triton launchers of `jetrl.kernels` directly; on this CPU-only machine they run
only under ``TRITON_INTERPRET=1``, which must be set before Triton is imported, hence a subprocess
(`test_fast_path.py` starts it). CPU tensors are admitted to the fast path by adding "cpu" to
`jetrl.gemm.quantize.FAST_PATH_DEVICE_TYPES`. For each case the script runs the layer twice, once
through the ``jetrl::`` custom ops (the CPU references) and once through the launchers with the
custom-op route disabled (it raises if reached), and saves both results and the launcher call counts.
The interpreter's own e4m3 cast is not RNE, so each launcher call gets a ``precast`` buffer and its
bytes are re-cast correctly (as the kernel tests do); everything else is the launcher's output.
"""

from __future__ import annotations

import os
import sys
from collections import Counter

import ml_dtypes
import numpy as np
import torch
from torch import nn

from jetrl.gemm import quantize as gq
from jetrl.gemm.emulated import EmulatedBackend
from jetrl.linear import JetFP8Linear
from jetrl.recipe import Recipe

# (tokens, in_features, out_features, scale layout, fp8-saved X, main_grad, bias)
CASES = [
    (13, 256, 384, "row", True, False, True),
    (130, 128, 256, "deepgemm", True, True, False),
    (5, 384, 128, "row", False, False, False),
]


class _EmulatedDeepGemmLayout(EmulatedBackend):
    """The emulated GEMM fed DeepGEMM's MN-major activation scales (it reads scales by index), so the
    layout the deepgemm backend asks the quantizers for is exercised on CPU."""

    name = "emulated-deepgemm-layout"
    scale_layout = "deepgemm"


def _with_correct_cast(launcher, fn: str, *args, **kwargs):
    """Call `launcher` with a ``precast`` buffer and rebuild its bytes with a correct RNE e4m3 cast
    (ml_dtypes): the Triton interpreter's own fp8 cast is not round-to-nearest-even, which is why the
    kernel tests compare the pre-cast values too. Scales and the call itself are the launcher's."""
    x = args[0]
    shape = tuple(x.shape) if fn in ("launch_quantize_1x128", "launch_quantize_128x128") else tuple(x.shape)[::-1]
    pre = torch.empty(shape, dtype=torch.float32)
    out = launcher(*args, precast=pre, **kwargs)
    q = torch.from_numpy(pre.numpy().astype(ml_dtypes.float8_e4m3fn).view(np.uint8).copy()).view(torch.float8_e4m3fn)
    if len(out) == 4:  # quantize_128x128 with_transpose: q_t is q's bytes transposed
        return q, out[1], q.t().contiguous(), out[3]
    return (q, *out[1:])


def _run(case, counts: Counter | None):
    m, k, n, layout, fp8_saved, main_grad, bias = case
    torch.manual_seed(0)
    lin = nn.Linear(k, n, bias=bias).to(torch.bfloat16)
    be = _EmulatedDeepGemmLayout() if layout == "deepgemm" else EmulatedBackend()
    recipe = Recipe.from_name("jetrl-unified").replace(save_activations_fp8=fp8_saved)
    layer = JetFP8Linear.from_linear(lin, recipe=recipe, backend=be, layer_name="case.proj")
    if main_grad:
        layer.weight.main_grad = torch.zeros(n, k, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16).requires_grad_(True)
    dy = torch.randn(m, n, generator=g).to(torch.bfloat16)
    y = layer(x)
    y.backward(dy)
    dw = layer.weight.main_grad if main_grad else layer.weight.grad
    out = {"y": y.detach(), "dx": x.grad, "dw": dw, "db": None if not bias else layer.bias.grad}
    out["w_q"], out["w_s"] = layer.fp8_weight()
    return out


def main(dst: str) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run under the Triton interpreter"
    results = []
    for case in CASES:
        gq.FAST_PATH_DEVICE_TYPES = ("cuda",)
        ref = _run(case, None)

        counts: Counter = Counter()
        gq.FAST_PATH_DEVICE_TYPES = ("cpu", "cuda")
        real_launcher, real_route = gq._launcher, gq._route

        def counting_launcher(module, fn, real=real_launcher, counts=counts):
            f = real(module, fn)

            def wrapped(*args, counts=counts, **kwargs):
                counts[fn] += 1
                return _with_correct_cast(f, fn, *args, **kwargs)

            return wrapped

        def no_route(op, x):
            raise AssertionError(f"the fast path reached the jetrl::{op} custom op route")

        gq._launcher, gq._route = counting_launcher, no_route
        try:
            fast = _run(case, counts)
        finally:
            gq._launcher, gq._route = real_launcher, real_route
            gq.FAST_PATH_DEVICE_TYPES = ("cuda",)
        results.append({"case": case, "ref": ref, "fast": fast, "counts": dict(counts)})
    torch.save(results, dst)


if __name__ == "__main__":
    main(sys.argv[1])
