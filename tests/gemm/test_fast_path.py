"""The eager fast path of `jetrl.gemm.quantize`: when it is taken, that it is not taken while anything
traces or intercepts torch calls (the lint's capture must still see every ``jetrl::`` op), and that a
JetFP8Linear fwd+bwd through the Triton launchers gives the bytes of the custom-op path.

CPU tensors are admitted by adding "cpu" to ``FAST_PATH_DEVICE_TYPES`` (monkeypatched); the launchers
then run only under the Triton interpreter, in a subprocess (`fast_path_case.py`)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest
import torch
from fast_path_case import _Block
from torch import nn
from torch.overrides import TorchFunctionMode

from jetrl.convert import convert_model
from jetrl.gemm import quantize as gq
from jetrl.linear import JetFP8Linear
from jetrl.testing.numerics import has_sm90, sqnr_db
from jetrl.testing.subprocess_guard import HANG_GUARD_S


class _Passthrough(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.fixture
def cpu_fast(monkeypatch):
    monkeypatch.setattr(gq, "FAST_PATH_DEVICE_TYPES", ("cpu", "cuda"))


def test_fast_path_only_for_admitted_devices():
    assert gq.FAST_PATH_DEVICE_TYPES == ("cuda",)
    assert not gq.eager_fast_path(torch.zeros(2, 128))  # CPU: the custom ops (the references)


def test_fast_path_predicate(cpu_fast):
    x = torch.zeros(2, 128)
    assert gq.eager_fast_path(x) and gq.eager_fast_path(nn.Parameter(x))
    with _Passthrough():
        assert not gq.eager_fast_path(x)
    with torch.device("cpu"):  # a TorchFunctionMode too
        assert not gq.eager_fast_path(x)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = mode.from_tensor(x)
        assert not gq.eager_fast_path(fake) and not gq.eager_fast_path(x)
    assert not gq.eager_fast_path(fake)  # a tensor subclass, also outside its mode
    assert torch.func.vmap(lambda t: torch.full((), float(gq.eager_fast_path(t))))(x).eq(0).all()
    gq.set_quantize_impl("reference")
    try:
        assert not gq.eager_fast_path(x)
    finally:
        gq.set_quantize_impl("kernels")
    assert gq.eager_fast_path(x)


def test_fast_path_is_off_under_dynamo(cpu_fast):
    def f(t):
        return t + 1 if gq.eager_fast_path(t) else t - 1

    x = torch.zeros(4)
    assert f(x).eq(1).all()
    torch._dynamo.reset()
    assert torch.compile(f, backend="eager", fullgraph=True)(x).eq(-1).all()


def test_lint_capture_sees_the_same_ops_with_the_fast_path_enabled(cpu_fast, monkeypatch):
    """The lint's Recorder (a TorchFunctionMode) records the forward's jetrl ops; the autograd engine
    runs backward outside the caller's function modes, so backward ops are not recorded on either
    path. With the fast path admitted for CPU and every launcher raising, a Linear outside the capture
    reaches a launcher, and inside it records exactly what the custom-op path records."""
    from jetrl.lint.capture import Recorder

    torch.manual_seed(0)
    layer = JetFP8Linear.from_linear(nn.Linear(256, 128, bias=False), recipe="jetrl-unified", backend="emulated")
    x = torch.randn(8, 256, requires_grad=True)

    def recorded(fn):
        layer.invalidate_fp8_weight()
        with Recorder(layer) as rec:
            fn()
        seen = {}
        for (_, op), n in rec.op_counts.items():
            seen[op] = seen.get(op, 0) + n
        return seen

    monkeypatch.setattr(gq, "FAST_PATH_DEVICE_TYPES", ("cuda",))
    custom_ops = recorded(lambda: layer(x).backward(torch.randn(8, 128)))
    # a training forward makes the fprop operand and the saved wgrad operand (X^T along tokens)
    want = {"jetrl::quantize_1x128": 1, "jetrl::transpose_quantize": 1, "jetrl::quantize_128x128": 1}
    assert custom_ops == want, custom_ops

    monkeypatch.setattr(gq, "FAST_PATH_DEVICE_TYPES", ("cpu", "cuda"))

    def launcher(module, fn):
        def raising(*args, **kwargs):
            raise RuntimeError(f"launcher {fn} called")

        return raising

    monkeypatch.setattr(gq, "launcher", launcher)
    with pytest.raises(RuntimeError, match="launcher launch_quantize_1x128 called"):
        layer(x)
    assert recorded(lambda: layer(x)) == custom_ops


def test_linear_through_the_launchers_is_bitwise_the_custom_op_path():
    here = os.path.dirname(os.path.abspath(__file__))
    with tempfile.TemporaryDirectory() as d:
        dst = os.path.join(d, "out.pt")
        proc = subprocess.run(
            [sys.executable, os.path.join(here, "fast_path_case.py"), dst],
            env={**os.environ, "TRITON_INTERPRET": "1"},
            capture_output=True,
            text=True,
            timeout=HANG_GUARD_S,
        )
        assert proc.returncode == 0, f"interpreter subprocess failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}"
        results = torch.load(dst, weights_only=False)
    assert len(results) == 4
    fused = results.pop()
    _check_fused(fused)
    for r in results:
        m, k, n, layout, fp8_saved, main_grad, bias = r["case"]
        ctx = f"{m=} {k=} {n=} {layout=} {fp8_saved=} {main_grad=} {bias=}"
        for key, want in r["ref"].items():
            got = r["fast"][key]
            if want is None:
                assert got is None, f"{key}: {ctx}"
                continue
            assert got.dtype == want.dtype and got.shape == want.shape, f"{key}: {got.dtype} {want.dtype} {ctx}"
            if got.dtype == torch.float8_e4m3fn:
                got, want = got.view(torch.uint8), want.view(torch.uint8)
            assert torch.equal(got, want), f"{key} differs between the fast path and the custom ops: {ctx}"
        # X and dY, each 1x128 and 128x1 (X's 128x1 in the forward when it is what is saved, else in
        # the backward from the saved BF16 X); no requantization either way
        want_counts = {"launch_quantize_1x128": 2, "launch_quantize_128x128": 1, "launch_transpose_quantize": 2}
        assert r["counts"] == want_counts, f"{r['counts']} {ctx}"


@pytest.mark.skipif(not has_sm90(), reason="needs an sm_90 GPU for DeepGEMM and the Triton kernels")
@pytest.mark.parametrize("backend", ["deepgemm", "torch-blockwise"])
def test_gpu_fast_path_is_bitwise_the_custom_op_path(backend, monkeypatch):
    """On CUDA the fast path is on by default; with no device type admitted the custom ops run (in the
    forward and in the backward): both must give identical outputs and gradients."""
    torch.manual_seed(0)
    dev = torch.device("cuda")
    lin = nn.Linear(512, 384, bias=True, device=dev, dtype=torch.bfloat16)
    layer = JetFP8Linear.from_linear(lin, recipe="jetrl-unified", backend=backend, layer_name="gpu.proj")
    x = torch.randn(4, 33, 512, device=dev, dtype=torch.bfloat16)
    dy = torch.randn(4, 33, 384, device=dev, dtype=torch.bfloat16)
    assert gq.eager_fast_path(x)

    def run():
        xr = x.clone().requires_grad_(True)
        layer.weight.grad = layer.bias.grad = None
        layer.invalidate_fp8_weight()
        y = layer(xr)
        y.backward(dy)
        return y.detach(), xr.grad, layer.weight.grad, layer.bias.grad

    fast = run()
    monkeypatch.setattr(gq, "FAST_PATH_DEVICE_TYPES", ())
    slow = run()
    for name, a, b in zip(("y", "dx", "dw", "db"), fast, slow, strict=True):
        assert torch.equal(a, b), f"{backend}: {name} differs between the fast path and the custom ops"


def _check_fused(r):
    """RMSNorm+quantize -> SwiGLU+quantize -> down_proj through the launchers vs the custom ops (the CPU
    references). Under the interpreter the fused kernels' bf16 outputs differ from the references by
    an ulp in many elements (their own tests pair tolerances with dtypes), which moves group amaxes
    and so fp8 bytes: measured 45 dB on y/dx and 26-29 dB on the weight gradients (sums over 38 tokens
    of fp8 products). A wiring error is far below: swapping the SwiGLU backward's two gradients gives
    13 dB on dx and -3 dB on the norm/gate/up gradients."""
    assert r["case"] == "fused"
    for key, want in r["ref"].items():
        got = r["fast"][key]
        assert got is not None and want is not None and got.shape == want.shape, key
        s, floor = sqnr_db(want, got), (35 if key in ("y", "dx") else 20)
        assert torch.isfinite(got).all() and s >= floor, f"fused {key}: sqnr {s:.1f} dB < {floor}"
    assert r["counts"] == {
        "launch_rmsnorm_quant": 1,
        "launch_rmsnorm_backward": 1,
        "launch_swiglu_quant": 1,
        "launch_swiglu_backward": 1,
        "launch_quantize_128x128": 3,
        "launch_quantize_1x128": 3,  # dY of gate, up, down (dgrad); every X arrives quantized
        # dY of gate, up, down (wgrad) + the saved wgrad operands of the normed x (gate and up share
        # it, attached to x by the first) and of h
        "launch_transpose_quantize": 5,
    }, r["counts"]


@pytest.mark.skipif(not has_sm90(), reason="needs an sm_90 GPU for DeepGEMM and the Triton kernels")
def test_gpu_fused_fast_path_is_bitwise_the_custom_op_path(monkeypatch):
    """RMSNorm+quantize -> SwiGLU+quantize -> down_proj on DeepGEMM: the fast path (launchers and the
    `_RMSNormQuantFn` / `_SwiGLUQuantFn` autograd functions) vs the custom ops with their registered
    autograd: the same kernels, so identical outputs and gradients."""
    torch.manual_seed(0)
    block = _Block(512, 768).to(device="cuda", dtype=torch.bfloat16)
    report = convert_model(block, "jetrl-unified", backend="deepgemm", fuse=True)
    assert report.fused == ["post_attention_layernorm", "mlp"], report.fused
    x = torch.randn(3, 45, 512, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)

    def run():
        xr = x.clone().requires_grad_(True)
        for p in block.parameters():
            p.grad = None
        y = block(xr)
        y.backward(dy)
        return {"y": y.detach(), "dx": xr.grad, **{n: p.grad for n, p in block.named_parameters()}}

    fast = run()
    monkeypatch.setattr(gq, "FAST_PATH_DEVICE_TYPES", ())
    slow = run()
    for key, want in slow.items():
        assert torch.equal(fast[key], want), f"fused {key} differs between the fast path and the custom ops"
