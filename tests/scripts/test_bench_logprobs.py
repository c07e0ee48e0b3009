"""bench_logprobs drives vLLM's own log-prob bookkeeping with both containers and checks that each read-out
returns the sampler's log-probs (the timings are the host's to measure, not the test's)."""

from __future__ import annotations

import json

import pytest
from scripts_cases import load_script


def test_both_containers_read_out_the_samplers_logprobs(tmp_path):
    pytest.importorskip("vllm", reason="drives vLLM's LogprobsProcessor")
    bench = load_script("bench_logprobs")
    out = tmp_path / "lp.json"
    assert bench.main(["--batch", "3", "--tokens", "5", "--repeats", "2", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["benchmark"] == "logprobs" and (r["batch"], r["tokens"], r["repeats"]) == (3, 5, 2) and r["commit"]
    assert set(r["containers"]) == {"dict", "flat"}
    for c in r["containers"].values():
        assert len(c["runs"]) == 2 and c["step_ms"] > 0 and c["readout_ms"] > 0
    assert set(r["flat_saves"]) == {"step_ms", "readout_ms", "per_generate_ms"}


def test_a_read_out_that_differs_from_the_sampler_fails(monkeypatch):
    pytest.importorskip("vllm", reason="drives vLLM's LogprobsProcessor")
    bench = load_script("bench_logprobs")
    import jetrl.rollout.adapter as adapter

    monkeypatch.setattr(adapter, "_sampled_logprobs", lambda flat, ids: [0.0] * len(ids))
    with pytest.raises(AssertionError, match="flat: the read-out log-probs are not the sampler's"):
        bench._run("flat", 2, 3, seed=0)


@pytest.mark.parametrize("flag", ["--batch", "--tokens", "--repeats"])
def test_counts_below_one_are_refused(flag):
    bench = load_script("bench_logprobs")
    with pytest.raises(SystemExit):
        bench.main([flag, "0"])
