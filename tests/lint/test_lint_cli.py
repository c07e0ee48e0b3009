"""`jetrl lint`: the frozen flag set, exit codes 0 / 1 / 2, table and JSON output."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from jetrl.cli import main as jetrl_main
from jetrl.lint.cli import build_parser, main
from jetrl.testing.subprocess_guard import HANG_GUARD_S

from .conftest import BLOCK_FP8_CONFIG, COMPATIBLE_ENV, vllm_available

FROZEN_FLAGS = {
    "--model",
    "--recipe",
    "--rollout",
    "--numeric",
    "--numerics",
    "--engine-ops",
    "--json",
    "--backend",
    "--served",
    "--quantization",
    "--kv-cache-dtype",
    "--tensor-parallel-size",
    "--quant-op",
    "-h",
    "--help",
}


def test_flag_set_is_frozen():
    """Adding or renaming a flag is an interface change: update this set and the docs together."""
    flags = {s for a in build_parser()._actions for s in a.option_strings}
    assert flags == FROZEN_FLAGS


@pytest.fixture
def served(tmp_path):
    """A served-checkpoint config.json: stock vLLM block FP8 (128x128, no scale_fmt)."""
    p = tmp_path / "served"
    p.mkdir()
    (p / "config.json").write_text(json.dumps({"quantization_config": BLOCK_FP8_CONFIG}))
    return p


def _clear_vllm_env(monkeypatch):
    for k in ("VLLM_USE_DEEP_GEMM", "VLLM_USE_DEEP_GEMM_E8M0", "VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER"):
        monkeypatch.delenv(k, raising=False)


def test_exit_0_on_a_consistent_stock_setup(tiny_ckpt, served, monkeypatch, capsys):
    _clear_vllm_env(monkeypatch)
    for k, v in COMPATIBLE_ENV.items():
        monkeypatch.setenv(k, v)
    argv = ["--model", str(tiny_ckpt), "--recipe", "jetrl-unified", "--rollout", "stock-vllm"]
    assert main([*argv, "--served", str(served)]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("CONSISTENT: 0 error(s), 0 warning(s)")


def test_exit_1_with_vllm_default_env_and_json(tiny_ckpt, served, monkeypatch, capsys):
    _clear_vllm_env(monkeypatch)
    argv = ["lint", "--model", str(tiny_ckpt), "--recipe", "jetrl-unified", "--rollout", "stock-vllm"]
    assert jetrl_main([*argv, "--served", str(served), "--json"]) == 1  # through the jetrl dispatcher
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and report["n_errors"] == 3
    fixes = {f["fix"].split(" before")[0] for f in report["findings"]}
    assert fixes == {"export VLLM_USE_DEEP_GEMM_E8M0=0", "export VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER=0"}


def test_exit_2_on_usage_and_environment_errors(tmp_path, tiny_ckpt, capsys):
    assert main([]) == 2  # --model and --recipe are required
    assert main(["--model", str(tiny_ckpt), "--recipe", "no-such-recipe"]) == 2
    assert main(["--model", str(tmp_path), "--recipe", "jetrl-unified", "--rollout", "stock-vllm"]) == 2
    assert "no config.json" in capsys.readouterr().err
    argv = ["--model", str(tiny_ckpt), "--recipe", "jetrl-unified", "--rollout", "stock-vllm", "--numeric"]
    assert main(argv) == 2
    assert "numeric mode needs a live engine" in capsys.readouterr().err
    assert main(["--model", str(tiny_ckpt), "--recipe", "jetrl-unified", "--tensor-parallel-size", "2"]) == 2
    assert "--tensor-parallel-size only apply to --rollout stock-vllm" in capsys.readouterr().err
    argv = ["--model", str(tiny_ckpt), "--recipe", "jetrl-unified", "--rollout", "stock-vllm", "--engine-ops", "hf"]
    assert main(argv) == 2
    assert "--engine-ops only apply to --rollout jetrl-vllm" in capsys.readouterr().err
    argv = ["--model", str(tiny_ckpt), "--recipe", "jetrl-unified", "--numeric", "--numerics", "vllm-cpu"]
    assert main([*argv, "--engine-ops", "hf"]) == 2
    assert "use --numerics hf" in capsys.readouterr().err


@pytest.mark.vllm
@pytest.mark.skipif(not vllm_available(), reason="needs vLLM (vllm-cpu) for a live rollout engine")
def test_live_engine_cli_in_a_fresh_process_keeps_stdout_json_only(tiny_ckpt):
    """The real entry point end to end: vLLM's own logging must not reach stdout (--json parses), and
    the naive per-tensor rollout of a BF16 trainer exits 1 naming the first layer."""
    argv = [sys.executable, "-m", "jetrl.cli", "lint", "--model", str(tiny_ckpt), "--recipe", "naive-fp8-rollout"]
    proc = subprocess.run([*argv, "--json"], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 1, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert {(f["code"], f["tensor"]) for f in report["findings"]} == {
        ("quantized-one-side", "w"),
        ("quantized-one-side", "x"),
    }
    assert all(f["training_module"] == "model.layers.0.self_attn.q_proj" for f in report["findings"])
    assert "jetrl_fp8_naive" in report["rollout_graph"]["source"]


def test_a_crash_of_the_lint_exits_2_not_1(tiny_ckpt, monkeypatch, capsys):
    import jetrl.lint.api as api

    def boom(*a, **k):
        raise RuntimeError("simulated internal failure")

    monkeypatch.setattr(api, "lint", boom)
    assert main(["--model", str(tiny_ckpt), "--recipe", "jetrl-unified", "--rollout", "stock-vllm"]) == 2
    assert "simulated internal failure" in capsys.readouterr().err


def test_resolve_numerics_reads_the_exports_jetrl_json(tmp_path, tiny_ckpt):
    from jetrl.lint.cli import resolve_numerics

    (tmp_path / "jetrl.json").write_text(json.dumps({"numerics": "vllm-cpu", "recipe": "jetrl-unified"}))
    assert resolve_numerics("auto", str(tmp_path), "jetrl-vllm") == "vllm-cpu"
    assert resolve_numerics("hf", str(tmp_path), "jetrl-vllm") == "hf"  # an explicit choice wins
    (tmp_path / "jetrl.json").write_text(json.dumps({"numerics": "hf"}))
    assert resolve_numerics("auto", str(tmp_path), "jetrl-vllm") == "hf"
    import torch

    want = "hf" if torch.cuda.is_available() else "vllm-cpu"  # what jetrl train runs with the engine on CPU
    assert resolve_numerics("auto", str(tiny_ckpt), "jetrl-vllm") == want
    (tmp_path / "jetrl.json").write_text("{}")
    assert main(["--model", str(tmp_path), "--recipe", "jetrl-unified", "--numeric"]) == 2


def test_resolve_engine_ops_reads_the_exports_jetrl_json(tmp_path, tiny_ckpt):
    from jetrl.lint.cli import resolve_engine_ops

    assert resolve_engine_ops("auto", str(tiny_ckpt)) == "vllm"  # no jetrl.json
    (tmp_path / "jetrl.json").write_text(json.dumps({"numerics": "hf"}))  # an export from before engine_ops
    assert resolve_engine_ops("auto", str(tmp_path)) == "vllm"
    (tmp_path / "jetrl.json").write_text(json.dumps({"numerics": "hf", "engine_ops": "hf"}))
    assert resolve_engine_ops("auto", str(tmp_path)) == "hf" and resolve_engine_ops("vllm", str(tmp_path)) == "vllm"
    (tmp_path / "jetrl.json").write_text(json.dumps({"numerics": "hf", "engine_ops": "fused"}))
    with pytest.raises(ValueError, match="pass --engine-ops hf"):
        resolve_engine_ops("auto", str(tmp_path))
    (tmp_path / "jetrl.json").write_text("{oops")
    with pytest.raises(ValueError, match=r"jetrl\.json: not a JSON object"):
        resolve_engine_ops("auto", str(tmp_path))


def test_a_corrupt_checkpoint_points_to_the_served_flag_that_exists(tiny_ckpt, tmp_path):
    """Through the real entry point: exit 2, one line naming the checkpoint, and the flag it suggests is
    `--served` (there is no `--served-config`)."""
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in tiny_ckpt.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    w = bad / "model.safetensors"
    w.write_bytes(w.read_bytes()[:-4096])
    argv = [sys.executable, "-m", "jetrl.cli", "lint", "--model", str(bad), "--recipe", "jetrl-unified"]
    proc = subprocess.run([*argv, "--rollout", "stock-vllm"], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 2, proc.stderr[-2000:]
    first = proc.stderr.splitlines()[0]
    assert first.startswith(f"jetrl lint: error: cannot load {bad} as the trainer's BF16 HF model")
    assert "--served:" in first and "--served-config" not in proc.stderr and "Traceback" not in proc.stderr
    assert build_parser().parse_args(["--model", "m", "--recipe", "bf16", "--served", "x"]).served == "x"


@pytest.mark.vllm
@pytest.mark.skipif(not vllm_available(), reason="needs vLLM (vllm-cpu) for a live rollout engine")
def test_numeric_mode_uses_the_runs_numerics_and_says_what_it_compares(tiny_ckpt, probe, unified_engine):
    """`--numeric` with the vllm-cpu numerics jetrl train runs on CPU: the graph check still passes, the
    per-layer drift is what training sees (smaller than with transformers' ops), and the table says in
    words what each column compares and why drift does not make the verdict inconsistent."""
    from jetrl.lint.api import lint
    from jetrl.lint.numeric import capture_training_numerics
    from jetrl.recipe import Recipe

    recipe = Recipe.from_name("jetrl-unified")
    drift = {}
    for numerics in ("hf", "vllm-cpu"):
        cap = capture_training_numerics(tiny_ckpt, recipe, numerics=numerics, probe=probe)
        report = lint(tiny_ckpt, recipe, numeric=True, engine=unified_engine, training=cap, probe=probe)
        assert report.ok, report.table()
        assert report.numeric["trainer_numerics"] == numerics
        rows = [r for r in report.numeric["layers"] if r.get("input_max_abs_diff") is not None]
        assert all(r["weight_bytes_equal"] and r["act_bytes_equal"] for r in rows)
        drift[numerics] = sum(r["input_max_abs_diff"] for r in rows)
        table = report.table()
        assert f"model.numerics '{numerics}'" in table
        for col in ("W BYTES:", "X BYTES:", "MAX|dX|:", "verdict: only differing W or X bytes are errors"):
            assert col in table, col
    assert drift["vllm-cpu"] < drift["hf"], drift


def test_readme_lint_commands_use_real_flags_and_say_where_ckpt_comes_from():
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    lines = [ln for ln in readme.splitlines() if ln.lstrip().startswith("jetrl lint ")]
    assert lines
    known = {s for a in build_parser()._actions for s in a.option_strings}
    for ln in lines:
        assert set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", ln.split("#")[0])) <= known, ln
    assert re.search(r"`CKPT` is the trainer's BF16\s+HF checkpoint: `jetrl export RUN_DIR` writes one", readme)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_strict_numerics_capture_needs_a_gpu(tiny_ckpt, probe):
    from jetrl.lint.builders import LintEnvError
    from jetrl.lint.numeric import capture_training_numerics
    from jetrl.recipe import Recipe

    with pytest.raises(LintEnvError, match="numerics 'strict'.*needs a GPU"):
        capture_training_numerics(tiny_ckpt, Recipe.from_name("jetrl-unified"), numerics="strict", probe=probe)


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--engine-ops", "vllm"], r"--numerics strict needs .*--engine-ops hf \(resolved: vllm\)"),
        (["--rollout", "stock-vllm"], "--numerics strict compares with a live strict engine: use --rollout jetrl-vllm"),
        *(
            []
            if torch.cuda.is_available()
            else [(["--engine-ops", "hf"], "--numerics strict runs vLLM's CUDA kernels on both sides: it needs a GPU")]
        ),
    ],
)
def test_strict_numerics_are_refused_where_they_cannot_run(tiny_ckpt, capsys, flags, named):
    import re

    argv = ["--model", str(tiny_ckpt), "--recipe", "jetrl-unified", "--numeric", "--numerics", "strict", *flags]
    assert main(argv) == 2
    assert re.search(named, capsys.readouterr().err)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_a_strict_run_s_export_is_linted_strict_or_refused_never_as_hf(tiny_ckpt, tmp_path, capsys):
    """--numerics auto reads the export's jetrl.json: a strict run's export must not be compared as 'hf'."""
    import shutil

    export = tmp_path / "hf"
    shutil.copytree(tiny_ckpt, export)
    (export / "jetrl.json").write_text(
        json.dumps({"recipe": "jetrl-unified", "numerics": "strict", "engine_ops": "hf"})
    )
    assert main(["--model", str(export), "--recipe", "jetrl-unified", "--numeric"]) == 2
    assert "--numerics strict runs vLLM's CUDA kernels on both sides: it needs a GPU" in capsys.readouterr().err
