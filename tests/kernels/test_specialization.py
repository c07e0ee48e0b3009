"""The rollout's FP8 producers compile no new variant for a token count the CUDA-graph capture did not cover.

vLLM warms its model up at the capture sizes (1, 2, 4, 8, 16, 24, ...) and then serves any token count: a
prefill of M tokens launches jetrl's producers with that M. Triton keys a compiled kernel by (among others)
which int arguments are divisible by 16, so a launch whose key no capture size produced stops to compile.
The ``"deepgemm"`` scale layout's group stride is ``align(M, 4)``: for M = 13..15 (mod 16) it is divisible
by 16 while M is not, a pair no capture size gives, and in its log vLLM's JIT monitor caught all three producers
compiling in the second RL step's rollout on the H200 (cc72ffc). `_runtime.SCALE_STRIDE_UNALIGNED` keeps that
stride's alignment out of the key. Each case clears the kernel's in-process cache, launches it at the sizes
the capture would, then at uncovered token counts, which must compile nothing and give the reference's
bytes. On CPU the kernels run under the interpreter, which compiles nothing: GPU only.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from kernels_cases import assert_bitwise, make_input

from jetrl.testing.numerics import has_sm90

pytestmark = pytest.mark.skipif(not has_sm90(), reason="needs an sm_90 GPU: Triton compiles kernels only there")

_CAPTURED = (1, 2, 4, 8, 16, 24, 32)  # a capture's sizes: every (M == 1, M % 16 == 0) variant
_UNCOVERED = (13, 14, 15, 29, 30, 31, 45, 3061)  # prefills whose align(M, 4) % 16 == 0 while M % 16 != 0
_K = 4096  # the Llama-3.1-8B hidden size (swiglu: its intermediate size's 14336 is cut to keep this short)


def _producers():
    """(name, kernel, run): ``run(m)`` launches the producer as the fused engine does (bytes only, vLLM's slot
    mapping as live rows) and as the trainer does (its output stored too), and returns the engine's ``(q, s)``
    with what they must equal: `torch_quantize_1x128` of the stored output (the kernels' contract; y of the
    norm is within ulps of HF, its bytes are those of its own y) or, for quantize_1x128, of the input."""
    # the modules (the package's names of the same spelling are the ops)
    q1, rq, sq = (
        importlib.import_module(f"jetrl.kernels.{m}") for m in ("quantize_1x128", "rmsnorm_quant", "swiglu_quant")
    )

    w = (1 + 0.1 * make_input(1, _K, torch.float32, "randn", seed=1)[0]).to(torch.bfloat16).cuda()

    def inputs(m):
        x, r = (make_input(m, _K, torch.bfloat16, "randn", seed=s, device="cuda") for s in (0, 1))
        return x, r, torch.arange(m, dtype=torch.int64, device="cuda")

    def want(t):
        return q1.torch_quantize_1x128(t, scale_layout="deepgemm", name="t.want")

    def norm(m):
        x, r, live = inputs(m)
        y = rq.launch_add_rmsnorm_quant(x, r, w, 1e-5, "deepgemm", "t.n", live=live)[0]
        q, s = rq.launch_add_rmsnorm_quant(x, r, w, 1e-5, "deepgemm", "t.n", store_y=False, live=live)[1:3]
        return (q, s), want(y)

    def swiglu(m):
        g, u, live = inputs(m)
        h = sq.launch_swiglu_quant(g, u, "deepgemm", "t.h", live=live)[0]
        return sq.launch_swiglu_quant(g, u, "deepgemm", "t.h", store_h=False, live=live)[1:], want(h)

    def quant(m):
        x, _, live = inputs(m)
        return q1.launch_quantize_1x128(x, "deepgemm", "t.x", live=live), want(x)

    return [
        ("add_rmsnorm_quant", rq._rmsnorm_quant_kernel, norm),
        ("swiglu_quant", sq._swiglu_quant_kernel, swiglu),
        ("quantize_1x128", q1._quantize_1x128_kernel, quant),
    ]


@pytest.mark.parametrize("i", range(3), ids=["add_rmsnorm_quant", "swiglu_quant", "quantize_1x128"])
def test_uncovered_token_counts_compile_nothing(i):
    import triton
    from triton import knobs

    from jetrl.kernels import check_nonfinite

    name, kernel, run = _producers()[i]
    compiled: list[str] = []
    kernel.device_caches.clear()  # this process's variants: other tests may have compiled any of them
    previous = knobs.runtime.jit_post_compile_hook

    def hook(**kw):
        compiled.append(f"{getattr(kw.get('fn'), 'name', '?')} {kw.get('key')}")
        return previous(**kw) if previous is not None else None

    knobs.runtime.jit_post_compile_hook = hook
    try:
        for m in _CAPTURED:
            run(m)
        torch.cuda.synchronize()
        assert compiled, f"{name}: the warm-up compiled nothing: is the hook of Triton {triton.__version__} called?"
        warm = len(compiled)
        for m in _UNCOVERED:
            (q, s), (q_ref, s_ref) = run(m)
            ctx = f"{name} M={m}"
            assert_bitwise("q", q, q_ref, ctx)
            assert_bitwise("scales", s, s_ref, ctx)
            assert s.stride() == s_ref.stride(), f"{ctx}: scale strides {s.stride()} vs {s_ref.stride()}"
        check_nonfinite()
    finally:
        knobs.runtime.jit_post_compile_hook = previous
    assert len(compiled) == warm, (
        f"{name}: token counts {_UNCOVERED} compiled {len(compiled) - warm} variant(s) the capture sizes "
        f"{_CAPTURED} did not: {compiled[warm:]}"
    )
