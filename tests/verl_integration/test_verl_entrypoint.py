"""``python -m jetrl.verl``: verl 0.9.1's real ppo_trainer schema plus the jetrl section, recipe application,
verl's own batch checks, the model-shape check, the lint gate and the dry run."""

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

verl = pytest.importorskip(
    "verl", reason="verl 0.9.1 is installed by `make venv` (third_party/verl-cpu-requirements.txt)"
)

from jetrl.testing.subprocess_guard import HANG_GUARD_S  # noqa: E402
from jetrl.tiny import save_tiny_checkpoint  # noqa: E402
from jetrl.verl.launch import (  # noqa: E402
    ConfigError,
    apply_recipe,
    check_model_shapes,
    check_parallelism,
    compose,
    lint_gate,
    validate,
)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "seed0", seed=0)


def _base(ckpt) -> list[str]:
    return [
        f"actor_rollout_ref.model.path={ckpt}",
        "data.train_files=/nonexistent/train.parquet",
        "data.val_files=/nonexistent/test.parquet",
        "algorithm.adv_estimator=grpo",
        "trainer.n_gpus_per_node=1",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",  # one GPU holds one TP-1 rollout replica
        "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.name=vllm",
        # no flash-attn here (README "verl")
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "actor_rollout_ref.model.use_remove_padding=false",
    ]


def test_jetrl_unified_selects_jetrls_engine_and_rollout(ckpt):
    cfg = compose(_base(ckpt))
    assert cfg.jetrl.recipe == "jetrl-unified" and cfg.jetrl.lint and not cfg.jetrl.dry_run
    changed = validate(cfg)
    env = cfg.ray_kwargs.ray_init.runtime_env.env_vars
    assert env.VERL_ENGINE_VENDOR == "jetrl" and env.JETRL_RECIPE == "jetrl-unified"
    assert env.VERL_USE_EXTERNAL_MODULES == "jetrl.verl.plugin"
    assert cfg.actor_rollout_ref.rollout.name == "jetrl_vllm"
    assert cfg.actor_rollout_ref.model.external_lib == "jetrl.verl.plugin"
    assert cfg.actor_rollout_ref.rollout.quantization is None
    # verl's FSDP2 engine (verl's own default strategy, fsdp, is FSDP1), for the ref too
    assert cfg.actor_rollout_ref.actor.strategy == cfg.actor_rollout_ref.ref.strategy == "fsdp2"
    assert changed["actor_rollout_ref.rollout.name"] == "jetrl_vllm"
    # auto: the actor's ops in the engine (jetrl.rollout.vllm_model) for jetrl-unified
    assert cfg.jetrl.engine_ops == "hf" and env.JETRL_ENGINE_OPS == "hf" and changed["jetrl.engine_ops"] == "hf"
    cfg = compose(_base(ckpt) + ["jetrl.engine_ops=vllm"])
    validate(cfg)
    assert cfg.ray_kwargs.ray_init.runtime_env.env_vars.JETRL_ENGINE_OPS == "vllm"
    # fused: every worker (the actor fuses its producers, jetrl.verl.engine; the rollout runs the fused engine)
    cfg = compose(_base(ckpt) + ["jetrl.engine_ops=fused"])
    validate(cfg)
    assert cfg.ray_kwargs.ray_init.runtime_env.env_vars.JETRL_ENGINE_OPS == "fused"


