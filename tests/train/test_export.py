"""`jetrl export RUN_DIR [--fp8]`: the trained policy as an HF checkpoint and as vLLM's block-FP8 checkpoint.

The run directory is made by the trainer's own code (config, warm-up, FP8 conversion, optimizer, checkpoint)
without an engine; the export runs through the real entry point in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from jetrl.testing.subprocess_guard import HANG_GUARD_S


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    from jetrl.convert import convert_model
    from jetrl.demo import DEFAULT_CONFIG
    from jetrl.train.config import apply_overrides, config_from_dict
    from jetrl.train.policy import MixedPrecisionAdamW
    from jetrl.train.trainer import Trainer
    from jetrl.train.warmup import prepare_initial_checkpoint

    out = tmp_path_factory.mktemp("runs")
    cfg = config_from_dict(apply_overrides(DEFAULT_CONFIG, [f"run.out_dir={out}", "warmup.steps=2"]))
    tr = Trainer(cfg, log=lambda *a: None)
    tr.init_path = prepare_initial_checkpoint(cfg, log=lambda *a: None)
    tr.model = tr._load_policy()
    convert_model(tr.model, tr.recipe, backend=cfg.run.gemm_backend)
    tr.opt = MixedPrecisionAdamW(tr.model, lr=1e-2)
    torch.manual_seed(0)
    for p in tr.opt.params:  # one optimizer step: the trained weights differ from the start checkpoint's
        p.main_grad.normal_()
    tr.opt.step()
    tr._checkpoint(1)
    return tr


def _export(run_dir, *extra):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "jetrl.cli", "export", str(run_dir), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=HANG_GUARD_S)


def test_export_writes_the_trained_policy_as_hf_and_block_fp8(trained_run):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from jetrl.convert import export_fp8_weights

    tr = trained_run
    proc = _export(tr.run_dir, "--fp8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    root = tr.run_dir / "export" / "step_000001"
    hf, fp8 = root / "hf", root / "fp8-block128"
    assert f"-> {hf} (HF, BF16 safetensors + tokenizer)" in proc.stdout

    exported = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.bfloat16)
    start = dict(AutoModelForCausalLM.from_pretrained(tr.init_path, dtype=torch.bfloat16).named_parameters())
    mine = dict(tr.model.named_parameters())
    changed = 0
    for name, p in exported.named_parameters():
        assert torch.equal(p, mine[name]), name  # the trainer's compute weights, bit for bit
        changed += not torch.equal(p, start[name])
    assert changed == len(mine)  # every parameter was trained: the export is not the start checkpoint
    assert not list(hf.glob("*.bin")) and (hf / "model.safetensors").is_file()
    tok = AutoTokenizer.from_pretrained(hf)
    assert tok.decode(tok("3+4=").input_ids, skip_special_tokens=True) == "3+4="
    meta = json.loads((hf / "jetrl.json").read_text())
    assert meta["step"] == 1 and meta["recipe"] == "jetrl-unified" and meta["numerics"] == "vllm-cpu"

    tensors = load_file(str(fp8 / "model.safetensors"))
    want = export_fp8_weights(tr.model)
    assert want
    for name, (q, s) in want.items():
        assert torch.equal(tensors[name].view(torch.uint8), q.view(torch.uint8)), name
        assert torch.equal(tensors[name.removesuffix(".weight") + ".weight_scale_inv"], s), name
    qc = json.loads((fp8 / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [128, 128]

    again = _export(tr.run_dir)
    assert again.returncode == 2
    assert (
        again.stderr.splitlines()[0]
        == f"jetrl export: {hf} exists; pass --overwrite to replace it, or --out another directory"
    )


def test_export_refuses_fp8_for_a_bf16_run_and_a_missing_step(trained_run, tmp_path):
    cfg = json.loads((trained_run.run_dir / "config.json").read_text())
    cfg["run"]["recipe"] = "bf16"
    run = tmp_path / "bf16-run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(cfg))
    proc = _export(run, "--fp8")
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[0].startswith("jetrl export: --fp8: the run trained with recipe 'bf16'")
    proc = _export(trained_run.run_dir, "--step", "7")
    assert proc.returncode == 2 and "--step 7:" in proc.stderr.splitlines()[0]
    proc = _export(run)  # no checkpoints at all
    assert proc.returncode == 1 and "nothing to resume" not in proc.stderr
    assert proc.stderr.splitlines()[0].startswith("jetrl export: no checkpoint under")
