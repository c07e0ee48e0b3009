"""PNG plots of one or more runs' metric streams (matplotlib, Agg backend; no display needed).

`plot_runs([run_dir, ...], out_dir)` writes ``reward.png``, ``mismatch.png``, ``is_ratio.png`` and the
step-time split. Several runs (e.g. the same seed under different recipes) are overlaid; every legend
entry names its run (``<run name> (<recipe>)``) and what the line is, and legends sit below the axes
(one column per run) so they cover no data. The greedy evaluations (held-out set, at step 0 and at the end, or every
``run.eval_every`` steps) are drawn as separate points, not joined: two evaluations are not a trend.

Step times are compared only between runs timed under the same conditions: the same host, CPU count,
device and torch threads (``host.json``) and a similar machine load (the 1-minute load average the
trainer logs each step as ``host/load_1m``; similar: within 0.5 or 25%). Then one ``step_time.png``
holds all runs and its title says they were timed under the same load; otherwise each run gets its own
``step_time-<run name>.png`` whose title says why it is not compared with the others.
"""

from __future__ import annotations

import json
from pathlib import Path

from .metrics import read_metrics

__all__ = ["plot_runs", "make_figures", "comparable_timing"]

LOAD_ABS_TOL = 0.5
LOAD_REL_TOL = 0.25


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


def _mean(vals: list[float]) -> float | None:
    return sum(vals) / len(vals) if vals else None


def comparable_timing(runs: list[tuple[Path, list[dict]]]) -> tuple[bool, str]:
    """Whether the runs' step times may be compared, and the sentence that says why (or why not)."""
    hosts, loads = [], []
    for d, rows in runs:
        h = d / "host.json"
        hosts.append(json.loads(h.read_text()) if h.exists() else None)
        loads.append(_mean(_series(rows, "host/load_1m")[1]))
    if any(h is None for h in hosts) or any(v is None for v in loads):
        missing = [d.name for (d, _), h, v in zip(runs, hosts, loads, strict=True) if h is None or v is None]
        return False, f"no record of the host or load {', '.join(missing)} ran under"
    if any(h != hosts[0] for h in hosts[1:]):
        return False, "timed on different hosts, devices or thread counts"
    lo, hi = min(loads), max(loads)
    shown = " / ".join(f"{v:.1f}" for v in loads)
    if hi - lo > max(LOAD_ABS_TOL, LOAD_REL_TOL * hi):
        return False, f"timed under different loads (1-min load average {shown})"
    return True, f"timed on one host under the same load (1-min load average {shown})"


def _legend(ax, ncol: int) -> None:
    """Below the axes (never over the data), one column per run."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=max(1, ncol), frameon=False)


def make_figures(run_dirs: list[str | Path]) -> dict[str, object]:
    """File name -> matplotlib Figure of every plot (the caller saves and closes them)."""
    import matplotlib

    matplotlib.use("Agg")  # inside the entry function: no backend change at import time
    import matplotlib.pyplot as plt

    runs = [(Path(d), read_metrics(Path(d) / "metrics.jsonl")) for d in run_dirs]
    runs = [(d, rows) for d, rows in runs if rows]
    figs: dict[str, object] = {}

    fig, ax = plt.subplots(figsize=(8, 5))
    for d, rows in runs:
        name = _label(d)
        (line,) = ax.plot(*_series(rows, "reward/mean"), label=f"{name}: reward/mean")
        ax.plot(*_series(rows, "reward/pass@k"), ls="--", color=line.get_color(), alpha=0.6, label=f"{name}: pass@k")
        xs, ys = _series(rows, "eval/accuracy")
        summ = d / "summary.json"
        start = json.loads(summ.read_text()).get("eval_accuracy_start") if summ.exists() else None
        if start is not None:  # the greedy accuracy before RL, at step 0
            xs, ys = [0, *xs], [float(start), *ys]
        if xs:  # separate evaluations: points, no line between them
            ax.plot(
                xs, ys, ls="none", marker="o", color=line.get_color(), label=f"{name}: greedy eval accuracy (held-out)"
            )
    ax.set(xlabel="RL step", ylabel="reward / accuracy", title="Reward")
    _legend(ax, len(runs))
    figs["reward.png"] = fig

    fig, ax = plt.subplots(figsize=(8, 5))
    for d, rows in runs:
        name = _label(d)
        (line,) = ax.plot(*_series(rows, "mismatch/logp_abs_diff_mean"), label=f"{name}: mean")
        xs, ys = _series(rows, "mismatch/logp_abs_diff_max")
        ax.plot(xs, ys, ls="--", color=line.get_color(), alpha=0.6, label=f"{name}: max")
    ax.set(xlabel="RL step", ylabel="|logp_rollout - logp_trainer|", title="Trainer / rollout mismatch")
    ax.set_yscale("symlog", linthresh=1e-6)  # exact zeros (bit-equal log-probs) stay on the plot
    _legend(ax, len(runs))
    figs["mismatch.png"] = fig

    fig, ax = plt.subplots(figsize=(8, 5))
    for d, rows in runs:
        name = _label(d)
        (line,) = ax.plot(*_series(rows, "mismatch/is_ratio_mean"), label=f"{name}: mean")
        for k, what in (("mismatch/is_ratio_min", "min"), ("mismatch/is_ratio_max", "max")):
            ax.plot(*_series(rows, k), ls=":", color=line.get_color(), alpha=0.5, label=f"{name}: {what}")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set(xlabel="RL step", ylabel="exp(logp_trainer - logp_rollout)", title="IS ratio")
    _legend(ax, len(runs))
    figs["is_ratio.png"] = fig

    parts = ("time/rollout_s", "time/train_s", "time/sync_s")

    def step_time(group: list[tuple[Path, list[dict]]], title: str):
        fig, ax = plt.subplots(figsize=(8, 5))
        width = 0.8 / max(1, len(group))
        for i, (_d, rows) in enumerate(group):
            bottom = 0.0
            for j, key in enumerate(parts):
                mean = _mean(_series(rows, key)[1]) or 0.0
                ax.bar(i * width, mean, width * 0.9, bottom=bottom, color=f"C{j}", label=key if i == 0 else None)
                bottom += mean
        ax.set_xticks([i * width for i in range(len(group))], [_label(d) for d, _ in group], fontsize=7)
        ax.set(ylabel="seconds per step (mean)")
        ax.set_title(title, fontsize=9)
        _legend(ax, len(parts))
        return fig

    if len(runs) <= 1:
        figs["step_time.png"] = step_time(runs, "Step time split")
    else:
        ok, why = comparable_timing(runs)
        if ok:
            figs["step_time.png"] = step_time(runs, f"Step time split: {why}")
        else:
            for d, rows in runs:
                others = ", ".join(o.name for o, _ in runs if o != d)
                figs[f"step_time-{d.name}.png"] = step_time(
                    [(d, rows)], f"Step time split of {d.name}; not compared with {others}: {why}"
                )
    return figs


def plot_runs(run_dirs: list[str | Path], out_dir: str | Path) -> list[Path]:
    """Plot the runs' ``metrics.jsonl``; return the PNG paths written."""
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for old in out.glob("step_time*.png"):  # a comparison of other runs' conditions must not linger
        old.unlink()
    for name, fig in make_figures(run_dirs).items():
        fig.tight_layout()
        p = out / name
        fig.savefig(p, dpi=100, bbox_inches="tight")  # the legend outside the axes stays in the image
        plt.close(fig)
        written.append(p)
    return written
