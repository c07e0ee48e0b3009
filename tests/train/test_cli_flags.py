"""Freeze the command-line surface: a new or renamed flag must be a deliberate change of this list."""

from __future__ import annotations

import argparse

import pytest

from jetrl.train.cli import build_parser


@pytest.fixture(autouse=True)
def _restore_cli_side_effects():
    """The CLIs set log-level variables and route the 'jetrl' logger to stdout (`quiet_engine_logs`): keep
    both out of the other tests of this process."""
    import logging
    import os
    import warnings

    keys = ("VLLM_LOGGING_LEVEL", "TRANSFORMERS_VERBOSITY", "HF_HUB_DISABLE_PROGRESS_BARS")
    env = {k: os.environ.get(k) for k in keys}
    log = logging.getLogger("jetrl")
    saved = (list(log.handlers), log.propagate, log.level)
    vllm_level = logging.getLogger("vllm").level
    filters = list(warnings.filters)
    yield
    warnings.filters[:] = filters
    logging.getLogger("vllm").setLevel(vllm_level)
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    log.handlers[:], log.propagate = saved[0], saved[1]
    log.setLevel(saved[2])


def _flags(parser: argparse.ArgumentParser) -> list[str]:
    return sorted(s for a in parser._actions for s in a.option_strings)


def test_train_flags_frozen():
    assert _flags(build_parser()) == ["--dry-run", "--help", "--overwrite", "--resume", "--verbose", "-h"]


def test_export_flags_frozen():
    from jetrl.train.export import build_parser as export_parser

    assert _flags(export_parser()) == ["--fp8", "--help", "--out", "--overwrite", "--step", "-h"]


def test_demo_flags_frozen(monkeypatch, capsys):
    import jetrl.demo as demo

    seen = {}

    def fake_run_demo(**kw):
        seen.update(kw)
        return None

    monkeypatch.setattr(demo, "run_demo", fake_run_demo)
    assert (
        demo.main(
            [
                "--name",
                "x",
                "--out-dir",
                "o",
                "--steps",
                "3",
                "--seed",
                "5",
                "--no-compare",
                "--set",
                "algo.name=dapo",
                "--dry-run",
                "--overwrite",
            ]
        )
        == 0
    )
    assert seen == {
        "name": "x",
        "out_dir": "o",
        "compare": False,
        "dry_run": True,
        "overwrite": True,
        "overrides": ["algo.name=dapo", "run.steps=3", "run.seed=5"],
        "active": [],
        "verbose": False,
    }


def test_readme_train_commands_use_real_flags_and_say_where_jetrl_is():
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert "`.venv/bin/jetrl ...`, or `source .venv/bin/activate`" in readme
    known = set(_flags(build_parser()))
    lines = [ln for ln in readme.splitlines() if ln.lstrip().startswith("jetrl train ")]
    assert lines
    for ln in lines:
        assert set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", ln.split("#")[0])) <= known, ln


def test_engine_logs_quiet_unless_verbose_and_an_explicit_level_wins(monkeypatch):
    import os

    from jetrl.train.cli import quiet_engine_logs

    for verbose, want in ((False, "ERROR"), (True, "INFO")):
        monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
        quiet_engine_logs(verbose)
        assert os.environ["VLLM_LOGGING_LEVEL"] == want
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")
    quiet_engine_logs(False)
    assert os.environ["VLLM_LOGGING_LEVEL"] == "DEBUG"
