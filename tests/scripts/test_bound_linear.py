"""scripts/bound_linear.py: the FP8 Linear speedup bounds computed from the committed H200 results."""

from __future__ import annotations

import json
import os

import pytest
from scripts_cases import load_script

RESULTS = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "results")


@pytest.fixture(scope="module")
def bound():
    return load_script("bound_linear")


def _load(name):
    with open(os.path.join(RESULTS, name)) as f:
        return json.load(f)


def test_gemm_rates_from_a_profile(bound):
    # o_proj 8192 tokens: 2*8192*4096*4096 = 274.9 GFLOP per GEMM; two 1d2d calls in 0.4 ms, one 1d1d in 0.5 ms
    linear = {
        "linears": [{"linear": "o_proj", "tokens": 8192, "N": 4096, "K": 4096}],
        "profile": {
            "linear": "o_proj",
            "tokens": 8192,
            "kernels": [
                {"name": "void deep_gemm::sm90_fp8_gemm_1d2d_impl<...>", "ms": 0.4, "calls": 2.0},
                {"name": "void deep_gemm::sm90_fp8_gemm_1d1d_impl<...>", "ms": 0.5, "calls": 1.0},
                {"name": "_transpose_quantize_kernel", "ms": 0.08, "calls": 2.0},
            ],
        },
    }
    fwd, wgrad = bound.gemm_rates(linear)
    flops = 2 * 8192 * 4096 * 4096
    assert fwd == pytest.approx(2 * flops / 0.4e-3 / 1e12)
    assert wgrad == pytest.approx(flops / 0.5e-3 / 1e12)
    linear["profile"]["kernels"] = linear["profile"]["kernels"][1:]
    with pytest.raises(SystemExit, match="sm90_fp8_gemm_1d2d"):
        bound.gemm_rates(linear)


def test_committed_h200_bounds_hold_the_measurements(bound):
    result = bound.summarize(_load("linear-nvidia-h200.json"), _load("kernels-nvidia-h200.json"))
    assert len(result["rows"]) == 8
    for r in result["rows"]:
        # less traffic, higher bound; and no measured step may beat a bound whose passes run at copy speed
        assert r["gemm_only"] > r["favorable"] > r["separate"] > r["measured_graph"], r
    g = result["geomean"]
    assert g["separate"] < result["goal"] < g["gemm_only"]
