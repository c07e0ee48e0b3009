"""PNG plots of one or more runs' metric streams (matplotlib, Agg backend; no display needed).

`plot_runs([run_dir, ...], out_dir)` writes ``reward.png``, ``mismatch.png``, ``is_ratio.png`` and
``step_time.png``; several runs (e.g. the same seed under different recipes) are overlaid, labelled
``<run name> (<recipe>)``.
"""

from __future__ import annotations

import json
from pathlib import Path

from .metrics import read_metrics

__all__ = ["plot_runs"]


def _label(run_dir: Path) -> str:
    cfg = run_dir / "config.json"
    recipe = None
    if cfg.exists():
        recipe = json.loads(cfg.read_text()).get("run", {}).get("recipe")
    return f"{run_dir.name} ({recipe})" if recipe else run_dir.name


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if v is not None:
            xs.append(int(r["step"]))
            ys.append(float(v))
    return xs, ys


def plot_runs(run_dirs: list[str | Path], out_dir: str | Path) -> list[Path]:
    """Plot the runs' ``metrics.jsonl``; return the PNG paths written."""
    import matplotlib

    matplotlib.use("Agg")  # inside the entry function: no backend change at import time
    import matplotlib.pyplot as plt

    runs = [(Path(d), read_metrics(Path(d) / "metrics.jsonl")) for d in run_dirs]
    runs = [(d, rows) for d, rows in runs if rows]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []

    def save(fig, name: str) -> None:
        fig.tight_layout()
        p = out / name
        fig.savefig(p, dpi=100)
        plt.close(fig)
        written.append(p)

    fig, ax = plt.subplots(figsize=(7, 4))
    for d, rows in runs:
        (line,) = ax.plot(*_series(rows, "reward/mean"), label=f"{_label(d)} reward/mean")
        ax.plot(*_series(rows, "reward/pass@k"), ls="--", color=line.get_color(), alpha=0.6, label="pass@k")
        xs, ys = _series(rows, "eval/accuracy")
        summ = d / "summary.json"
        start = json.loads(summ.read_text()).get("eval_accuracy_start") if summ.exists() else None
        if start is not None:  # the greedy accuracy before RL, at step 0
            xs, ys = [0, *xs], [float(start), *ys]
        if xs:
            ax.plot(xs, ys, "o:", color=line.get_color(), label="eval/accuracy (greedy)")
    ax.set(xlabel="RL step", ylabel="reward", title="Reward")
    ax.legend(fontsize=7)
    save(fig, "reward.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    for d, rows in runs:
        (line,) = ax.plot(*_series(rows, "mismatch/logp_abs_diff_mean"), label=f"{_label(d)} mean")
        ax.plot(*_series(rows, "mismatch/logp_abs_diff_max"), ls="--", color=line.get_color(), alpha=0.6, label="max")
    ax.set(xlabel="RL step", ylabel="|logp_rollout - logp_trainer|", title="Trainer / rollout mismatch")
    ax.set_yscale("symlog", linthresh=1e-6)  # exact zeros (bit-equal log-probs) stay on the plot
    ax.legend(fontsize=7)
    save(fig, "mismatch.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    for d, rows in runs:
        (line,) = ax.plot(*_series(rows, "mismatch/is_ratio_mean"), label=f"{_label(d)} mean")
        for k in ("mismatch/is_ratio_min", "mismatch/is_ratio_max"):
            ax.plot(*_series(rows, k), ls=":", color=line.get_color(), alpha=0.5)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set(xlabel="RL step", ylabel="exp(logp_trainer - logp_rollout)", title="IS ratio (dotted: min / max)")
    ax.legend(fontsize=7)
    save(fig, "is_ratio.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    parts = ("time/rollout_s", "time/train_s", "time/sync_s")
    width = 0.8 / max(1, len(runs))
    for i, (_d, rows) in enumerate(runs):
        bottom = 0.0
        for j, key in enumerate(parts):
            _, ys = _series(rows, key)
            mean = sum(ys) / len(ys) if ys else 0.0
            ax.bar(i * width, mean, width * 0.9, bottom=bottom, color=f"C{j}", label=key if i == 0 else None)
            bottom += mean
    ax.set_xticks([i * width for i in range(len(runs))], [_label(d) for d, _ in runs], fontsize=7)
    ax.set(ylabel="seconds per step (mean)", title="Step time split")
    ax.legend(fontsize=7)
    save(fig, "step_time.png")
    return written
