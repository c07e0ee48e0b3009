"""kernels/ installs as jetrl.kernels and never acts as a bare top-level `kernels` package."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from jetrl.testing.subprocess_guard import HANG_GUARD_S

ROOT = Path(__file__).resolve().parents[2]


def test_bare_kernels_import_from_the_checkout_is_inert():
    """With the checkout's root on sys.path (`python -m pytest` / `python -m jetrl.demo` run from it),
    transformers' probe of the PyPI package `kernels` imports this folder as `kernels`. It must stay
    inert: transformers reads it as not installed and the jetrl:: ops are not registered a second time
    by another copy of the code (which would bind torch.ops.jetrl.* to that copy)."""
    code = """
import sys
import jetrl.kernels
import torch
before = torch._library.custom_ops.OPDEFS["jetrl::quantize_1x128"]._init_fn
from transformers.utils.import_utils import is_kernels_available
assert not is_kernels_available(), "our kernels/ folder passed for the PyPI kernels package"
import kernels
assert kernels.__all__ == [], kernels.__all__
assert not [m for m in sys.modules if m.startswith("kernels.")], sorted(sys.modules)
assert torch._library.custom_ops.OPDEFS["jetrl::quantize_1x128"]._init_fn is before
assert jetrl.kernels.quantize_1x128.__module__ == "jetrl.kernels.quantize_1x128"
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
