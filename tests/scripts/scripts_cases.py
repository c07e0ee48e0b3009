"""Shared by the script tests: load a ``scripts/*.py`` benchmark as a module (they are not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def load_script(name: str):
    """Import ``scripts/<name>.py`` under a private module name and return the module (``scripts/`` goes on
    ``sys.path``, as when the script runs, for the modules it shares with the others, e.g. ``benchmeta``)."""
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