def test_engine_ops_auto_refuses_an_architecture_without_a_matched_engine(ckpt, tmp_path):
    import json
    import shutil

    other = tmp_path / "other"
    shutil.copytree(ckpt, other)
    meta = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**meta, "architectures": ["MistralForCausalLM"]}))
    args = [a for a in _base(ckpt) if not a.startswith("actor_rollout_ref.model.path=")]
    with pytest.raises(ConfigError, match=r"jetrl\.engine_ops=auto: .*MistralForCausalLM.*set jetrl\.engine_ops=vllm"):
        validate(compose(args + [f"actor_rollout_ref.model.path={other}"]))
    cfg = compose(args + [f"actor_rollout_ref.model.path={other}", "jetrl.engine_ops=vllm"])
    validate(cfg)
    assert cfg.jetrl.engine_ops == "vllm"


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (["jetrl.engine_ops=fast"], r"jetrl\.engine_ops='fast': choose one of \('auto', 'vllm', 'hf', 'fused'\)"),
        (["jetrl.engine_ops=hf", "jetrl.recipe=bf16"], r"jetrl\.engine_ops='hf' needs jetrl\.recipe=jetrl-unified"),
        (["jetrl.engine_ops=fused", "jetrl.recipe=bf16"], r"engine_ops='fused' needs jetrl\.recipe=jetrl-unified"),
    ],
)
def test_engine_ops_are_validated_naming_the_key(ckpt, extra, named):
    with pytest.raises(ConfigError, match=named):
        validate(compose(_base(ckpt) + extra))


def test_strict_numerics_set_the_batch_invariant_engine_and_raw_log_probs(ckpt):
    from jetrl.rollout.adapter import STRICT_ENV

    cfg = compose(_base(ckpt) + ["jetrl.numerics=strict"])
    changed = validate(cfg)
    env = cfg.ray_kwargs.ray_init.runtime_env.env_vars
    assert env.JETRL_NUMERICS == "strict" and {k: env[k] for k in STRICT_ENV} == STRICT_ENV  # every worker
    rollout = cfg.actor_rollout_ref.rollout
    assert dict(rollout.engine_kwargs.vllm) == {"attention_backend": "FLASH_ATTN", "block_size": 16}
    assert rollout.logprobs_mode == "raw_logprobs"
    assert changed["actor_rollout_ref.rollout.engine_kwargs.vllm.block_size"] == "16"
    assert changed["ray_kwargs.ray_init.runtime_env.env_vars.VLLM_BATCH_INVARIANT"] == "1"
    cfg = compose(_base(ckpt))
    validate(cfg)
    assert cfg.ray_kwargs.ray_init.runtime_env.env_vars.JETRL_NUMERICS == "hf"
    assert "VLLM_BATCH_INVARIANT" not in cfg.ray_kwargs.ray_init.runtime_env.env_vars
    assert cfg.actor_rollout_ref.rollout.logprobs_mode == "processed_logprobs"  # verl's default kept


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (["jetrl.numerics=bitwise"], r"jetrl\.numerics='bitwise': choose 'hf' or 'strict'"),
        (["jetrl.recipe=bf16"], r"jetrl\.numerics=strict needs jetrl\.recipe=jetrl-unified.*recipe=bf16"),
        (["jetrl.engine_ops=vllm"], r"needs jetrl\.recipe=jetrl-unified with jetrl\.engine_ops=hf.*engine_ops=vllm"),
        (["jetrl.engine_ops=fused"], r"needs jetrl\.recipe=jetrl-unified with jetrl\.engine_ops=hf.*engine_ops=fused"),
        (["actor_rollout_ref.model.use_remove_padding=true"], r"model\.use_remove_padding=True: .*needs False"),
        (["actor_rollout_ref.model.use_fused_kernels=true"], r"model\.use_fused_kernels=True"),
        (["actor_rollout_ref.rollout.temperature=0.7"], r"rollout\.temperature=0\.7: .*needs 1\.0"),
        (["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"], r"actor\.ulysses_sequence_parallel_size=2"),
        (
            ["+actor_rollout_ref.ref.fsdp_config.mixed_precision.param_dtype=fp32"],
            r"ref\.fsdp_config\.mixed_precision\.param_dtype='fp32': .*needs 'bfloat16'",
        ),
        (["actor_rollout_ref.rollout.logprobs_mode=raw_logits"], r"rollout\.logprobs_mode='raw_logits'"),
        (
            ["+actor_rollout_ref.rollout.engine_kwargs.vllm.attention_backend=TRITON_ATTN"],
            r"engine_kwargs\.vllm\.attention_backend='TRITON_ATTN': .*'FLASH_ATTN'",
        ),
        (
            ["+ray_kwargs.ray_init.runtime_env.env_vars.VLLM_BATCH_INVARIANT='0'"],
            r"env_vars\.VLLM_BATCH_INVARIANT='0': jetrl-unified with jetrl\.numerics=strict needs '1'",
        ),
    ],
)
def test_strict_numerics_refuse_what_keeps_the_log_probs_apart_naming_the_key(ckpt, extra, named):
    overrides = [o for o in _base(ckpt) if not o.startswith("actor_rollout_ref.model.use_remove_padding")]
    if not any("use_remove_padding" in e for e in extra):
        overrides.append("actor_rollout_ref.model.use_remove_padding=false")
    strict = [] if extra[0].startswith("jetrl.numerics=") else ["jetrl.numerics=strict"]
    with pytest.raises(ConfigError, match=named):
        validate(compose(overrides + strict + extra))


