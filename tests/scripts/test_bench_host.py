"""bench_host.py imports on a CPU-only machine and refuses to run there with a clear message."""

from __future__ import annotations

import sys

import pytest
import torch
from scripts_cases import load_script


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_refuses_without_cuda(monkeypatch):
    bench = load_script("bench_host")
    monkeypatch.setattr(sys, "argv", ["bench_host.py"])
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bench.main()
