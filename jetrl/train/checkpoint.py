"""Atomic training checkpoints: ``runs/<name>/checkpoints/step_XXXXXX/state.pt`` plus a ``latest`` pointer.

A checkpoint is written into a temporary directory beside its final place, fsynced, and renamed into
place (``os.replace`` of a directory is atomic on POSIX); only then is the ``latest`` file replaced
(again write-then-rename). A process killed at any instant therefore leaves either the previous
checkpoint as ``latest`` or the new one, never a half-written file that `load_latest` would read.
Leftover temporary directories from a killed writer are removed on the next save.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

__all__ = ["save_checkpoint", "load_latest", "latest_step", "CheckpointError"]

_PREFIX = "step_"


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, unreadable or belongs to a different configuration."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(ckpt_dir: str | Path, step: int, state: dict[str, Any], *, keep: int = 2) -> Path:
    """Write `state` (anything `torch.save` takes) as the checkpoint of `step`; keep the newest `keep`."""
    root = Path(ckpt_dir)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    final = root / f"{_PREFIX}{step:06d}"
    tmp = root / f".tmp-{_PREFIX}{step:06d}-{os.getpid()}"
    tmp.mkdir()
    with open(tmp / "state.pt", "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    latest_tmp = root / f".latest-{os.getpid()}"
    latest_tmp.write_text(final.name + "\n")
    with open(latest_tmp) as f:
        os.fsync(f.fileno())
    os.replace(latest_tmp, root / "latest")
    _fsync_dir(root)
    done = sorted(p for p in root.glob(f"{_PREFIX}*") if p.is_dir())
    for old in done[:-keep] if keep > 0 else []:
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    return final


def latest_step(ckpt_dir: str | Path) -> int | None:
    """Step of the checkpoint ``latest`` points to, or None when there is none."""
    p = Path(ckpt_dir) / "latest"
    if not p.exists():
        return None
    name = p.read_text().strip()
    if not name.startswith(_PREFIX) or not (Path(ckpt_dir) / name / "state.pt").exists():
        raise CheckpointError(f"{p}: points to {name!r}, which is not a complete checkpoint")
    return int(name[len(_PREFIX) :])


def load_latest(ckpt_dir: str | Path) -> tuple[int, dict[str, Any]]:
    """``(step, state)`` of the newest complete checkpoint; raises `CheckpointError` if there is none."""
    step = latest_step(ckpt_dir)
    if step is None:
        raise CheckpointError(f"no checkpoint under {ckpt_dir} (nothing to resume)")
    path = Path(ckpt_dir) / f"{_PREFIX}{step:06d}" / "state.pt"
    return step, torch.load(path, map_location="cpu", weights_only=False)
