"""What every ``scripts/results/*.json`` records about where and from what it was made (imported by the
``scripts/bench_*.py`` run as scripts: this folder is then first on ``sys.path``)."""

from __future__ import annotations

import datetime
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

__all__ = ["versions", "device_name", "device_tag", "commit", "command", "meta"]


def versions(extra: tuple[str, ...] = ()) -> dict:
    """Python, torch + CUDA and the versions of vLLM, Triton, transformers and `extra` modules (an import
    error is recorded as such, not hidden)."""
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    for mod in ("vllm", "triton", "transformers", *extra):
        try:
            out[mod] = __import__(mod).__version__
        except Exception as e:  # recorded, not hidden
            out[mod] = f"unavailable: {type(e).__name__}"
    return out


def device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"CPU {platform.processor() or platform.machine()} x{os.cpu_count()}"


def device_tag(device: str) -> str:
    """A result file's device part: ``cpu`` for a `device_name` of a CPU, else the GPU's name in lower case with
    every run of other characters made one ``-`` (``NVIDIA H200`` -> ``nvidia-h200``)."""
    if device.startswith("CPU "):
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")


def commit(given: str | None = None) -> str:
    """`given`, else ``git rev-parse HEAD`` of this checkout (the device machine has no git: pass it)."""
    if given:
        return given
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, cwd=Path(__file__).parent
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git checkout; pass --commit)"


def command() -> str:
    """This process's command line as recorded (interpreter name and arguments)."""
    return " ".join([Path(sys.executable).name, *sys.argv])


def meta(given_commit: str | None = None, extra_versions: tuple[str, ...] = ()) -> dict:
    """``{"device", "versions", "date", "commit", "command"}`` of this run."""
    return {
        "device": device_name(),
        "versions": versions(extra_versions),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": commit(given_commit),
        "command": command(),
    }
