"""The verl recipe scripts without verl: bash-clean, env defaults, "$@" forwarded last, DRY_RUN and
RECIPE mapped onto the jetrl section, bad values refused, and the batch / parallelism arithmetic of
each recipe consistent with its model's shipped config.json."""

from __future__ import annotations

import subprocess

import pytest

from jetrl.lint.layout import ModelLayout, read_config
from jetrl.testing.recipes import RECIPES_DIR, overrides_dict, recipe_argv, verl_recipes

RECIPES = verl_recipes()
IDS = [p.stem for p in RECIPES]


def ov(script, *args, **env):
    rc, argv, err = recipe_argv(script, *args, env={k: str(v) for k, v in env.items()})
    assert rc == 0 and argv is not None, f"{script.name}: exit {rc}: {err}"
    return argv, overrides_dict(argv)


@pytest.mark.parametrize("path", [*RECIPES, RECIPES_DIR / "lib" / "verl_common.sh"], ids=[*IDS, "lib"])
def test_bash_n_clean(path):
    res = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    if path.parent == RECIPES_DIR:
        text = path.read_text()
        assert text.startswith("#!/usr/bin/env bash") and "set -euo pipefail" in text
        assert 'jetrl_verl_run "$@"' in text


@pytest.mark.parametrize("script", RECIPES, ids=IDS)
def test_defaults_forwarding_and_modes(script, tmp_path):
    model, dataset = script.stem.split("_", 1)
    argv, d = ov(script, "trainer.total_epochs=1", "trainer.experiment_name=a b", DATA_DIR=tmp_path)
    assert argv[-2:] == ["trainer.total_epochs=1", "trainer.experiment_name=a b"]  # "$@" last, words intact
    assert d["trainer.n_gpus_per_node"] == "8" and d["trainer.nnodes"] == "1"
    assert d["data.train_files"] == f"{tmp_path}/{dataset}/train.parquet"
    assert d["data.val_files"] == f"{tmp_path}/{dataset}/test.parquet"
    assert d["data.max_response_length"] == ("16384" if dataset == "deepmath" else "8192")
    assert d["jetrl.recipe"] == "jetrl-unified" and d["jetrl.dry_run"] == "false"
    assert "/" in d["actor_rollout_ref.model.path"]  # the HF id by default
    _, d = ov(script, DRY_RUN=1, RECIPE="naive-fp8-rollout", NGPUS=4, NNODES=2, RESPONSE_LEN=16384, MODEL_PATH="/m")
    assert d["jetrl.dry_run"] == "true" and d["jetrl.recipe"] == "naive-fp8-rollout"
    assert d["trainer.n_gpus_per_node"] == "4" and d["trainer.nnodes"] == "2"
    assert d["data.max_response_length"] == "16384" and d["actor_rollout_ref.model.path"] == "/m"
    assert ov(script, RECIPE="bf16")[1]["jetrl.recipe"] == "bf16"


@pytest.mark.parametrize("env, match", [({"RECIPE": "fp4"}, "RECIPE=fp4"), ({"DRY_RUN": "yes"}, "DRY_RUN=yes")])
def test_bad_mode_is_refused(env, match):
    rc, argv, err = recipe_argv(RECIPES[0], env=env)
    assert rc == 2 and argv is None and match in err


@pytest.mark.parametrize("script", RECIPES, ids=IDS)
def test_batch_and_parallel_arithmetic(script):
    model = script.stem.split("_", 1)[0]
    lay = ModelLayout.from_config(read_config(RECIPES_DIR / "models" / model))
    _, d = ov(script)
    n_gpus = int(d["trainer.n_gpus_per_node"]) * int(d["trainer.nnodes"])
    train, gen = int(d["data.train_batch_size"]), int(d["data.gen_batch_size"])
    mini, n = int(d["actor_rollout_ref.actor.ppo_mini_batch_size"]), int(d["actor_rollout_ref.rollout.n"])
    tp = int(d["actor_rollout_ref.rollout.tensor_model_parallel_size"])
    seq = int(d["data.max_prompt_length"]) + int(d["data.max_response_length"])
    assert train % mini == 0 and (mini * n) % n_gpus == 0, f"{train=} {mini=} {n=} {n_gpus=}"
    assert gen >= train and n >= 2  # GRPO needs groups
    assert n_gpus % tp == 0 and lay.num_heads % tp == 0 and lay.num_kv_heads % tp == 0, f"{tp=} {lay}"
    assert int(d["actor_rollout_ref.rollout.max_num_batched_tokens"]) >= seq
    assert int(d["actor_rollout_ref.actor.ppo_max_token_len_per_gpu"]) >= seq
    assert int(d["actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu"]) >= seq
    if "+reward.reward_kwargs.overlong_buffer_cfg.len" in d:
        assert int(d["+reward.reward_kwargs.overlong_buffer_cfg.len"]) < int(d["data.max_response_length"])
        assert d["+reward.reward_kwargs.max_resp_len"] == d["data.max_response_length"]
    assert (RECIPES_DIR.parent / "jetrl" / "tasks" / "reward.py").samefile(d["reward.custom_reward_function.path"])
