"""What a verl recipe script (``recipes/<model>_<dataset>.sh``) would pass to ``python -m jetrl.verl``.

`recipe_argv` runs the script with ``PYTHON`` pointed at a stand-in interpreter that records its
argument vector instead of starting verl, so tests can check a recipe's hydra overrides (against
verl's schema, batch arithmetic, forwarding of ``"$@"``) without verl, Ray or a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from jetrl.testing.subprocess_guard import HANG_GUARD_S

__all__ = ["RECIPES_DIR", "compose_verl", "verl_recipes", "recipe_argv", "overrides_dict"]

RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"
"""The repository's recipes/ folder (this helper is for the source tree, not an installed wheel)."""


def verl_recipes() -> list[Path]:
    """Every ``recipes/<model>_<dataset>.sh`` that sources ``lib/verl_common.sh``."""
    return sorted(p for p in RECIPES_DIR.glob("*_*.sh") if "lib/verl_common.sh" in p.read_text())


def recipe_argv(script: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, list[str] | None, str]:
    """(exit code, the argv after the interpreter -- ``["-m", "jetrl.verl", ...]`` -- or None when the
    script stopped before calling it, stderr) of ``bash script *args`` under `env` (added to os.environ)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "argv.json"
        fake = Path(tmp) / "python"
        record = "import json, sys; json.dump(sys.argv[1:], open(sys.argv[1], 'w'))"
        fake.write_text(f'#!/bin/sh\nexec "{sys.executable}" -c "{record}" "{out}" "$@"\n')
        fake.chmod(0o755)
        full_env = {**os.environ, **(env or {}), "PYTHON": str(fake)}
        res = subprocess.run(
            ["bash", str(script), *args], env=full_env, capture_output=True, text=True, timeout=HANG_GUARD_S
        )
        argv = json.loads(out.read_text())[1:] if out.exists() else None
    return res.returncode, argv, res.stderr


def overrides_dict(argv: list[str]) -> dict[str, str]:
    """``key=value`` overrides of a recorded argv (after ``-m jetrl.verl``) as a dict; a key given twice
    keeps its last value, as hydra does. ``+key`` (an addition to the schema) keeps its ``+``."""
    if argv[:2] != ["-m", "jetrl.verl"]:
        raise ValueError(f"recipe did not call `python -m jetrl.verl`: {argv[:2]}")
    out = {}
    for arg in argv[2:]:
        key, sep, value = arg.partition("=")
        if not sep:
            raise ValueError(f"override {arg!r} is not key=value")
        out[key] = value
    return out


def compose_verl(overrides: list[str]):
    """verl 0.9.1's own ``ppo_trainer`` config with `overrides` (hydra, struct mode: a key that does not exist is
    refused with a ConfigCompositionException naming it). Needs verl installed."""
    import verl
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(Path(verl.__file__).parent / "trainer" / "config"), version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)
