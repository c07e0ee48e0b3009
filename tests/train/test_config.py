"""Bad configs fail at load time with a message that names the field."""

from __future__ import annotations

import json

import pytest

from jetrl.train.config import ConfigError, config_from_dict, load_config


def test_defaults_and_presets():
    cfg = config_from_dict({})
    assert cfg.algo.name == "grpo" and cfg.algo.loss_agg == "seq-mean-token-mean" and cfg.algo.clip_high == 0.2
    dapo = config_from_dict({"algo": {"name": "dapo"}})
    assert dapo.algo.clip_high == 0.28 and dapo.algo.loss_agg == "token-mean" and dapo.algo.dynamic_sampling
    # explicit keys override the preset
    assert config_from_dict({"algo": {"name": "dapo", "clip_high": 0.3}}).algo.clip_high == 0.3


@pytest.mark.parametrize(
    "raw, field",
    [
        ({"algo": {"clip_hgh": 0.3}}, "algo.clip_hgh"),
        ({"rollut": {}}, "rollut"),
        ({"run": {"steps": "ten"}}, "run.steps"),
        ({"run": {"steps": 0}}, "run.steps"),
        ({"run": {"recipe": "fp4"}}, "run.recipe"),
        ({"run": {"device": "tpu"}}, "run.device"),
        ({"run": {"gemm_backend": "cublas"}}, "run.gemm_backend"),
        ({"rollout": {"samples_per_prompt": 1}}, "rollout.samples_per_prompt"),
        ({"rollout": {"top_p": 0.0}}, "rollout.top_p"),
        ({"algo": {"name": "ppo"}}, "algo.name"),
        ({"algo": {"mini_batches": 3}}, "algo.mini_batches"),
        ({"algo": {"loss_agg": "sum"}}, "algo.loss_agg"),
        ({"algo": {"overlong_buffer": 8}}, "algo.overlong_buffer"),
        ({"algo": {"tis_cap": -1}}, "algo.tis_cap"),
        ({"algo": {"kl_coef": -0.1}}, "algo.kl_coef"),
        ({"algo": {"cuda_graphs": True}}, "algo.cuda_graphs"),  # run.device cpu
        ({"algo": {"cuda_graphs": "sometimes"}}, "algo.cuda_graphs"),
        ({"algo": {"micro_batch_tokens": 0}}, "algo.micro_batch_tokens"),
        ({"algo": {"micro_batch_tokens": -64}}, "algo.micro_batch_tokens"),
        ({"algo": {"micro_batch_tokens": 8}}, "algo.micro_batch_tokens"),  # < rollout.max_tokens + 1 = 9
        ({"algo": {"micro_batch_tokens": 1.5}}, "algo.micro_batch_tokens"),
        ({"algo": {"kl_type": "k4"}}, "algo.kl_type"),
        ({"algo": {"clip_ratio_c": 1.0}}, "algo.clip_ratio_c"),
        ({"algo": {"clip_ratio_c": "three"}}, "algo.clip_ratio_c"),
        ({"algo": {"loss_scale_factor": 0}}, "algo.loss_scale_factor"),
        ({"algo": {"loss_scale_factor": 2.5}}, "algo.loss_scale_factor"),
        ({"algo": {"eps": -1e-6}}, "algo.eps"),
        ({"model": {"fuse_producers": True}, "run": {"recipe": "bf16"}}, "model.fuse_producers"),
        ({"model": {"fuse_producers": True, "numerics": "vllm-cpu"}}, "model.fuse_producers"),
        ({"rollout": {"engine_ops": "triton"}}, "rollout.engine_ops"),
        ({"rollout": {"engine_ops": "hf"}, "model": {"numerics": "vllm-cpu"}}, "rollout.engine_ops"),
        ({"rollout": {"engine_ops": "fused"}}, "rollout.engine_ops"),  # model.fuse_producers false
        ({"rollout": {"engine_ops": "hf"}, "model": {"fuse_producers": True}}, "rollout.engine_ops"),
        ({"rollout": {"engine_kwargs": {"engine_ops": "hf"}}}, "rollout.engine_kwargs"),
        (
            {"rollout": {"engine_kwargs": {"distributed_executor_backend": "mp"}}},
            "rollout.engine_kwargs.distributed_executor_backend",
        ),
        ({"rollout": {"engine_kwargs": {"tensor_parallel_size": 2}}}, "rollout.engine_kwargs.tensor_parallel_size"),
        ({"rollout": {"engine_kwargs": {"data_parallel_size": 2}}}, "rollout.engine_kwargs.data_parallel_size"),
        ({"optim": {"betas": [0.9]}}, "optim.betas"),
        ({"task": {"ops": ["/"]}}, "task.ops"),
        ({"model": {"dtype": "float16"}}, "model.dtype"),
        ({"model": {"numerics": "vllm-gpu"}}, "model.numerics"),
        ({"model": {"numerics": "strict"}, "rollout": {"engine_ops": "hf"}}, "model.numerics"),  # run.device cpu
        (
            {"model": {"numerics": "strict"}, "run": {"device": "cuda"}, "rollout": {"engine_ops": "vllm"}},
            "model.numerics",
        ),
        (
            {"model": {"numerics": "strict"}, "run": {"device": "cuda", "recipe": "bf16"}},
            "model.numerics",
        ),  # auto: vllm
        (
            {
                "model": {"numerics": "strict"},
                "run": {"device": "cuda"},
                "rollout": {"engine_ops": "hf", "temperature": 0.7},
            },
            "model.numerics",
        ),
        (
            {
                "model": {"numerics": "strict", "fuse_producers": True},
                "run": {"device": "cuda"},
                "rollout": {"engine_ops": "vllm"},
            },
            "model.numerics",
        ),
        ({"model": {"attn_implementation": "flash"}}, "model.attn_implementation"),
        ({"model": {"path": "/x", "tiny": {"num_hidden_layers": 2}}}, "model.tiny"),
        ({"lint": {"enabled": "yes"}}, "lint.enabled"),
    ],
)
def test_bad_config_names_field(raw, field):
    with pytest.raises(ConfigError) as ei:
        config_from_dict(raw)
    assert str(ei.value).startswith(field + ":"), str(ei.value)


