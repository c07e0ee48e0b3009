"""Metric stream, atomic checkpoints, progress bar and plots (no model involved)."""

from __future__ import annotations

import io
import json

import pytest
import torch

from jetrl.train.checkpoint import CheckpointError, latest_step, load_latest, save_checkpoint
from jetrl.train.metrics import REQUIRED_KEYS, MetricsWriter, read_metrics
from jetrl.train.plots import make_figures, plot_runs
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
    with pytest.raises(CheckpointError, match="no checkpoint under"):
        load_latest(d)
    (d / ".tmp-step_000009-1").mkdir(parents=True)  # debris of a killed writer
    for s in (2, 4, 6):
        save_checkpoint(d, s, {"step": s, "w": torch.full((2,), float(s))}, keep=2)
    assert sorted(p.name for p in d.iterdir()) == ["latest", "step_000004", "step_000006"]
    got = load_latest(d)
    assert got.step == 6 and got.state["w"].tolist() == [6.0, 6.0] and got.skipped == []
    (d / "step_000006" / "tensors.safetensors").unlink()  # an incomplete newest checkpoint: the older one serves
    assert latest_step(d) == 4
    got = load_latest(d)
    assert got.step == 4 and [p.name for p, _ in got.skipped] == ["step_000006"]
    assert "tensors.safetensors: missing" in got.skipped[0][1]
    (d / "step_000004" / "checksums.json").unlink()
    assert latest_step(d) is None
    with pytest.raises(CheckpointError, match="no checkpoint under .* verifies"):
        load_latest(d)


def test_progress_bar_eta_and_format():
    buf = io.StringIO()
    bar = ProgressBar(10, start=2, stream=buf)
    bar.t0 -= 4.0  # pretend 4 s passed for 2 steps -> 2 s/step, 6 steps left
    bar.update(4, reward=0.25)
    line = buf.getvalue().strip()
    assert line.startswith("[") and "4/10" in line and "reward=0.25" in line
    assert bar.eta(4) == pytest.approx(12.0, abs=0.5)
    assert format_seconds(75) == "1m15s" and format_seconds(3.2) == " 3.2s" and format_seconds(7300) == "2h01m"


def _run(tmp_path, name: str, recipe: str, *, load: float | None, host: str | None = "h", evals: bool = True):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"run": {"recipe": recipe}}))
    if host is not None:
        (d / "host.json").write_text(json.dumps({"host": host, "cpu_count": 2, "device": "cpu"}))
    (d / "summary.json").write_text(json.dumps({"eval_accuracy_start": 0.4 if evals else None}))
    with MetricsWriter(d / "metrics.jsonl") as w:
        for s in range(1, 4):
            r = _row(s)
            if load is not None:
                r["host/load_1m"] = load
            if evals and s == 3:
                r["eval/accuracy"] = 0.8
            w.write(r)
    return d


def test_plots_overlay_runs_and_compare_step_times_only_under_the_same_load(tmp_path):
    a = _run(tmp_path, "a", "jetrl-unified", load=2.0)
    b = _run(tmp_path, "b", "naive-fp8-rollout", load=2.2)
    out = plot_runs([a, b], tmp_path / "plots")
    assert sorted(p.name for p in out) == ["is_ratio.png", "mismatch.png", "reward.png", "step_time.png"]
    for p in out:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    figs = make_figures([a, b])
    assert "same load (1-min load average 2.0 / 2.2)" in figs["step_time.png"].axes[0].get_title()
    # a different load (or no record of it) is not compared: one plot per run that says why
    c = _run(tmp_path, "c", "bf16", load=6.0)
    out = plot_runs([a, c], tmp_path / "plots")  # the same folder: the earlier comparison does not linger
    assert sorted(p.name for p in (tmp_path / "plots").iterdir() if p.name.startswith("step_time")) == [
        "step_time-a.png",
        "step_time-c.png",
    ]
    title = make_figures([a, c])["step_time-a.png"].axes[0].get_title()
    assert "not compared with c: timed under different loads (1-min load average 2.0 / 6.0)" in title
    d = _run(tmp_path, "d", "bf16", load=None, host=None)
    assert "no record of the host or load d ran under" in make_figures([a, d])["step_time-d.png"].axes[0].get_title()


def test_eval_points_are_not_joined_and_legends_name_the_run_outside_the_data(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    a = _run(tmp_path, "a", "jetrl-unified", load=1.0)
    b = _run(tmp_path, "b", "naive-fp8-rollout", load=1.0)
    figs = make_figures([a, b])
    ax = figs["reward.png"].axes[0]
    evals = [ln for ln in ax.get_lines() if "greedy eval" in ln.get_label()]
    assert len(evals) == 2
    for ln in evals:  # two evaluations (step 0 and the end): markers, no line suggesting a trend between them
        assert ln.get_linestyle() == "None" and ln.get_marker() == "o"
        assert list(ln.get_xdata()) == [0, 3]
    for name, fig in figs.items():
        ax = fig.axes[0]
        legend = ax.get_legend()
        labels = [t.get_text() for t in legend.get_texts()]
        if name.startswith("step_time"):
            assert labels == ["time/rollout_s", "time/train_s", "time/sync_s"]  # runs are the x tick labels
        else:
            assert labels and all(t.startswith(("a (jetrl-unified): ", "b (naive-fp8-rollout): ")) for t in labels)
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        box, axes_box = legend.get_window_extent(renderer), ax.get_window_extent(renderer)
        assert box.y1 <= axes_box.y0 or box.x0 >= axes_box.x1, f"{name}: the legend overlaps the axes"
