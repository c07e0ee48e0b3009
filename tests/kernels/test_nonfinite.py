"""Every kernel flags NaN, +Inf and -Inf wherever they enter, through its group amax.

The kernels test only the NaN-propagating amax of each group (`jetrl.kernels._runtime.abs_max`), not
every element, so this file checks the cases where a non-finite value could hide from an amax: one
value in the last, partial group of the last row; infinities of either sign; SwiGLU inputs whose
product is NaN rather than Inf (``silu(-inf) * up``, ``silu(0) * inf``); RMSNorm input in a later chunk
of a long row (the chunked path) and a non-finite norm weight; an infinite scale of a saved FP8
activation. Each case must raise `NonFiniteError` naming the op and the tensor; finite hostile input
(huge and tiny values) must not. Under the Triton interpreter here, compiled on an sm_90 GPU.
"""

from __future__ import annotations

import pytest
import torch
from kernels_cases import launch, launcher, run_interpreted

from jetrl import quant
from jetrl.testing.numerics import has_sm90

INF, NAN = float("inf"), float("nan")


def _x(v, shape=(13, 300), at=(-1, -1), device="cpu"):
    """bf16 randn with one value `v` at `at` (default: the last, partial group of the last row)."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    x[at] = v
    return x.to(torch.bfloat16).to(device)


def _args(case: str, d: str) -> tuple:
    kernel, what = case.split(":")
    v = {"nan": NAN, "+inf": INF, "-inf": -INF}.get(what)
    if kernel == "quantize_1x128":
        return (_x(v, device=d), "row", "t.in")
    if kernel == "quantize_128x128":
        return (_x(v, device=d), True, "t.in")
    if kernel == "transpose_quantize":
        return (_x(v, device=d), "t.in")
    if kernel == "transpose_requantize":  # an infinite scale of the saved FP8 activation
        q, s = quant.quantize_1x128(torch.randn(13, 300))
        s[4, 1] = INF
        return (q.to(d), s.to(d), "t.in")
    if kernel == "rmsnorm_quant" and what == "weight-nan":
        w = torch.ones(300, device=d)
        w[7] = NAN
        return (_x(0.0, device=d), w, 1e-6, "row", "t.in")
    if kernel == "rmsnorm_quant":  # a long row (K = 5000 > 4096: the chunked path), v in the 2nd chunk
        return (_x(v, (3, 5000), (1, 4500), d), torch.ones(5000, device=d), 1e-6, "row", "t.in")
    # swiglu_quant: silu(-inf) = -inf / inf and silu(0) * inf are NaN, not Inf
    g, u = {
        "gate+inf": (INF, 1.0),
        "gate-inf": (-INF, 1.0),
        "gate-nan": (NAN, 1.0),
        "up+inf-gate0": (0.0, INF),
        "up-nan": (1.0, NAN),
    }[what]
    return (_x(g, device=d), _x(u, device=d), "row", "t.in")


CASES = [f"{k}:{v}" for k in ("quantize_1x128", "quantize_128x128", "transpose_quantize", "rmsnorm_quant")
         for v in ("nan", "+inf", "-inf")]  # fmt: skip
CASES += ["rmsnorm_quant:weight-nan", "transpose_requantize:scale-inf"]
CASES += [f"swiglu_quant:{v}" for v in ("gate+inf", "gate-inf", "gate-nan", "up+inf-gate0", "up-nan")]


def _finite_hostile(d):
    x = torch.randn(13, 300)
    x[0, :5] = torch.tensor([3e38, -3e38, 1e-38, -1e-45, 0.0])
    return (x.to(d), "row", "t.in")


@pytest.fixture(scope="module")
def interp_results():
    calls = [(*launcher(c.split(":")[0]), _args(c, "cpu"), {}) for c in CASES]
    calls.append(("quantize_1x128", "launch_quantize_1x128", _finite_hostile("cpu"), {}))
    return run_interpreted(calls)


@pytest.mark.parametrize("i", range(len(CASES)), ids=CASES)
def test_interpreter_flags_nonfinite(interp_results, i):
    op = "jetrl::" + CASES[i].split(":")[0]
    msg = interp_results[i]["nonfinite"]
    assert msg is not None and f"{op} on t.in" in msg, (CASES[i], msg)


def test_interpreter_finite_extremes_are_not_flagged(interp_results):
    assert interp_results[-1]["nonfinite"] is None, interp_results[-1]["nonfinite"]


@pytest.mark.skipif(not has_sm90(), reason="needs an sm_90 GPU to run the compiled Triton kernels")
@pytest.mark.parametrize("i", range(len(CASES)), ids=CASES)
def test_gpu_flags_nonfinite(i):
    import jetrl.kernels as K
    from jetrl.kernels.quantize_1x128 import launch_quantize_1x128

    kernel = CASES[i].split(":")[0]
    K.reset_nonfinite()
    launch(kernel, *_args(CASES[i], "cuda"))
    with pytest.raises(quant.NonFiniteError, match=rf"jetrl::{kernel} on t\.in"):
        K.check_nonfinite()
    launch_quantize_1x128(*_finite_hostile("cuda"))
    K.check_nonfinite()  # finite extremes: no flag


def test_a_flag_set_in_an_outgrown_buffer_is_still_reported():
    """The flag buffer grows when new tensor names appear; a CUDA graph captured before that keeps writing the
    old buffer (its address is baked into the graph). `check_nonfinite` reads it too and `reset` clears it."""
    from jetrl.kernels import _runtime as rt

    rt.reset_nonfinite()
    old, slot = rt.nonfinite_flag("test_op", "early.weight", torch.device("cpu"))
    for i in range(old.numel() + 1):  # more names than the buffer holds: it grows
        rt.nonfinite_flag("test_op", f"later_{i}.weight", torch.device("cpu"))
    new, again = rt.nonfinite_flag("test_op", "early.weight", torch.device("cpu"))
    assert new.data_ptr() != old.data_ptr() and again == slot and new.numel() > old.numel()
    old[slot] = 1  # what the graph captured before the growth writes
    with pytest.raises(quant.NonFiniteError, match="test_op on early.weight") as e:
        rt.check_nonfinite()
    assert "later_" not in str(e.value)
    rt.check_nonfinite()  # the reset cleared the outgrown buffer as well
    old[slot] = 1
    rt.reset_nonfinite()
    rt.check_nonfinite()