def test_one_engine_on_one_device_its_executor_from_rollout_executor():
    """jetrl train runs one engine on one device: its executor is rollout.executor ('uni' / 'mp'), never an
    engine_kwargs key; tensor parallelism points to verl; the numerics that set up vLLM in the trainer's own
    process refuse an engine in other processes."""
    kept = {"tensor_parallel_size": 1, "enforce_eager": False}
    assert config_from_dict({"rollout": {"engine_kwargs": kept}}).rollout.engine_kwargs == kept
    assert config_from_dict({"rollout": {"executor": "mp"}, "model": {"numerics": "hf"}}).rollout.executor == "mp"
    assert config_from_dict({}).rollout.executor == "uni"  # 'auto' on a CPU
    cuda = {"run": {"device": "cuda"}}
    assert config_from_dict(cuda).rollout.executor == "mp"  # 'auto' on CUDA with numerics 'hf'
    assert config_from_dict({**cuda, "rollout": {"executor": "uni"}}).rollout.executor == "uni"
    strict_auto = {**cuda, "model": {"numerics": "strict"}, "rollout": {"engine_ops": "hf"}}
    assert config_from_dict(strict_auto).rollout.executor == "uni"
    with pytest.raises(ConfigError, match=r"executor is the key rollout\.executor"):
        config_from_dict({"rollout": {"engine_kwargs": {"distributed_executor_backend": "uni"}}})
    with pytest.raises(ConfigError, match=r"tensor_parallel_size: 2: .*python -m jetrl\.verl"):
        config_from_dict({"rollout": {"engine_kwargs": {"tensor_parallel_size": 2}}})
    with pytest.raises(ConfigError, match=r"rollout\.executor: 'ray': choose 'auto', 'uni' or 'mp'"):
        config_from_dict({"rollout": {"executor": "ray"}})
    with pytest.raises(ConfigError, match=r"rollout\.executor: 'mp' .*model\.numerics='vllm-cpu'.*\(use 'uni'\)"):
        config_from_dict({"rollout": {"executor": "mp"}, "model": {"numerics": "vllm-cpu"}})
    strict = {
        "model": {"numerics": "strict"},
        "run": {"device": "cuda"},
        "rollout": {"engine_ops": "hf", "executor": "mp"},
    }
    with pytest.raises(ConfigError, match=r"rollout\.executor: 'mp' .*model\.numerics='strict'"):
        config_from_dict(strict)


def test_several_engines_need_the_engines_in_their_own_processes():
    assert config_from_dict({}).rollout.engines == 1
    two = config_from_dict({"rollout": {"engines": 2, "executor": "mp"}})
    assert (two.rollout.engines, two.rollout.executor) == (2, "mp")
    assert config_from_dict({"run": {"device": "cuda"}, "rollout": {"engines": 3}}).rollout.engines == 3  # auto: mp
    with pytest.raises(ConfigError, match=r"^rollout\.engines: 2 engines need rollout\.executor 'mp' .* runs 'uni'"):
        config_from_dict({"rollout": {"engines": 2}})  # 'auto' on a CPU: 'uni'
    for bad, msg in ((0, "0: at least one engine"), (-1, "-1: at least one engine"), (True, "expected an integer")):
        with pytest.raises(ConfigError, match=rf"^rollout\.engines: {msg}"):
            config_from_dict({"rollout": {"engines": bad, "executor": "mp"}})


