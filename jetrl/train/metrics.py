"""The metric stream: one JSON object per RL step in ``runs/<name>/metrics.jsonl``.

Each line is written whole and flushed to disk before the step counts as done, so a killed run leaves
a file of complete lines (a torn last line is dropped on resume). `MetricsWriter.open(resume_step=k)`
keeps the lines of steps ``<= k`` (what the checkpoint at step ``k`` had seen) and appends from there:
a resumed run continues the same stream with no gap and no duplicate step.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

__all__ = ["REQUIRED_KEYS", "MetricsWriter", "read_metrics"]

REQUIRED_KEYS = (
    "step",
    "reward/mean",
    "reward/pass@k",
    "mismatch/logp_abs_diff_mean",
    "mismatch/logp_abs_diff_max",
    "mismatch/is_ratio_mean",
    "actor/clip_frac",
    "actor/entropy",
    "response/length_mean",
    "time/rollout_s",
    "time/train_s",
    "time/sync_s",
    "sync/bytes",
)
"""Keys every step's line carries (issue 7)."""


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no NaN/Inf; a missing value is null
    return v


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All complete lines of a metrics file (a torn trailing line is ignored)."""
    p = Path(path)
    if not p.exists():
        return []
    rows = []
    for line in p.read_text().splitlines():
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line cut by a kill: everything before it is intact
    return rows


class MetricsWriter:
    """Append-only JSONL writer with durable lines."""

    def __init__(self, path: str | Path, *, resume_step: int | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            if self.path.exists():
                self.path.unlink()
            rows: list[dict[str, Any]] = []
        else:
            rows = [r for r in read_metrics(self.path) if int(r.get("step", 0)) <= resume_step]
        tmp = self.path.with_suffix(".jsonl.tmp")
        with open(tmp, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        self.last_step = int(rows[-1]["step"]) if rows else 0
        self._f = open(self.path, "a")

    def write(self, row: dict[str, Any]) -> None:
        missing = [k for k in REQUIRED_KEYS if k not in row]
        if missing:
            raise ValueError(f"metrics row for step {row.get('step')} lacks required keys {missing}")
        step = int(row["step"])
        if step != self.last_step + 1:
            raise ValueError(f"metrics stream: step {step} does not follow step {self.last_step}")
        self._f.write(json.dumps({k: _clean(v) for k, v in row.items()}) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())
        self.last_step = step

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