@pytest.mark.parametrize(("recipe", "quantization"), [("naive-fp8-rollout", "fp8"), ("bf16", None)])
def test_baselines_are_stock_verl(ckpt, recipe, quantization):
    cfg = compose(_base(ckpt) + [f"jetrl.recipe={recipe}"])
    validate(cfg)
    assert cfg.actor_rollout_ref.rollout.name == "vllm" and cfg.jetrl.engine_ops == "vllm"  # auto: verl's own
    assert cfg.actor_rollout_ref.rollout.quantization == quantization
    assert "VERL_ENGINE_VENDOR" not in (cfg.ray_kwargs.ray_init.runtime_env.get("env_vars") or {})
    assert cfg.actor_rollout_ref.model.external_lib is None


@pytest.mark.parametrize("key", ["actor_rollout_ref.actor.no_such_option", "jetrl.no_such_option"])
def test_an_unknown_key_fails_naming_it(ckpt, key):
    with pytest.raises(Exception, match=key.rsplit(".", 1)[-1]):
        compose(_base(ckpt) + [f"{key}=1"])


def test_the_recipe_key_is_validated(ckpt):
    with pytest.raises(ConfigError, match=r"jetrl\.recipe='fp4'.*jetrl-unified"):
        validate(compose(_base(ckpt) + ["jetrl.recipe=fp4"]))


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("actor_rollout_ref.rollout.quantization=fp8", r"actor_rollout_ref\.rollout\.quantization='fp8'"),
        ("actor_rollout_ref.rollout.name=sglang", r"actor_rollout_ref\.rollout\.name='sglang'"),
        ("actor_rollout_ref.actor.strategy=fsdp", r"actor_rollout_ref\.actor\.strategy='fsdp': .*FSDP2 engine"),
        ("actor_rollout_ref.ref.strategy=fsdp", r"actor_rollout_ref\.ref\.strategy='fsdp': .*FSDP2 engine"),
        ("actor_rollout_ref.model.lora_rank=8", r"actor_rollout_ref\.model\.lora_rank=8: .*LoRA is not supported"),
    ],
)
def test_settings_contradicting_the_recipe_are_named(ckpt, override, named):
    with pytest.raises(ConfigError, match=named):
        validate(compose(_base(ckpt) + [override]))


def test_verls_own_batch_checks_run(ckpt):
    # 4 prompts x 2 samples = 8 sequences over 3 GPUs: verl's validate_config refuses
    with pytest.raises(AssertionError, match=r"real_train_batch_size \(8\) must be divisible"):
        validate(compose(_base(ckpt) + ["trainer.n_gpus_per_node=3"]))


def _dapo(max_resp_len: int, buffer: int, response_len: int = 256) -> list[str]:
    return [
        f"data.max_response_length={response_len}",
        f"+reward.reward_kwargs.max_resp_len={max_resp_len}",
        "+reward.reward_kwargs.overlong_buffer_cfg.enable=True",
        f"+reward.reward_kwargs.overlong_buffer_cfg.len={buffer}",
    ]