def test_strict_numerics_pairs_with_the_trainers_ops_in_the_engine():
    cfg = config_from_dict(
        {"model": {"numerics": "strict"}, "run": {"device": "cuda"}, "rollout": {"engine_ops": "hf"}}
    )
    assert (cfg.model.numerics, cfg.rollout.engine_ops) == ("strict", "hf")
    fused = {"numerics": "strict", "fuse_producers": True}
    cfg = config_from_dict({"model": fused, "run": {"device": "cuda"}, "rollout": {"engine_ops": "fused"}})
    assert cfg.model.fuse_producers and cfg.rollout.engine_ops == "fused"
    with pytest.raises(ConfigError, match="rollout.engine_ops 'fused' \\(this config: 'vllm'\\)"):
        config_from_dict({"model": fused, "run": {"device": "cuda"}, "rollout": {"engine_ops": "vllm"}})


@pytest.mark.parametrize(
    "raw, ops",
    [
        ({}, "vllm"),  # CPU
        ({"run": {"device": "cuda"}}, "hf"),
        ({"run": {"device": "cuda"}, "model": {"fuse_producers": True}}, "fused"),
        ({"run": {"device": "cuda"}, "model": {"numerics": "strict"}}, "hf"),
        ({"run": {"device": "cuda", "recipe": "bf16"}}, "vllm"),
        ({"run": {"device": "cuda", "recipe": "naive-fp8-rollout"}}, "vllm"),
        ({"run": {"device": "cuda"}, "rollout": {"engine_ops": "vllm"}}, "vllm"),
    ],
)
def test_engine_ops_auto_runs_the_trainers_ops_for_unified_on_cuda(raw, ops):
    cfg = config_from_dict(raw)
    assert cfg.rollout.engine_ops == ops
    assert config_from_dict(cfg.to_dict()) == cfg  # the saved config records the resolved value


@pytest.mark.parametrize(
    "raw, graphs",
    [
        ({}, False),  # CPU
        ({"run": {"device": "cuda"}}, True),
        ({"run": {"device": "cuda", "recipe": "bf16"}}, True),
        ({"run": {"device": "cuda"}, "model": {"numerics": "strict"}}, False),
        ({"run": {"device": "cuda"}, "algo": {"cuda_graphs": False}}, False),
        ({"run": {"device": "cuda"}, "model": {"numerics": "strict"}, "algo": {"cuda_graphs": True}}, True),
    ],
)
def test_cuda_graphs_auto_graphs_the_training_on_cuda(raw, graphs):
    cfg = config_from_dict(raw)
    assert cfg.algo.cuda_graphs is graphs
    assert config_from_dict(cfg.to_dict()) == cfg  # the saved config records the resolved value


def test_verl_algo_knobs():
    """verl's names and defaults: dual-clip 3 (GRPO) / 10 (DAPO), every loss_agg_mode and KL kind."""
    grpo, dapo = config_from_dict({}).algo, config_from_dict({"algo": {"name": "dapo"}}).algo
    assert (grpo.clip_ratio_c, dapo.clip_ratio_c, grpo.loss_scale_factor) == (3.0, 10.0, None)
    assert config_from_dict({"algo": {"clip_ratio_c": None}}).algo.clip_ratio_c is None
    for mode in ("token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        assert config_from_dict({"algo": {"loss_agg": mode, "loss_scale_factor": 8}}).algo.loss_agg == mode
    for kind in ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl", "k3+", "low_var_kl+"):
        assert config_from_dict({"algo": {"kl_type": kind}}).algo.kl_type == kind


def test_micro_batch_tokens():
    assert config_from_dict({}).algo.micro_batch_tokens is None
    assert config_from_dict({"algo": {"micro_batch_tokens": 9}}).algo.micro_batch_tokens == 9  # max_tokens + 1
    cfg = config_from_dict({"rollout": {"max_tokens": 100, "max_model_len": 160}, "algo": {"micro_batch_tokens": 512}})
    assert cfg.algo.micro_batch_tokens == 512
    with pytest.raises(ConfigError, match=r"algo.micro_batch_tokens: 64 must be >= rollout.max_tokens \+ 1 = 101"):
        config_from_dict({"rollout": {"max_tokens": 100, "max_model_len": 160}, "algo": {"micro_batch_tokens": 64}})


def test_unknown_key_suggests_closest():
    with pytest.raises(ConfigError, match="did you mean 'algo.clip_high'"):
        config_from_dict({"algo": {"clip_hgh": 0.3}})


def test_load_yaml_json_and_overrides(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("run:\n  steps: 5\nalgo:\n  name: dapo\n")
    cfg = load_config(y, ["run.seed=7", "optim.betas=[0.8, 0.9]"])
    assert (cfg.run.steps, cfg.run.seed, cfg.algo.name, cfg.optim.betas) == (5, 7, "dapo", (0.8, 0.9))
    j = tmp_path / "c.json"
    j.write_text(json.dumps(cfg.to_dict()))
    assert load_config(j) == cfg
    with pytest.raises(ConfigError, match="run.stepz"):
        load_config(y, ["run.stepz=3"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def test_recipe_yaml_is_the_embedded_default():
    from pathlib import Path

    from jetrl.demo import DEFAULT_CONFIG

    yaml_path = Path(__file__).resolve().parents[2] / "recipes" / "tiny-arith-cpu.yaml"
    assert load_config(yaml_path) == config_from_dict(DEFAULT_CONFIG)
