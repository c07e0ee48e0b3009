"""Checkpoints without pickles (safetensors + JSON), verified by checksum, newest intact one taken on resume."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch

from jetrl.train.checkpoint import (
    CHECKSUMS_FILE,
    STATE_FILE,
    TENSORS_FILE,
    CheckpointError,
    load_checkpoint,
    load_latest,
    save_checkpoint,
)
from jetrl.train.policy import MixedPrecisionAdamW


def _optimizer_state() -> dict:
    """A real MixedPrecisionAdamW state after two steps: fp32 masters, int-keyed AdamW moments, betas tuple."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)).to(torch.bfloat16)
    opt = MixedPrecisionAdamW(model, lr=1e-2, betas=(0.9, 0.99))
    for _ in range(2):
        for p in opt.params:
            p.main_grad.copy_(torch.randn_like(p.main_grad))
        opt.step()
    return {"step": 7, "optimizer": opt.state_dict(), "trainer": {"wall_s_before": 1.5, "eval_start": None}}


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_roundtrip_of_the_optimizer_state_is_exact_and_loads_into_adamw(tmp_path):
    state = _optimizer_state()
    path = save_checkpoint(tmp_path, 7, state)
    assert sorted(p.name for p in path.iterdir()) == sorted([TENSORS_FILE, STATE_FILE, CHECKSUMS_FILE])
    step, back = load_checkpoint(path)
    assert step == 7 and _equal(state, back)  # int keys, tuples, None and every tensor's bytes survive
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)).to(torch.bfloat16)
    opt = MixedPrecisionAdamW(model, lr=1e-2, betas=(0.9, 0.99))
    opt.load_state_dict(back["optimizer"])
    assert opt.steps == 2 and opt.opt.param_groups[0]["betas"] == (0.9, 0.99)


def test_unstorable_objects_are_refused_before_anything_is_written(tmp_path):
    with pytest.raises(CheckpointError, match=r"state\.trainer\.fn: _Payload is not storable without a pickle"):
        save_checkpoint(tmp_path, 1, {"trainer": {"fn": _Payload("x")}})
    assert list(tmp_path.iterdir()) == []


def test_resume_takes_the_newest_checkpoint_that_verifies_and_names_the_skipped(tmp_path):
    for s in (2, 4):
        save_checkpoint(tmp_path, s, {"w": torch.full((1000,), float(s))}, keep=2)
    newest = tmp_path / "step_000004" / TENSORS_FILE
    with open(newest, "r+b") as f:  # truncated, as a full disk or a killed copy leaves it
        f.truncate(os.path.getsize(newest) // 2)
    got = load_latest(tmp_path)
    assert got.step == 2 and got.state["w"][0].item() == 2.0
    ((path, why),) = got.skipped
    assert path.name == "step_000004" and str(newest) in why and "checksum mismatch" in why


class _Payload:
    """Unpickling this runs code: it creates a marker file."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_pickle_payload_is_refused_and_never_executed(tmp_path):
    marker = tmp_path / "pwned"
    ckpts = tmp_path / "checkpoints"
    # 1. an older jetrl's (or anyone's) torch pickle where a checkpoint is expected
    legacy = ckpts / "step_000003"
    legacy.mkdir(parents=True)
    torch.save({"optimizer": _Payload(str(marker))}, legacy / "state.pt")
    with pytest.raises(CheckpointError, match=r"state\.pt: a pickled checkpoint .* refused"):
        load_checkpoint(legacy)
    # 2. a pickle disguised as the tensors file, with checksums that match it
    forged = ckpts / "step_000005"
    forged.mkdir()
    (forged / TENSORS_FILE).write_bytes(pickle.dumps({"w": _Payload(str(marker))}))
    (forged / STATE_FILE).write_text(json.dumps({"step": 5, "state": {"w": {"__tensor__": "w"}}}))
    from jetrl.train.checkpoint import _sha256

    sums = {n: _sha256(forged / n) for n in (TENSORS_FILE, STATE_FILE)}
    (forged / CHECKSUMS_FILE).write_text(json.dumps({"sha256": sums}))
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load_checkpoint(forged)
    with pytest.raises(CheckpointError, match="no checkpoint under .* verifies"):
        load_latest(ckpts)
    assert not marker.exists()
