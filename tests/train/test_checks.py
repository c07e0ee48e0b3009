"""Environment / shape checks: fail before any work, naming the field."""

from __future__ import annotations

import json

import pytest
import torch

from jetrl.train.checks import check_environment, projection_shapes
from jetrl.train.cli import main as cli_main
from jetrl.train.config import ConfigError, config_from_dict


def _check(raw):
    return check_environment(config_from_dict(raw))


def test_default_passes_and_returns_recipe():
    assert _check({}).name == "jetrl-unified"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
@pytest.mark.parametrize(
    "raw, field",
    [
        ({"run": {"device": "cuda"}}, "run.device"),
        ({"run": {"gemm_backend": "deepgemm"}}, "run.gemm_backend"),
        ({"run": {"gemm_backend": "torch-blockwise"}}, "run.gemm_backend"),
    ],
)
def test_missing_gpu_backend_names_field(raw, field):
    with pytest.raises(ConfigError) as ei:
        _check(raw)
    assert str(ei.value).startswith(field + ":"), str(ei.value)


@pytest.mark.parametrize(
    "raw, field, fragment",
    [
        ({"model": {"tiny": {"hidden_size": 192}}}, "model.tiny", "multiple of 128"),
        ({"rollout": {"max_model_len": 8}}, "rollout.max_model_len", "longest prompt"),
        ({"rollout": {"max_tokens": 2}}, "rollout.max_tokens", "longest answer"),
        ({"rollout": {"max_model_len": 4096}}, "rollout.max_model_len", "positions"),
        ({"model": {"path": "/nonexistent/model"}, "warmup": {"steps": 0}}, "model.path", "config.json"),
    ],
)
def test_impossible_shapes_name_field(raw, field, fragment):
    with pytest.raises(ConfigError) as ei:
        _check(raw)
    msg = str(ei.value)
    assert msg.startswith(field + ":") and fragment in msg, msg


def test_fp8_shape_check_uses_recipe(tmp_path):
    # a model whose intermediate size is not a multiple of 128: refused for FP8 recipes, fine for bf16
    cfg = {
        "hidden_size": 256,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 128,
        "intermediate_size": 320,
        "max_position_embeddings": 64,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert projection_shapes(cfg)["down_proj"] == (256, 320)
    base = {"model": {"path": str(tmp_path)}, "warmup": {"steps": 0}}
    with pytest.raises(ConfigError, match=r"model.path: .*gate_proj \(N=320, K=256\)"):
        _check({**base, "run": {"recipe": "jetrl-unified"}})
    with pytest.raises(ConfigError, match="model.path"):
        _check({**base, "run": {"recipe": "naive-fp8-rollout"}})
    assert _check({**base, "run": {"recipe": "bf16"}}).name == "bf16"


def test_cli_bad_config_exits_2_naming_field(tmp_path, capsys):
    p = tmp_path / "c.yaml"
    p.write_text("algo:\n  clip_hgh: 0.3\n")
    assert cli_main([str(p)]) == 2
    assert "algo.clip_hgh" in capsys.readouterr().err
    p.write_text("run:\n  steps: 2\n")
    assert cli_main([str(p), "--dry-run"]) == 0
    assert "dry run: config OK" in capsys.readouterr().out
    assert not (tmp_path / "runs").exists()


def test_vllm_cpu_numerics_refused_on_cuda_device():
    with pytest.raises(ConfigError, match="^(run.device|model.numerics):"):
        _check({"run": {"device": "cuda"}, "model": {"numerics": "vllm-cpu"}})


def test_trainer_matched_engine_needs_an_architecture_it_covers(tmp_path):
    """rollout.engine_ops hf/fused (what auto picks for jetrl-unified on CUDA) exists for Qwen3 / Llama / Qwen2:
    another architecture is refused before any work, naming the key and the way out."""
    from jetrl.tiny import tiny_qwen3_config

    assert _check({"rollout": {"engine_ops": "hf"}}).name == "jetrl-unified"  # the tiny Qwen3
    cfg = tiny_qwen3_config().to_dict()
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "architectures": ["MistralForCausalLM"]}))
    raw = {"model": {"path": str(tmp_path)}, "warmup": {"steps": 0}, "rollout": {"engine_ops": "hf"}}
    with pytest.raises(ConfigError, match=r"^rollout.engine_ops: .*MistralForCausalLM.*use engine_ops='vllm'"):
        _check(raw)
    assert _check({**raw, "rollout": {"engine_ops": "vllm"}}).name == "jetrl-unified"
