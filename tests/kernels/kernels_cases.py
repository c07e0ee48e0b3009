"""Shared cases and helpers for the kernel tests: shape lists, hostile inputs, the interpreter runner.

The Triton CPU interpreter must be switched on (``TRITON_INTERPRET=1``) before a kernel module is
imported, and other test directories import `jetrl.kernels` in compiled mode. So interpreter runs
happen in a subprocess: `run_interpreted` pickles the launcher calls, runs them in a fresh
interpreter-mode Python (this file as a script), and returns each call's outputs, its (possibly
written) arguments and the `check_nonfinite` message, if any. All comparisons stay in the tests.

The interpreter evaluates a ``tl.reduce`` with a user combine function (the kernels' NaN-keeping
`abs_max`) one element at a time: one Python call of the combine function per element of the tile
(padding lanes included), most of every interpreted launch here. `run_interpreted` swaps in
`_fold_reduce`, which performs the very same left fold along the reduced axis (element 0, then
``combine(acc, element j)`` for j = 1, 2, ...) with the kernel's own combine function, but on all the
fold's independent outputs at once: the same operations in the same order for each output, so the same
bits, in far fewer Python calls (the kernel tests' time is in the CI log's ``--durations`` list).
`test_interpreter_reduce.py` checks that every kernel's reductions, on hostile input, give the same
bits under both (``stock_reduce=True`` runs the interpreter's own loop).
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import tempfile

import ml_dtypes
import numpy as np
import pytest
import torch

from jetrl.testing.subprocess_guard import HANG_GUARD_S

# Real model dims (Llama-8B hidden 4096, Qwen 5120, Llama-8B MLP 14336) beside hostile ones:
# M = 1 / 13 / 4095 (not a multiple of 128 or 4), K with partial last groups.
GPU_SHAPES = [
    pytest.param(4096, 4096, id="M4096-K4096"),
    pytest.param(4095, 5120, id="M4095-K5120"),
    pytest.param(1, 14336, id="M1-K14336"),
    pytest.param(13, 4096, id="M13-K4096"),
    pytest.param(257, 14336, id="M257-K14336"),
    pytest.param(13, 200, id="M13-K200-partial"),
    pytest.param(129, 1000, id="M129-K1000-partial"),
    pytest.param(1, 72, id="M1-K72-partial"),
]

# Small shapes for the CPU interpreter (each hostile property kept, sizes tiny).
INTERP_SHAPES = [(1, 128), (13, 300), (130, 257)]

KINDS = ("randn", "zero-group", "wide-range")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def make_input(
    m: int, k: int, dtype: torch.dtype, kind: str, *, seed: int = 0, device="cpu", hi: int | None = None
) -> torch.Tensor:
    """``[m, k]`` test data. ``zero-group``: the first 128-group of row 0 and the first 128 rows of
    column 0 are zero; ``wide-range``: each row and each 128-column group scaled by its own power of
    ten spanning 1e-30..1e30 (1e-3..1e3 for fp16; ``hi`` overrides the exponent range)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g, dtype=torch.float32)
    if kind == "zero-group":
        x[0, :128] = 0.0
        x[:128, 0] = 0.0
    elif kind == "wide-range":
        hi = hi if hi is not None else 3 if dtype == torch.float16 else 30
        col_exp = torch.linspace(-hi, hi, (k + 127) // 128).repeat_interleave(128)[:k]
        row_exp = torch.randint(-hi, hi + 1, (m, 1), generator=g).float()
        x = x * torch.pow(10.0, torch.clamp(col_exp[None, :] + row_exp, -hi, hi))
    elif kind != "randn":
        raise ValueError(kind)
    return x.to(dtype).to(device)


def launcher(op: str) -> tuple[str, str]:
    """(module, launcher name) of a kernel op: ``launch_<op>`` in ``jetrl.kernels.<module>``, where the
    from-FP8 variant `transpose_requantize` lives beside `transpose_quantize`."""
    return ("transpose_quantize" if op == "transpose_requantize" else op), f"launch_{op}"


def launch(op: str, *args, **kwargs):
    """Run ``launch_<op>`` (the compiled kernel on CUDA inputs)."""
    module, fn = launcher(op)
    return getattr(importlib.import_module(f"jetrl.kernels.{module}"), fn)(*args, **kwargs)


def e4m3_bytes_of(pre: torch.Tensor) -> torch.Tensor:
    """A correct RNE cast of already-clamped fp32 values to e4m3 bytes (ml_dtypes, independent of torch)."""
    arr = pre.detach().cpu().numpy().astype(ml_dtypes.float8_e4m3fn)
    return torch.from_numpy(arr.view(np.uint8).copy())


def u8(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


def assert_bitwise(name: str, got: torch.Tensor, want: torch.Tensor, ctx: str = "") -> None:
    """Bitwise equality of bytes (e4m3 -> uint8) or fp32 (-> int32), with a count and first mismatch."""
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)} {ctx}"
    a, b = got.detach().cpu(), want.detach().cpu()
    if a.dtype == torch.float8_e4m3fn:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    elif a.dtype == torch.float32:
        a, b = a.contiguous().view(torch.int32), b.contiguous().view(torch.int32)
    diff = a != b
    n = int(diff.sum())
    if n:
        idx = tuple(int(i) for i in torch.nonzero(diff)[0])
        raise AssertionError(
            f"{name}: {n}/{a.numel()} differ {ctx}; first at {idx}: got {got.detach().cpu()[idx]!r} "
            f"want {want.detach().cpu()[idx]!r}"
        )


