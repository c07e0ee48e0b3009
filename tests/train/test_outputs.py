"""Metric stream, atomic checkpoints, progress bar and plots (no model involved)."""

from __future__ import annotations

import io
import json

import pytest
import torch

from jetrl.train.checkpoint import CheckpointError, latest_step, load_latest, save_checkpoint
from jetrl.train.metrics import REQUIRED_KEYS, MetricsWriter, read_metrics
from jetrl.train.plots import plot_runs
from jetrl.train.progress import ProgressBar, format_seconds


def _row(step: int) -> dict:
    r = {k: 0.5 for k in REQUIRED_KEYS}
    r["step"] = step
    return r


def test_metrics_resume_truncates_to_checkpoint(tmp_path):
    p = tmp_path / "metrics.jsonl"
    with MetricsWriter(p) as w:
        for s in range(1, 6):
            w.write(_row(s))
    with open(p, "a") as f:
        f.write('{"step": 6, "reward/me')  # torn line from a kill
    with MetricsWriter(p, resume_step=3) as w:
        assert w.last_step == 3
        with pytest.raises(ValueError, match="step 5 does not follow step 3"):
            w.write(_row(5))
        w.write(_row(4))
    assert [r["step"] for r in read_metrics(p)] == [1, 2, 3, 4]
    # a fresh (non-resume) writer starts a new stream
    MetricsWriter(p).close()
    assert read_metrics(p) == []


def test_metrics_require_keys_and_nan_becomes_null(tmp_path):
    with MetricsWriter(tmp_path / "m.jsonl") as w:
        with pytest.raises(ValueError, match="mismatch/logp_abs_diff_mean"):
            w.write({"step": 1})
        r = _row(1)
        r["actor/entropy"] = float("nan")
        w.write(r)
    assert json.loads((tmp_path / "m.jsonl").read_text())["actor/entropy"] is None


def test_checkpoint_atomic_latest_and_keep(tmp_path):
    d = tmp_path / "ckpt"
    assert latest_step(d) is None
    with pytest.raises(CheckpointError, match="nothing to resume"):
        load_latest(d)
    (d / ".tmp-step_000009-1").mkdir(parents=True)  # debris of a killed writer
    for s in (2, 4, 6):
        save_checkpoint(d, s, {"step": s, "w": torch.full((2,), float(s))}, keep=2)
    assert sorted(p.name for p in d.iterdir()) == ["latest", "step_000004", "step_000006"]
    step, state = load_latest(d)
    assert step == 6 and state["w"].tolist() == [6.0, 6.0]
    (d / "step_000006" / "state.pt").unlink()
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        latest_step(d)


def test_progress_bar_eta_and_format():
    buf = io.StringIO()
    bar = ProgressBar(10, start=2, stream=buf)
    bar.t0 -= 4.0  # pretend 4 s passed for 2 steps -> 2 s/step, 6 steps left
    bar.update(4, reward=0.25)
    line = buf.getvalue().strip()
    assert line.startswith("[") and "4/10" in line and "reward=0.25" in line
    assert bar.eta(4) == pytest.approx(12.0, abs=0.5)
    assert format_seconds(75) == "1m15s" and format_seconds(3.2) == " 3.2s" and format_seconds(7300) == "2h01m"


def test_plots_overlay_runs(tmp_path):
    for name, recipe in (("a", "jetrl-unified"), ("b", "naive-fp8-rollout")):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"run": {"recipe": recipe}}))
        with MetricsWriter(d / "metrics.jsonl") as w:
            for s in range(1, 4):
                w.write(_row(s))
    out = plot_runs([tmp_path / "a", tmp_path / "b"], tmp_path / "plots")
    assert sorted(p.name for p in out) == ["is_ratio.png", "mismatch.png", "reward.png", "step_time.png"]
    for p in out:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
