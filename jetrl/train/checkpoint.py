"""Atomic, verified, pickle-free training checkpoints: ``runs/<name>/checkpoints/step_XXXXXX/``.

One checkpoint directory holds

- ``tensors.safetensors``: every tensor of the state (safetensors: a JSON header and raw bytes, no code);
- ``state.json``: the rest of the state as JSON, tensors replaced by ``{"__tensor__": key}``, tuples by
  ``{"__tuple__": [...]}`` and mappings with non-string keys (torch optimizer state) by
  ``{"__items__": [[key, value], ...]}``; only None, bool, int, float, str, lists, tuples, mappings and
  tensors are accepted (anything else is refused when saving, so nothing needs a pickle to load);
- ``checksums.json``: the sha256 of the two files above, written last.

Loading never unpickles: a directory left by an older jetrl (``state.pt``, a torch pickle) or by someone
else is refused, not executed. `load_latest` verifies each checkpoint's checksums, newest first, and takes
the newest one that verifies, naming the ones it skipped and why (a truncated or edited file).

A checkpoint is written into a temporary directory beside its final place, fsynced, and renamed into
place (``os.replace`` of a directory is atomic on POSIX); only then is the ``latest`` file replaced
(again write-then-rename). Leftover temporary directories from a killed writer are removed on the next
save.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "save_checkpoint",
    "load_latest",
    "load_checkpoint",
    "latest_step",
    "list_checkpoints",
    "verify_checkpoint",
    "CheckpointError",
    "Loaded",
    "TENSORS_FILE",
    "STATE_FILE",
    "CHECKSUMS_FILE",
]

_PREFIX = "step_"
TENSORS_FILE = "tensors.safetensors"
STATE_FILE = "state.json"
CHECKSUMS_FILE = "checksums.json"
_LEGACY_PICKLE = "state.pt"


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, unreadable, fails its checksum, or belongs to a different configuration."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ------------------------------------------------------------------------------------ encoding


def _encode(obj: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    if isinstance(obj, torch.Tensor):
        key = f"t{len(tensors)}"
        # own, contiguous CPU storage: safetensors refuses shared or strided tensors
        tensors[key] = obj.detach().to("cpu").contiguous().clone()
        return {"__tensor__": key}
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: _encode(v, tensors, f"{where}.{k}") for k, v in obj.items()}
        items = []
        for k, v in obj.items():
            if not (k is None or isinstance(k, bool | int | float | str)):
                raise CheckpointError(f"checkpoint {where}: key {k!r} of type {type(k).__name__} is not storable")
            items.append([k, _encode(v, tensors, f"{where}[{k!r}]")])
        return {"__items__": items}
    raise CheckpointError(
        f"checkpoint {where}: {type(obj).__name__} is not storable without a pickle "
        "(allowed: None, bool, int, float, str, list, tuple, dict, torch.Tensor)"
    )


def _decode(obj: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors, where) for v in obj]
    if isinstance(obj, dict):
        if set(obj) == {"__tensor__"}:
            key = obj["__tensor__"]
            if key not in tensors:
                raise CheckpointError(f"{where}: refers to tensor {key!r}, which {TENSORS_FILE} does not hold")
            return tensors[key]
        if set(obj) == {"__tuple__"}:
            return tuple(_decode(v, tensors, where) for v in obj["__tuple__"])
        if set(obj) == {"__items__"}:
            return {k: _decode(v, tensors, where) for k, v in obj["__items__"]}
        return {k: _decode(v, tensors, where) for k, v in obj.items()}
    return obj


# ------------------------------------------------------------------------------------ save


def save_checkpoint(ckpt_dir: str | Path, step: int, state: dict[str, Any], *, keep: int = 2) -> Path:
    """Write `state` (nested dicts/lists/tuples of scalars, strings and tensors) as the checkpoint of
    `step`; keep the newest `keep`."""
    from safetensors.torch import save_file

    root = Path(ckpt_dir)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tensors: dict[str, torch.Tensor] = {}
    encoded = _encode(state, tensors, "state")  # refuses unstorable objects before anything is written
    final = root / f"{_PREFIX}{step:06d}"
    tmp = root / f".tmp-{_PREFIX}{step:06d}-{os.getpid()}"
    tmp.mkdir()
    save_file(tensors, str(tmp / TENSORS_FILE), metadata={"format": "pt", "jetrl_step": str(step)})
    (tmp / STATE_FILE).write_text(json.dumps({"step": step, "state": encoded}))
    sums = {name: _sha256(tmp / name) for name in (TENSORS_FILE, STATE_FILE)}
    (tmp / CHECKSUMS_FILE).write_text(json.dumps({"sha256": sums}, indent=2))
    for name in (TENSORS_FILE, STATE_FILE, CHECKSUMS_FILE):
        with open(tmp / name, "rb") as f:
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
    done = list_checkpoints(root)
    for _, old in done[:-keep] if keep > 0 else []:
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    return final


# ------------------------------------------------------------------------------------ load


def list_checkpoints(ckpt_dir: str | Path) -> list[tuple[int, Path]]:
    """``(step, directory)`` of every ``step_*`` directory, oldest first (verified or not)."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return []
    out = []
    for p in root.glob(f"{_PREFIX}*"):
        tail = p.name[len(_PREFIX) :]
        if p.is_dir() and tail.isdigit():
            out.append((int(tail), p))
    return sorted(out)