@pytest.mark.parametrize(
    ("max_resp_len", "buffer", "named"),
    [
        (256, 4096, r"overlong_buffer_cfg\.len=4096: .*data\.max_response_length=256"),
        (256, 256, r"overlong_buffer_cfg\.len=256"),
        (8192, 64, r"max_resp_len=8192: .*data\.max_response_length=256"),
    ],
)
def test_dapos_overlong_buffer_must_fit_the_response_length(ckpt, max_resp_len, buffer, named):
    with pytest.raises(ConfigError, match=named):
        validate(compose(_base(ckpt) + _dapo(max_resp_len, buffer)))
    validate(compose(_base(ckpt) + _dapo(256, 64)))


def test_model_shapes_are_checked_against_128x128(ckpt, tmp_path):
    cfg = compose(_base(ckpt))
    dims = check_model_shapes(cfg)
    assert dims["hidden_size"] == 256 and all(v % 128 == 0 for v in dims.values())
    hf = json.loads((ckpt / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, "intermediate_size": 200}))
    cfg.actor_rollout_ref.model.path = str(tmp_path)
    with pytest.raises(ConfigError, match=r"intermediate_size': 200"):
        check_model_shapes(cfg)
    cfg.actor_rollout_ref.model.path = str(tmp_path / "absent")
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.model\.path=.*no config\.json"):
        check_model_shapes(cfg)
    cfg.jetrl.recipe = "bf16"  # BF16 training has no block constraint
    assert check_model_shapes(cfg) == {}


MODELS = Path(__file__).parents[2] / "recipes" / "models"
# per-rank (q heads x head_dim, kv heads x head_dim, intermediate) of the shipped models; None: refused, naming
TP_CASES = {
    ("llama3.1-8b", 2): (2048, 512, 7168),
    ("llama3.1-8b", 4): (1024, 256, 3584),
    ("llama3.1-8b", 8): (512, 128, 1792),
    ("qwen3-8b-base", 8): (512, 128, 1536),
    ("qwen2.5-7b", 4): (896, 128, 4736),
    ("qwen2.5-7b", 8): None,  # 28 heads; 4 kv heads; 18944 / 8 = 2368 rows
}


def _parallel(model_path, tp: int, *extra: str, gpus: int = 8):
    return compose(
        _base(model_path)
        + [f"trainer.n_gpus_per_node={gpus}", f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}", *extra]
    )


@pytest.mark.parametrize(("model", "tp"), list(TP_CASES), ids=[f"{m}-tp{t}" for m, t in TP_CASES])
def test_rollout_tp_splits_the_shipped_models_on_128_rows(model, tp):
    cfg = _parallel(MODELS / model, tp)
    want = TP_CASES[(model, tp)]
    if want is None:
        with pytest.raises(ConfigError, match=r"tensor_model_parallel_size=8 .*num_attention_heads=28 does not split"):
            check_parallelism(cfg)
        return
    assert tuple(check_parallelism(cfg).values()) == want
    assert all(v % 128 == 0 for v in want)


def test_a_tp_that_cuts_fp8_blocks_is_refused_naming_the_dim(tmp_path):
    # Llama-2-7B's intermediate size: 11008 = 86 x 128 rows, 2752 per rank at TP 4 -- not a multiple of 128
    hf = json.loads((MODELS / "llama3.1-8b" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, "intermediate_size": 11008}))
    assert check_parallelism(_parallel(tmp_path, 2))["intermediate_size (gate_proj/up_proj N, down_proj K)"] == 5504
    with pytest.raises(
        ConfigError,
        match=r"tensor_model_parallel_size=4 .*intermediate_size \(gate_proj/up_proj N, down_proj K\)=11008",
    ):
        check_parallelism(_parallel(tmp_path, 4))
    # verl's own block-FP8 rollout of the naive baseline has the same constraint; BF16 has none
    with pytest.raises(ConfigError, match=r"jetrl.recipe=naive-fp8-rollout .*2752 rows per rank, not a multiple"):
        check_parallelism(_parallel(tmp_path, 4, "jetrl.recipe=naive-fp8-rollout"))
    assert check_parallelism(_parallel(tmp_path, 4, "jetrl.recipe=bf16")) == {}
    (tmp_path / "config.json").write_text(json.dumps({**hf, "num_key_value_heads": 2}))
    with pytest.raises(ConfigError, match=r"num_key_value_heads=2 does not split over tensor-parallel size 4"):
        check_parallelism(_parallel(tmp_path, 4))


