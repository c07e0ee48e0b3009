"""The real entry points in a subprocess (`python -m jetrl.cli ...`, `python -m jetrl.demo`): exit codes and
the first line of stderr for a user's mistakes, before anything is written. None of these starts an engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jetrl.testing.subprocess_guard import HANG_GUARD_S

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "recipes" / "tiny-arith-cpu.yaml"


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=HANG_GUARD_S
    )


def first_err(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stderr.splitlines()
    return lines[0] if lines else ""


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from jetrl.tiny import save_tiny_checkpoint

    return save_tiny_checkpoint(tmp_path_factory.mktemp("model") / "tiny", seed=0)


def _model_copy(tiny_model: Path, dest: Path) -> Path:
    dest.mkdir(parents=True)
    for f in tiny_model.iterdir():
        (dest / f.name).write_bytes(f.read_bytes())
    return dest


def test_version():
    proc = run("-m", "jetrl.cli", "--version")
    assert proc.returncode == 0, proc.stderr
    from importlib.metadata import version

    assert proc.stdout.strip() == f"jetrl {version('jetrl')}"


def test_dry_run_opens_the_model_files_and_names_a_truncated_one(tiny_model, tmp_path):
    model = _model_copy(tiny_model, tmp_path / "model")
    ok = run("-m", "jetrl.cli", "train", str(CONFIG), f"model.path={model}", "warmup.steps=0", "--dry-run")
    assert ok.returncode == 0, ok.stderr[-2000:]
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    for extra in (["--dry-run"], []):  # the dry run and a real start give the same line, before any write
        proc = run(
            "-m", "jetrl.cli", "train", str(CONFIG), f"model.path={model}", "warmup.steps=0",
            f"run.out_dir={tmp_path / 'runs'}", *extra,
        )  # fmt: skip
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert first_err(proc).startswith(f"jetrl train: bad model file: {weights}: ")
        assert "truncated" in first_err(proc) and "Traceback" not in proc.stderr
        assert not (tmp_path / "runs").exists()
    (model / "config.json").write_text("{not json")
    proc = run("-m", "jetrl.cli", "train", str(CONFIG), f"model.path={model}", "warmup.steps=0", "--dry-run")
    assert proc.returncode == 2 and first_err(proc).startswith(f"jetrl train: bad model file: {model / 'config.json'}")


def test_validation_happens_before_anything_is_written(tiny_model, tmp_path):
    """warmup.steps with model.path: refused by --dry-run, and a real start writes no run directory, so the
    corrected command then runs without --overwrite."""
    out = tmp_path / "runs"
    for extra in (["--dry-run"], []):
        proc = run(
            "-m", "jetrl.cli", "train", str(CONFIG), f"model.path={tiny_model}", f"run.out_dir={out}", *extra
        )  # fmt: skip
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert first_err(proc).startswith("jetrl train: bad config: warmup.steps: 40: the supervised warm-up is for")
        assert not out.exists()


def test_a_start_that_completed_no_step_does_not_block_the_retry(tmp_path):
    from jetrl.demo import DEFAULT_CONFIG
    from jetrl.train.config import apply_overrides, config_from_dict
    from jetrl.train.trainer import Trainer, TrainError

    cfg = config_from_dict(apply_overrides(DEFAULT_CONFIG, [f"run.out_dir={tmp_path}"]))
    Trainer(cfg, log=lambda *a: None)  # wrote config.json, then (say) the engine failed to start
    (cfg.run_dir / "lint.json").write_text("{}")
    Trainer(cfg, log=lambda *a: None)  # no --overwrite needed: nothing of a run is there
    (cfg.run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    with pytest.raises(TrainError, match="exists; pass --resume"):
        Trainer(cfg, log=lambda *a: None)


def test_resume_with_no_intact_checkpoint_names_the_file(tmp_path):
    """All checkpoints damaged: one line naming the file (the start-up stops before any engine)."""
    import yaml

    from jetrl.demo import DEFAULT_CONFIG
    from jetrl.train.checkpoint import save_checkpoint
    from jetrl.train.config import apply_overrides

    raw = apply_overrides(DEFAULT_CONFIG, [f"run.out_dir={tmp_path}", "warmup.steps=2", "run.progress=false"])
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(raw))
    run_dir = tmp_path / "tiny-arith"
    run_dir.mkdir()
    from jetrl.train.config import config_from_dict

    (run_dir / "config.json").write_text(json.dumps(config_from_dict(raw).to_dict()))
    import torch

    save_checkpoint(run_dir / "checkpoints", 4, {"w": torch.zeros(100)})
    bad = run_dir / "checkpoints" / "step_000004" / "tensors.safetensors"
    bad.write_bytes(bad.read_bytes()[:50])
    proc = run("-m", "jetrl.cli", "train", str(cfg_path), "--resume")
    assert proc.returncode == 1, proc.stderr[-2000:]
    err = [ln for ln in proc.stderr.splitlines() if ln.startswith("jetrl train:")]
    assert len(err) == 1 and f"{bad}: checksum mismatch" in err[0] and "Traceback" not in proc.stderr


def test_loggers_need_their_package(tmp_path):
    import importlib.util

    for name in ("tensorboard", "wandb"):
        if importlib.util.find_spec(name) is not None:
            continue  # installed here: the missing-package path is covered by test_loggers.py
        proc = run("-m", "jetrl.cli", "train", str(CONFIG), f"run.loggers=[{name}]", "--dry-run")
        assert proc.returncode == 2
        assert first_err(proc).startswith(f"jetrl train: bad config: run.loggers: '{name}' needs the {name} package")
    proc = run("-m", "jetrl.cli", "train", str(CONFIG), "run.loggers=[mlflow]", "--dry-run")
    assert proc.returncode == 2 and "unknown logger 'mlflow'" in first_err(proc)


def test_demo_never_replaces_a_run_directory(tmp_path):
    prior = tmp_path / "tiny-arith"
    prior.mkdir()
    (prior / "summary.json").write_text('{"the": "previous 60-step run"}')
    proc = run("-m", "jetrl.demo", "--out-dir", str(tmp_path), "--no-compare", "--dry-run")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert first_err(proc) == (
        f"jetrl demo: {prior} exists; this run goes to {tmp_path / 'tiny-arith-2'} (--overwrite replaces it instead)"
    )
    assert f"outputs would go to {tmp_path / 'tiny-arith-2'}" in proc.stdout
    assert (prior / "summary.json").read_text() == '{"the": "previous 60-step run"}'
    # the comparison run's directory counts too
    (tmp_path / "tiny-arith-2-naive-fp8-rollout").mkdir()
    (tmp_path / "tiny-arith-2-naive-fp8-rollout" / "metrics.jsonl").write_text("")
    from jetrl.demo import free_name

    assert free_name(tmp_path, "tiny-arith", compare=True) == "tiny-arith-3"
    assert free_name(tmp_path, "tiny-arith", compare=False) == "tiny-arith-2"


def test_run_demo_refuses_an_existing_directory_unless_asked(tmp_path):
    from jetrl.demo import run_demo
    from jetrl.train.trainer import TrainError

    prior = tmp_path / "mine"
    prior.mkdir()
    (prior / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    with pytest.raises(TrainError, match="exists; pass --resume to continue it, --overwrite"):
        run_demo(name="mine", out_dir=str(tmp_path), compare=False, overrides=[], log=lambda *a: None)
    assert (prior / "metrics.jsonl").exists()


def test_export_errors_name_the_run_directory(tmp_path):
    proc = run("-m", "jetrl.cli", "export", str(tmp_path / "nope"))
    assert proc.returncode == 2 and first_err(proc) == f"jetrl export: {tmp_path / 'nope'}: no such run directory"
    (tmp_path / "empty").mkdir()
    proc = run("-m", "jetrl.cli", "export", str(tmp_path / "empty"))
    assert proc.returncode == 2
    assert first_err(proc).startswith(f"jetrl export: {tmp_path / 'empty' / 'config.json'}: missing")
