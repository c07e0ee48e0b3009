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

from jetrl.convert import convert_model
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


_PRECAST = {  # launcher -> (precast is [K, M] (transposed), index of the bytes among its outputs)
    "launch_quantize_1x128": (False, 0),
    "launch_quantize_128x128": (False, 0),
    "launch_transpose_quantize": (True, 0),
    "launch_transpose_requantize": (True, 0),
    "launch_rmsnorm_quant": (False, 1),
    "launch_swiglu_quant": (False, 1),
}


def _with_correct_cast(launcher, fn: str, *args, **kwargs):
    """Call `launcher` with a ``precast`` buffer and rebuild its bytes with a correct RNE e4m3 cast
    (ml_dtypes): the Triton interpreter's own fp8 cast is not round-to-nearest-even, which is why the
    kernel tests compare the pre-cast values too. Scales and the call itself are the launcher's.
    Backward launchers (no fp8 output) run as they are."""
    if fn not in _PRECAST:
        return launcher(*args, **kwargs)
    transposed, iq = _PRECAST[fn]
    shape = tuple(args[0].shape)
    pre = torch.empty(shape[::-1] if transposed else shape, dtype=torch.float32)
    out = list(launcher(*args, precast=pre, **kwargs))
    q = torch.from_numpy(pre.numpy().astype(ml_dtypes.float8_e4m3fn).view(np.uint8).copy()).view(torch.float8_e4m3fn)
    out[iq] = q
    if fn == "launch_quantize_128x128" and len(out) == 4:  # with_transpose: q_t is q's bytes transposed
        out[2] = q.t().contiguous()
    return tuple(out)


class _Norm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter((1.0 + 0.1 * torch.randn(d)).to(torch.bfloat16))
        self.variance_epsilon = 1e-6


class _MLP(nn.Module):
    def __init__(self, d, inter):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(d, inter, bias=False), nn.Linear(d, inter, bias=False)
        self.down_proj = nn.Linear(inter, d, bias=False)
        self.act_fn = nn.SiLU()


class _Block(nn.Module):
    """The MLP half of a decoder layer, HF names, for ``convert_model(fuse=True)``."""

    def __init__(self, d, inter):
        super().__init__()
        self.post_attention_layernorm = _Norm(d)
        self.mlp = _MLP(d, inter)

    def forward(self, x):
        return x + self.mlp(self.post_attention_layernorm(x))


def _run_fused(m=19, d=256, inter=384):
    """x -> JetRMSNormQuant -> JetSwiGLUMLP(gate/up/down JetFP8Linear), DeepGEMM's scale layout."""
    torch.manual_seed(0)
    block = _Block(d, inter).to(torch.bfloat16)
    report = convert_model(block, Recipe.from_name("jetrl-unified"), backend=_EmulatedDeepGemmLayout(), fuse=True)
    assert report.fused == ["post_attention_layernorm", "mlp"], report.fused
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, m, d, generator=g).to(torch.bfloat16).requires_grad_(True)
    y = block(x)
    y.backward(torch.randn(2, m, d, generator=g).to(torch.bfloat16))
    out = {"y": y.detach(), "dx": x.grad}
    for name, p in block.named_parameters():
        out[name] = p.grad
    return out


def _run(case):
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
    for case in [*CASES, "fused"]:
        run = _run_fused if case == "fused" else lambda case=case: _run(case)
        gq.FAST_PATH_DEVICE_TYPES = ("cuda",)
        ref = run()

        counts: Counter = Counter()
        gq.FAST_PATH_DEVICE_TYPES = ("cpu", "cuda")
        real_launcher, real_route = gq.launcher, gq._route

        def counting_launcher(module, fn, real=real_launcher, counts=counts):
            f = real(module, fn)

            def wrapped(*args, counts=counts, **kwargs):
                counts[fn] += 1
                return _with_correct_cast(f, fn, *args, **kwargs)

            return wrapped

        def no_route(op, x):
            raise AssertionError(f"the fast path reached the jetrl::{op} custom op route")

        gq.launcher, gq._route = counting_launcher, no_route
        try:
            fast = run()
        finally:
            gq.launcher, gq._route = real_launcher, real_route
            gq.FAST_PATH_DEVICE_TYPES = ("cuda",)
        results.append({"case": case, "ref": ref, "fast": fast, "counts": dict(counts)})
    torch.save(results, dst)


if __name__ == "__main__":
    main(sys.argv[1])