@pytest.mark.parametrize(
    ("extra", "gpus", "named"),
    [
        ((), 6, r"tensor_model_parallel_size=4 .* = 4 GPUs per rollout replica: trainer.n_gpus_per_node=6"),
        (("trainer.nnodes=2",), 4, None),  # TP 4 replicas on 2 nodes of 4 GPUs
        (("actor_rollout_ref.rollout.tensor_model_parallel_size=8", "trainer.nnodes=2"), 6, r"span whole nodes"),
        (("actor_rollout_ref.actor.fsdp_config.fsdp_size=3",), 8, r"actor\.fsdp_config\.fsdp_size=3: must be -1"),
        (("actor_rollout_ref.ref.ulysses_sequence_parallel_size=3",), 8, r"ref\.ulysses_sequence_parallel_size=3"),
    ],
)
def test_the_gpu_layout_is_checked_naming_the_key(extra, gpus, named):
    cfg = _parallel(MODELS / "llama3.1-8b", 4, *extra, gpus=gpus)
    if named is None:
        assert check_parallelism(cfg)
    else:
        with pytest.raises(ConfigError, match=named):
            check_parallelism(cfg)


def test_per_shard_export_needs_fsdp_shards_on_128_rows(monkeypatch):
    monkeypatch.setenv("JETRL_FP8_EXPORT", "shard")
    cfg = _parallel(MODELS / "llama3.1-8b", 2)  # 8 GPUs: every N / 8 is whole 128-row blocks
    check_parallelism(cfg)
    apply_recipe(cfg)
    assert cfg.ray_kwargs.ray_init.runtime_env.env_vars.JETRL_FP8_EXPORT == "shard"  # reaches the workers
    with pytest.raises(ConfigError, match=r"JETRL_FP8_EXPORT=shard: num_key_value_heads\*head_dim .*=1024 in FSDP "):
        check_parallelism(_parallel(MODELS / "llama3.1-8b", 2, "trainer.nnodes=2"))  # 1024 / 16 = 64 rows
    monkeypatch.delenv("JETRL_FP8_EXPORT")
    check_parallelism(_parallel(MODELS / "llama3.1-8b", 2, "trainer.nnodes=2"))  # gather after all: no constraint


@pytest.mark.parametrize(
    ("key", "value", "named"),
    [
        ("JETRL_GEMM_BACKEND", "cutlass", r"JETRL_GEMM_BACKEND='cutlass': choose one of \(.*'deepgemm'"),
        ("JETRL_FP8_EXPORT", "shards", r"JETRL_FP8_EXPORT='shards': choose one of \('gather', 'shard'\)"),
    ],
)
def test_the_workers_jetrl_variables_are_checked_before_ray(ckpt, monkeypatch, key, value, named):
    monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError, match=named):
        apply_recipe(compose(_base(ckpt)))
    monkeypatch.setenv("JETRL_GEMM_BACKEND", "emulated")
    monkeypatch.delenv("JETRL_FP8_EXPORT", raising=False)
    cfg = compose(_base(ckpt))
    apply_recipe(cfg)
    assert cfg.ray_kwargs.ray_init.runtime_env.env_vars.JETRL_GEMM_BACKEND == "emulated"  # reaches the workers


def test_the_lint_refuses_the_off_policy_baseline_unless_told(ckpt, capsys):
    cfg = compose(_base(ckpt) + ["jetrl.recipe=naive-fp8-rollout"])
    validate(cfg)
    assert lint_gate(cfg) == 1
    out = capsys.readouterr()
    assert "quantized-one-side" in out.out and "refusing to train" in out.err
    cfg.jetrl.proceed_on_lint_violation = True
    assert lint_gate(cfg) == 0
    bf16 = compose(_base(ckpt) + ["jetrl.recipe=bf16"])
    validate(bf16)
    assert lint_gate(bf16) == 0


