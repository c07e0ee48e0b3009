"""Every verl recipe's overrides compose against verl 0.9.1's own ``ppo_trainer`` config (hydra, struct
mode: a key that does not exist is refused) and pass verl's own `validate_config`; the jetrl section
holds only the agreed keys."""

from __future__ import annotations

from pathlib import Path

import pytest

verl = pytest.importorskip("verl", reason="needs verl (the verl test environment installs verl==0.9.1)")

from jetrl.testing.recipes import compose_verl as compose  # noqa: E402
from jetrl.testing.recipes import overrides_dict, recipe_argv, verl_recipes  # noqa: E402

JETRL_KEYS = {
    "jetrl.recipe",
    "jetrl.engine_ops",
    "jetrl.numerics",
    "jetrl.dry_run",
    "jetrl.lint",
    "jetrl.proceed_on_lint_violation",
}
"""The section `python -m jetrl.verl` adds to verl's config (interfaces.md)."""
RECIPES = verl_recipes()


def verl_overrides(script: Path, *args: str, env: dict[str, str] | None = None) -> tuple[list[str], dict]:
    rc, argv, err = recipe_argv(script, *args, env=env)
    assert rc == 0 and argv is not None, f"{script.name}: exit {rc}: {err}"
    ov = overrides_dict(argv)
    jetrl = {k: v for k, v in ov.items() if k.startswith("jetrl.")}
    return [a for a in argv[2:] if not a.startswith("jetrl.")], jetrl


def test_seven_recipes():
    assert [p.stem for p in RECIPES] == [
        "llama3.1-8b_gsm8k",
        "llama3.1-8b_math",
        "qwen2.5-7b_deepmath",
        "qwen2.5-7b_gsm8k",
        "qwen2.5-7b_math",
        "qwen3-8b-base_deepmath",
        "qwen3-8b-base_math",
    ]