def verify_checkpoint(path: str | Path) -> None:
    """Raise `CheckpointError` naming the file unless `path` is a complete jetrl checkpoint whose files
    match the checksums written with them."""
    p = Path(path)
    sums_p = p / CHECKSUMS_FILE
    if not sums_p.is_file():
        if (p / _LEGACY_PICKLE).exists():
            raise CheckpointError(
                f"{p / _LEGACY_PICKLE}: a pickled checkpoint (older jetrl); refused, loading it would execute "
                "whatever code it holds"
            )
        raise CheckpointError(f"{sums_p}: missing (an incomplete checkpoint)")
    try:
        sums = json.loads(sums_p.read_text())["sha256"]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{sums_p}: unreadable ({e})") from None
    for name in (TENSORS_FILE, STATE_FILE):
        f = p / name
        if not f.is_file():
            raise CheckpointError(f"{f}: missing")
        if _sha256(f) != sums.get(name):
            raise CheckpointError(f"{f}: checksum mismatch (truncated or changed after it was written)")


@dataclass
class Loaded:
    """What `load_latest` found: the step and state of the checkpoint it took, and the ones it skipped."""

    step: int
    state: dict[str, Any]
    path: Path
    skipped: list[tuple[Path, str]] = field(default_factory=list)


def load_checkpoint(path: str | Path) -> tuple[int, dict[str, Any]]:
    """``(step, state)`` of one checkpoint directory, verified first; never unpickles."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    p = Path(path)
    verify_checkpoint(p)
    try:
        tensors = load_file(str(p / TENSORS_FILE), device="cpu")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{p / TENSORS_FILE}: not a readable safetensors file ({e})") from None
    try:
        doc = json.loads((p / STATE_FILE).read_text())
        step = int(doc["step"])
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{p / STATE_FILE}: unreadable ({e})") from None
    return step, _decode(doc["state"], tensors, str(p / STATE_FILE))


def latest_step(ckpt_dir: str | Path) -> int | None:
    """Step of the newest checkpoint that verifies, or None when there is none."""
    for step, p in reversed(list_checkpoints(ckpt_dir)):
        try:
            verify_checkpoint(p)
        except CheckpointError:
            continue
        return step
    return None


def load_latest(ckpt_dir: str | Path) -> Loaded:
    """The newest checkpoint that verifies; raises `CheckpointError` if none does (naming what was tried)."""
    found = list_checkpoints(ckpt_dir)
    if not found:
        raise CheckpointError(f"no checkpoint under {ckpt_dir}")
    skipped: list[tuple[Path, str]] = []
    for _, p in reversed(found):
        try:
            step, state = load_checkpoint(p)
        except CheckpointError as e:
            skipped.append((p, str(e)))
            continue
        return Loaded(step, state, p, skipped)
    raise CheckpointError(f"no checkpoint under {ckpt_dir} verifies: " + "; ".join(reason for _, reason in skipped))