@pytest.mark.parametrize(("workers_env", "deep_gemm"), [([], True), (["VLLM_USE_DEEP_GEMM='0'"], False)])
def test_the_baseline_lint_sees_the_workers_environment(ckpt, monkeypatch, workers_env, deep_gemm):
    import jetrl.lint

    seen = {}

    def fake_lint(path, recipe, **kw):
        seen.update(kw)
        return types.SimpleNamespace(ok=True, table=lambda: "")

    monkeypatch.setattr(jetrl.lint, "lint", fake_lint)
    monkeypatch.delenv("VLLM_USE_DEEP_GEMM", raising=False)
    ray_env = [f"++ray_kwargs.ray_init.runtime_env.env_vars.{v}" for v in workers_env]
    cfg = compose(_base(ckpt) + ["jetrl.recipe=naive-fp8-rollout", *ray_env])
    validate(cfg)
    assert lint_gate(cfg) == 0
    stock = seen["stock"]
    assert stock.use_deep_gemm is deep_gemm and stock.block_quant and stock.pow2 is deep_gemm
    assert stock.origins["use_deep_gemm"] == f"env:VLLM_USE_DEEP_GEMM={int(deep_gemm)}" + (
        "" if workers_env else " (default)"
    )


@pytest.mark.parametrize("eager", [True, False])
def test_the_unified_lint_starts_its_engine_as_the_rollout_will_run(ckpt, monkeypatch, eager):
    import jetrl.lint

    seen = {}

    def fake_lint(path, recipe, **kw):
        seen.update(kw, path=path, recipe=recipe.name)
        return types.SimpleNamespace(ok=True, table=lambda: "CONSISTENT")

    monkeypatch.setattr(jetrl.lint, "lint", fake_lint)
    cfg = compose(_base(ckpt) + [f"actor_rollout_ref.rollout.enforce_eager={eager}"])
    validate(cfg)
    assert lint_gate(cfg) == 0
    assert seen == {
        "path": str(ckpt),
        "recipe": "jetrl-unified",
        "rollout": "jetrl-vllm",
        "engine_kwargs": {"enforce_eager": eager, "engine_ops": "hf"},
    }


@pytest.mark.vllm
def test_the_unified_lint_passes_with_the_fused_engine(ckpt, capsys):
    """jetrl.engine_ops=fused: the gate's live engine runs the fused producers (the actor fuses its own, the lint's
    trainer side does not: fused norm/SwiGLU + quantize is the same precision flow) and the lint passes."""
    cfg = compose(_base(ckpt) + ["jetrl.engine_ops=fused", "actor_rollout_ref.rollout.enforce_eager=true"])
    validate(cfg)
    assert lint_gate(cfg) == 0, capsys.readouterr().out[-3000:]


def _entrypoint(args, cwd):
    # a plain process: without the tests' CPU platform (verl falls back to its CUDA platform, as a user's would)
    env = {k: v for k, v in os.environ.items() if k != "VERL_PLATFORM"}
    return subprocess.run(
        [sys.executable, "-m", "jetrl.verl", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )


def test_dry_run_prints_the_config_and_exits_0_without_ray(ckpt, tmp_path):
    res = _entrypoint(_base(ckpt) + ["jetrl.dry_run=true"], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "configuration valid" in res.stdout and "name: jetrl_vllm" in res.stdout
    assert "ray init kwargs" not in res.stdout  # verl's run_ppo never started


def test_entrypoint_exits_nonzero_naming_a_bad_key(ckpt, tmp_path):
    res = _entrypoint(_base(ckpt) + ["jetrl.dry_run=true", "trainer.no_such_option=1"], tmp_path)
    assert res.returncode != 0
    assert "no_such_option" in res.stderr, res.stderr[-3000:]
    res = _entrypoint(_base(ckpt) + ["jetrl.dry_run=true", "jetrl.recipe=fp4"], tmp_path)
    assert res.returncode == 2 and "jetrl.recipe='fp4'" in res.stderr, res.stderr[-3000:]