# one unit in the last place of each dtype (relative), for fused-op outputs that are not bitwise
ULP = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 2.0**-23}


def assert_close_ulps(name: str, got: torch.Tensor, want: torch.Tensor, ulps: float, ctx: str = "") -> None:
    """|got - want| <= ulps * ULP[dtype] * |want| + ulps * tiny: dtype-paired tolerance (the absolute
    floor covers subnormal results, which flush differently), reporting the first bad element."""
    assert got.shape == want.shape and got.dtype == want.dtype, f"{name}: {got.dtype}{tuple(got.shape)} {ctx}"
    a, b = got.detach().cpu().double(), want.detach().cpu().double()
    tol = ulps * ULP[got.dtype] * b.abs() + ulps * torch.finfo(got.dtype).tiny
    err = (a - b).abs()
    bad = err > tol
    if bool(bad.any()):
        i = tuple(int(v) for v in torch.nonzero(bad)[0])
        raise AssertionError(
            f"{name}: {int(bad.sum())}/{a.numel()} beyond {ulps} ulp {ctx}; "
            f"first at {i}: got {a[i]:.9g} want {b[i]:.9g}"
        )


def run_interpreted(calls: list[tuple[str, str, tuple, dict]], *, stock_reduce: bool = False) -> list[dict]:
    """Run ``jetrl.kernels.<module>.<function>(*args, **kwargs)`` for each call under the Triton
    interpreter in a subprocess. Returns per call ``{"out": ..., "args": ..., "nonfinite": str|None,
    "reduce": the name of the interpreter's reduce loop it ran under}``.
    ``stock_reduce``: keep the interpreter's element-by-element ``tl.reduce`` (else `_fold_reduce`)."""
    with tempfile.TemporaryDirectory() as d:
        src, dst = os.path.join(d, "calls.pt"), os.path.join(d, "results.pt")
        torch.save(calls, src)
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        cmd = [sys.executable, __file__, src, dst, "stock" if stock_reduce else "fold"]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
        if proc.returncode != 0:
            pytest.fail(f"interpreter subprocess failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
        return torch.load(dst, weights_only=False)


def _fold_reduce(self, input):
    """`triton.runtime.interpreter.ReduceOps.generic_reduce` (Triton 3.9), vectorized over the outputs.

    The interpreter's loop visits the input in row-major order and, for each output, starts from the
    element at index 0 of the axis and then applies ``combine_fn(acc, x_j)`` for j = 1, 2, ... in turn,
    storing each result back in the input's numpy dtype. Here step j does the same for every output at
    once: ``combine_fn`` (the kernel's own function) on ``[outputs]`` tensors instead of scalar ones.
    Triton combine functions act on scalars, so elementwise; each output sees the same operations on
    the same operands in the same order, hence the same bits (NaN payloads included)."""
    import triton.language as tl

    original_axis = self.axis
    input, axis = self.unravel(input, self.axis)
    data = [arg.handle.data for arg in input]
    shape = data[0].shape
    out_shape = shape[:axis] + shape[axis + 1 :]
    acc = [np.asarray(np.take(d, 0, axis=axis)).astype(d.dtype) for d in data]
    for j in range(1, shape[axis]):
        acc_t = tuple(self.to_tensor(a, arg.dtype) for a, arg in zip(acc, input, strict=True))
        x_t = tuple(self.to_tensor(np.take(d, j, axis=axis), arg.dtype) for d, arg in zip(data, input, strict=True))
        ret = self.combine_fn.fn(*acc_t, *x_t)
        ret = ret if isinstance(ret, tuple) else (ret,)
        acc = [
            np.asarray(r.handle.data if isinstance(r, tl.core.tensor) else r).astype(d.dtype).reshape(out_shape)
            for r, d in zip(ret, data, strict=True)
        ]
    # pack the outputs exactly as generic_reduce does
    out = []
    for i, a in enumerate(acc):
        if self.keep_dims:
            if original_axis is not None:
                a = np.expand_dims(a, axis)
            else:
                for _ in range(len(shape)):
                    a = np.expand_dims(a, 0)
        elif original_axis is None:
            a = a.item()
        out.append(self.to_tensor(a, input[i].dtype))
    return out


def _use_fold_reduce() -> None:
    from triton.runtime import interpreter

    # the loop `_fold_reduce` replaces; a Triton without it has changed the interpreter: re-read it first
    assert callable(getattr(interpreter.ReduceOps, "generic_reduce", None)), "Triton's interpreter changed"
    interpreter.ReduceOps.generic_reduce = _fold_reduce


def _main(src: str, dst: str, reduce: str) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    assert reduce in ("stock", "fold"), reduce
    if reduce == "fold":
        _use_fold_reduce()
    from triton.runtime.interpreter import ReduceOps

    from jetrl.kernels import check_nonfinite
    from jetrl.quant import NonFiniteError

    results = []
    for module, fn, args, kwargs in torch.load(src, weights_only=False):
        out = getattr(importlib.import_module(f"jetrl.kernels.{module}"), fn)(*args, **kwargs)
        try:
            check_nonfinite()
            msg = None
        except NonFiniteError as e:
            msg = str(e)
        results.append({"out": out, "args": args, "nonfinite": msg, "reduce": ReduceOps.generic_reduce.__name__})
    torch.save(results, dst)


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2], sys.argv[3])