@pytest.mark.parametrize("script", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipe_composes_against_verl_schema(script):
    from omegaconf import OmegaConf
    from verl.utils.config import validate_config

    overrides, jetrl = verl_overrides(script)
    assert set(jetrl) <= JETRL_KEYS, f"{script.name}: unknown jetrl keys {set(jetrl) - JETRL_KEYS}"
    additions = [o.split("=", 1)[0] for o in overrides if o.startswith("+")]
    assert all(a.startswith("+reward.reward_kwargs.") for a in additions), additions  # the dapo manager's kwargs
    cfg = compose(overrides)  # raises ConfigCompositionException naming any key verl does not have
    assert OmegaConf.is_struct(cfg)
    dataset = script.stem.split("_", 1)[1]
    assert cfg.data.train_files.endswith(f"/{dataset}/train.parquet")
    assert cfg.data.max_response_length == (16384 if dataset == "deepmath" else 8192)
    assert cfg.reward.custom_reward_function.path.endswith("jetrl/tasks/reward.py")
    assert Path(cfg.reward.custom_reward_function.path).is_file()
    validate_config(cfg, use_reference_policy=cfg.actor_rollout_ref.actor.use_kl_loss, use_critic=False)
    if cfg.reward.reward_manager.name == "dapo":
        kw = cfg.reward.reward_kwargs
        assert kw.max_resp_len == cfg.data.max_response_length > kw.overlong_buffer_cfg.len


def test_unknown_key_is_refused_naming_it():
    from hydra.errors import ConfigCompositionException

    overrides, _ = verl_overrides(RECIPES[0], "actor_rollout_ref.actor.clip_ratio_hihg=0.3")
    with pytest.raises(ConfigCompositionException, match="actor_rollout_ref.actor.clip_ratio_hihg"):
        compose(overrides)


def test_forwarded_overrides_win():
    overrides, jetrl = verl_overrides(
        RECIPES[0], "data.train_batch_size=64", env={"RECIPE": "bf16", "DRY_RUN": "1", "NGPUS": "4"}
    )
    cfg = compose(overrides)
    assert cfg.data.train_batch_size == 64 and cfg.trainer.n_gpus_per_node == 4
    assert jetrl == {
        "jetrl.recipe": "bf16",
        "jetrl.engine_ops": "auto",
        "jetrl.numerics": "hf",
        "jetrl.dry_run": "true",
    }
    _, jetrl = verl_overrides(RECIPES[0], env={"ENGINE_OPS": "hf"})
    assert jetrl["jetrl.engine_ops"] == "hf" and jetrl["jetrl.recipe"] == "jetrl-unified"


@pytest.mark.parametrize("script", [RECIPES[0], RECIPES[-1]], ids=[RECIPES[0].stem, RECIPES[-1].stem])
def test_numerics_strict_takes_verl_s_padded_batch_and_validates(script):
    """``NUMERICS=strict bash recipes/...``: jetrl.numerics=strict with remove-padding off by default, which the
    entrypoint's checks accept for the model's shipped config (a GRPO and a DAPO recipe)."""
    from jetrl.verl.launch import ConfigError, validate
    from jetrl.verl.launch import compose as compose_jetrl

    model = script.parent / "models" / script.stem.split("_", 1)[0]
    env = {"NUMERICS": "strict", "MODEL_PATH": str(model), "NGPUS": "2", "ROLLOUT_TP": "1"}
    overrides, jetrl = verl_overrides(script, env=env)
    assert jetrl["jetrl.numerics"] == "strict"
    cfg = compose_jetrl(overrides + [f"{k}={v}" for k, v in jetrl.items()])
    assert cfg.actor_rollout_ref.model.use_remove_padding is False
    validate(cfg)
    assert cfg.actor_rollout_ref.rollout.engine_kwargs.vllm.attention_backend == "FLASH_ATTN"
    overrides, jetrl = verl_overrides(script, env={**env, "REMOVE_PADDING": "True"})
    with pytest.raises(ConfigError, match="use_remove_padding=True"):
        validate(compose_jetrl(overrides + [f"{k}={v}" for k, v in jetrl.items()]))
    assert (
        verl_overrides(script, env={"MODEL_PATH": str(model)})[0].count(
            "actor_rollout_ref.model.use_remove_padding=True"
        )
        == 1
    )


def _dry_run(script: Path, cwd: Path, **env: str):
    """``DRY_RUN=1 bash recipes/<model>_<dataset>.sh`` with the model's recipes/models config, in `cwd`."""
    import os
    import subprocess
    import sys

    from jetrl.testing.subprocess_guard import HANG_GUARD_S

    model = script.stem.split("_", 1)[0]
    full_env = {
        **{k: v for k, v in os.environ.items() if k != "VERL_PLATFORM"},  # the test platform is this process's
        "DRY_RUN": "1",
        "PYTHON": sys.executable,
        "MODEL_PATH": str(script.parent / "models" / model),
        "DATA_DIR": str(cwd),
        **env,
    }
    return subprocess.run(  # in cwd: hydra writes its outputs/ folder into the working directory
        ["bash", str(script)], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=HANG_GUARD_S
    )


@pytest.mark.slow
@pytest.mark.parametrize("script", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipe_dry_run_through_the_entrypoint(script, tmp_path):
    """``DRY_RUN=1 bash recipes/<model>_<dataset>.sh`` as a user runs it: the real ``python -m jetrl.verl``
    composes, validates (verl's validate_config, the jetrl section, the model's shapes from
    recipes/models/<model>/config.json, the GPU layout and the rollout TP split) and exits 0 without Ray or a
    GPU."""
    proc = _dry_run(script, tmp_path)
    assert proc.returncode == 0, f"{script.name}: exit {proc.returncode}\n{proc.stderr[-3000:]}"
    assert proc.stdout.strip().splitlines()[-1].startswith("jetrl.verl dry run: configuration valid"), proc.stdout[
        -500:
    ]


@pytest.mark.slow
def test_recipe_dry_run_checks_ngpus_and_rollout_tp(tmp_path):
    """The recipes' NGPUS / NNODES / ROLLOUT_TP reach the entrypoint's checks: Qwen2.5-7B's 28 heads do not
    split over TP 8, and 6 GPUs do not hold TP-4 replicas; Llama-3.1-8B at TP 8 on 2 nodes of 8 does."""
    by_name = {p.stem: p for p in RECIPES}
    proc = _dry_run(by_name["qwen2.5-7b_gsm8k"], tmp_path, ROLLOUT_TP="8")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "tensor_model_parallel_size=8" in proc.stderr and "num_attention_heads=28" in proc.stderr, proc.stderr
    proc = _dry_run(by_name["llama3.1-8b_math"], tmp_path, ROLLOUT_TP="4", NGPUS="6")
    assert proc.returncode == 2 and "trainer.n_gpus_per_node=6" in proc.stderr, proc.stderr[-3000:]
    proc = _dry_run(by_name["llama3.1-8b_math"], tmp_path, ROLLOUT_TP="8", NGPUS="8", NNODES="2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "configuration valid" in proc.stdout
