"""bench_attention's SDPA paths compute the same attention for every real token, and its CPU run records
every path (the backends themselves are the GPU's to time)."""

from __future__ import annotations

import json

import pytest
import torch
from scripts_cases import load_script


def test_paths_agree_on_real_tokens():
    bench = load_script("bench_attention")
    q, k, v, mask = bench._inputs(4, 2, 16, 3, 24, "cpu", torch.float32)
    outs = {p: bench._call(p, q, k, v, mask) for p in bench.PATHS}
    for row in range(3):
        real = 24 - row  # right-padded: row i holds width - i real tokens
        for p in ("causal_gqa", "causal_repeat"):
            torch.testing.assert_close(outs[p][row, :, :real], outs["masked"][row, :, :real], rtol=0, atol=1e-6)
    assert not torch.equal(outs["causal_gqa"][1, :, -1], outs["masked"][1, :, -1])  # padding differs: masked there
    with pytest.raises(ValueError, match="unknown path 'dense'"):
        bench._call("dense", q, k, v, mask)


def test_cpu_run_records_every_path(tmp_path):
    bench = load_script("bench_attention")
    out = tmp_path / "a.json"
    assert bench.main(["--tiny", "--repeats", "1", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["benchmark"] == "attention" and r["width"] == 64 and r["commit"]
    assert set(r["results"]) == set(bench.PATHS)
    for by_backend in r["results"].values():
        assert set(by_backend) == {"auto", "math"}
        for m in by_backend.values():
            assert m["fwd_ms"] > 0 and m["fwd_bwd_ms"] > 0, m


def test_a_backend_that_cannot_run_is_recorded_with_the_reason():
    bench = load_script("bench_attention")
    tensors = bench._inputs(4, 2, 16, 2, 32, "cpu", torch.float32)
    r = bench.measure("masked", "cudnn", tensors, 1)  # cuDNN attention has no CPU kernel
    assert set(r) == {"refused"} and "scaled_dot_product_attention" in r["refused"]
