"""What ``python -m jetrl.verl`` does with a composed config: validate, apply the recipe, lint, run.

The config is verl 0.9.1's ``ppo_trainer`` (hydra, struct mode: an override of a key verl does not
have fails naming the key) plus the ``jetrl:`` section of ``config/jetrl_ppo_trainer.yaml``. The one
key a user sets is ``jetrl.recipe``; `apply_recipe` turns it into verl settings:

- ``jetrl-unified``: the actor / ref engines become `jetrl.verl.engine.JetrlFSDPEngine` (the workers'
  Ray runtime env gets ``VERL_ENGINE_VENDOR=jetrl`` and ``JETRL_RECIPE``), the rollout becomes
  ``rollout.name=jetrl_vllm`` (jetrl's vLLM method and worker extension, `jetrl.verl.worker`), and
  `jetrl.verl.plugin` is imported by verl in every process (``model.external_lib`` and
  ``VERL_USE_EXTERNAL_MODULES``). ``rollout.quantization`` must stay null (verl's re-quantization).
- ``naive-fp8-rollout``: stock verl with its own FP8 rollout, ``rollout.quantization=fp8`` (BF16 sent,
  re-quantized by verl in vLLM at every sync): the off-policy baseline.
- ``bf16``: stock verl, BF16 everywhere.

``jetrl.numerics=strict`` (jetrl-unified with ``engine_ops`` hf) adds `jetrl.verl.engine`'s strict actor: vLLM's
batch-invariant environment for every worker, the rollout's FLASH_ATTN with 16-token blocks and raw log-probs
(`_apply_strict`, which first refuses, naming the key, what keeps the two sides' log-probs apart).

`validate` runs verl's own ``validate_config`` (batch sizes divide, micro-batch settings), checks the
``jetrl:`` section, and, for FP8 training, that every projection of the model at
``actor_rollout_ref.model.path`` (its config.json) suits the 128x128 recipe; then `check_parallelism`: the
GPU counts (``trainer.n_gpus_per_node`` x ``trainer.nnodes``) hold whole rollout replicas (TP x DP x PP) and
whole FSDP / Ulysses groups, and, for the FP8 recipes, rollout TP x 128 divides every TP-split dimension
(`jetrl.rollout.tp.tp_dims`: q and kv heads x head_dim, the intermediate size), so no rank's slice cuts a
128x128 weight block; and `check_reward`: DAPO's overlong buffer fits the response length. All of it runs
before Ray starts. A dry run stops there and prints the config.
Otherwise `lint_gate` runs ``jetrl lint`` for the recipe and refuses to start on a violation unless
``jetrl.proceed_on_lint_violation=true``; then verl's ``run_ppo`` starts Ray with
`jetrl.verl.trainer.JetrlTaskRunner` (verl's V1 task runner adding jetrl's per-step metrics; so
``trainer.use_v1=false`` and ``rollout.calculate_log_probs=false`` are refused, naming the key).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from jetrl.recipe import BLOCK, RECIPE_NAMES, Recipe

__all__ = [
    "CONFIG_DIR",
    "CONFIG_NAME",
    "COLOCATED_TRAINER_MODES",
    "JETRL_KEYS",
    "PLUGIN_MODULE",
    "ConfigError",
    "apply_recipe",
    "check_model_shapes",
    "check_parallelism",
    "check_reward",
    "compose",
    "lint_gate",
    "main",
    "validate",
]

CONFIG_DIR = Path(__file__).parent / "config"
CONFIG_NAME = "jetrl_ppo_trainer"
JETRL_KEYS = ("recipe", "engine_ops", "numerics", "dry_run", "lint", "proceed_on_lint_violation")
ENGINE_OPS = ("auto", "vllm", "hf", "fused")
"""``jetrl.engine_ops``: what the rollout computes between the Linears (`jetrl.rollout.vllm_model`); ``fused`` also
makes the actor fuse its producers (`jetrl.verl.engine`), so both sides run the same kernels."""
PLUGIN_MODULE = "jetrl.verl.plugin"
COLOCATED_TRAINER_MODES = ("sync", "colocate_async")
"""verl 0.9.1 V1 trainer modes whose weight sync is the colocated one jetrl's worker extension receives."""
VERL_FP8_ROLLOUT_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
"""The vLLM quantization_config verl 0.9.1 starts its FP8 rollout with (``vLLMHttpServer._apply_quantization``,
``rollout.quantization=fp8``); verl then re-quantizes the BF16 weights it receives at every sync."""


class ConfigError(ValueError):
    """The configuration cannot run with jetrl (the message names the key)."""


def compose(overrides: list[str] | None = None) -> DictConfig:
    """The config ``python -m jetrl.verl OVERRIDES...`` runs with (hydra's compose API, same files)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return hydra_compose(config_name=CONFIG_NAME, overrides=list(overrides or []))


def _recipe(cfg: DictConfig) -> Recipe:
    j = cfg.get("jetrl")
    if j is None:
        raise ConfigError(
            "the config has no `jetrl:` section (compose it from jetrl/verl/config/jetrl_ppo_trainer.yaml)"
        )
    unknown = sorted(set(j.keys()) - set(JETRL_KEYS))
    if unknown:
        raise ConfigError(f"unknown key(s) jetrl.{', jetrl.'.join(unknown)}; the jetrl section has {list(JETRL_KEYS)}")
    if j.recipe not in RECIPE_NAMES:
        raise ConfigError(f"jetrl.recipe={j.recipe!r}: choose one of {list(RECIPE_NAMES)}")
    return Recipe.from_name(j.recipe)


def _env_vars(cfg: DictConfig) -> DictConfig:
    with open_dict(cfg):
        ray_init = cfg.ray_kwargs.setdefault("ray_init", {})
        runtime_env = ray_init.get("runtime_env")
        if runtime_env is None:
            ray_init.runtime_env = {}
        with open_dict(ray_init.runtime_env):
            ray_init.runtime_env.setdefault("env_vars", {})
    return cfg.ray_kwargs.ray_init.runtime_env.env_vars


def apply_recipe(cfg: DictConfig) -> dict[str, str]:
    """Set the verl keys the recipe needs (see the module docstring); returns {key: value} of what it set.
    Refuses (`ConfigError` naming the key) settings that contradict the recipe."""
    recipe = _recipe(cfg)
    arr = cfg.actor_rollout_ref
    rollout = arr.rollout
    changed: dict[str, str] = {}
    if not cfg.trainer.use_v1:
        raise ConfigError(
            "trainer.use_v1=false: python -m jetrl.verl runs verl's V1 trainer (jetrl.verl.trainer adds jetrl's "
            "per-step metrics there); verl's legacy trainer is python -m verl.trainer.main_ppo"
        )
    if not rollout.calculate_log_probs:
        raise ConfigError(
            "actor_rollout_ref.rollout.calculate_log_probs=false: jetrl's per-step mismatch metrics compare vLLM's "
            "rollout log-probs with the trainer's old_log_probs (every jetrl recipe logs them; leave it true)"
        )
    if recipe.name == "naive-fp8-rollout":
        if rollout.quantization not in (None, "fp8"):
            raise ConfigError(
                f"actor_rollout_ref.rollout.quantization={rollout.quantization!r}: jetrl.recipe=naive-fp8-rollout "
                "is verl's own FP8 rollout (quantization=fp8)"
            )
        rollout.quantization = "fp8"
        changed["actor_rollout_ref.rollout.quantization"] = "fp8"
    elif rollout.quantization is not None:
        raise ConfigError(
            f"actor_rollout_ref.rollout.quantization={rollout.quantization!r} contradicts jetrl.recipe={recipe.name}: "
            "verl's FP8 rollout re-quantizes weights at every sync (that baseline is jetrl.recipe=naive-fp8-rollout)"
        )
    ops = cfg.jetrl.get("engine_ops") or "auto"
    if ops not in ENGINE_OPS:
        raise ConfigError(
            f"jetrl.engine_ops={ops!r}: choose one of {ENGINE_OPS} ('fused': the actor's norms and SwiGLU through "
            "jetrl's fused producer kernels, the rollout's the same, FP8 handed to the next Linear on both sides)"
        )
    if ops == "auto":
        ops = _auto_engine_ops(cfg, recipe.name)
        with open_dict(cfg.jetrl):
            cfg.jetrl.engine_ops = ops
        changed["jetrl.engine_ops"] = ops
    numerics = cfg.jetrl.get("numerics") or "hf"
    if numerics not in ("hf", "strict"):
        raise ConfigError(f"jetrl.numerics={numerics!r}: choose 'hf' or 'strict'")
    if numerics == "strict" and (recipe.name != "jetrl-unified" or ops != "hf"):
        raise ConfigError(
            f"jetrl.numerics=strict needs jetrl.recipe=jetrl-unified with jetrl.engine_ops=hf (jetrl's rollout running "
            f"the actor's norms, RoPE and SiLU-and-mul); this config: jetrl.recipe={recipe.name}, engine_ops={ops}"
        )
    if recipe.name != "jetrl-unified":
        if ops != "vllm":
            raise ConfigError(
                f"jetrl.engine_ops={ops!r} needs jetrl.recipe=jetrl-unified (jetrl's rollout); {recipe.name} rolls "
                "out with verl's own vLLM server"
            )
        return changed
    from jetrl.gemm import BACKEND_NAMES
    from jetrl.verl.engine import BACKEND_ENV, ENGINE_OPS_ENV, EXPORT_ENV, EXPORT_MODES, NUMERICS_ENV
    from jetrl.verl.worker import ROLLOUT_NAME

    if cfg.trainer.v1.trainer_mode not in COLOCATED_TRAINER_MODES:
        raise ConfigError(
            f"trainer.v1.trainer_mode={cfg.trainer.v1.trainer_mode!r}: jetrl-unified syncs the trainer's FP8 bytes "
            f"into colocated rollout workers (verl's in-process sync); use one of {list(COLOCATED_TRAINER_MODES)}"
        )
    lora_rank = arr.model.get("lora_rank") or 0
    if lora_rank > 0:
        raise ConfigError(
            f"actor_rollout_ref.model.lora_rank={lora_rank}: jetrl-unified's FP8 engine trains the full weights it "
            "syncs as FP8 bytes; LoRA is not supported (lora_rank=0, or jetrl.recipe=bf16 for verl's own LoRA)"
        )
    for role in ("actor", "ref"):
        strategy = arr[role].get("strategy")
        if strategy != "fsdp2":
            raise ConfigError(
                f"actor_rollout_ref.{role}.strategy={strategy!r}: jetrl's FP8 engine extends verl's FSDP2 engine "
                "(fsdp2, this config's default; verl's fsdp is FSDP1)"
            )
    name = None if OmegaConf.is_missing(rollout, "name") else rollout.name
    if name not in (None, "vllm", ROLLOUT_NAME):
        raise ConfigError(
            f"actor_rollout_ref.rollout.name={name!r}: jetrl-unified rolls out with vLLM (name=vllm, run as "
            f"{ROLLOUT_NAME})"
        )
    rollout.name = ROLLOUT_NAME
    changed["actor_rollout_ref.rollout.name"] = ROLLOUT_NAME
    libs = arr.model.external_lib
    libs = [] if libs is None else [libs] if isinstance(libs, str) else list(libs)
    if PLUGIN_MODULE not in libs:
        libs.append(PLUGIN_MODULE)
    arr.model.external_lib = libs[0] if len(libs) == 1 else libs
    changed["actor_rollout_ref.model.external_lib"] = str(arr.model.external_lib)
    env = _env_vars(cfg)
    modules = [m for m in str(env.get("VERL_USE_EXTERNAL_MODULES", "")).split(",") if m]
    wanted = {
        "VERL_ENGINE_VENDOR": "jetrl",
        "JETRL_RECIPE": recipe.name,
        "VERL_USE_EXTERNAL_MODULES": ",".join(modules + [PLUGIN_MODULE] if PLUGIN_MODULE not in modules else modules),
        ENGINE_OPS_ENV: ops,
        NUMERICS_ENV: numerics,
    }
    required = set(wanted) - {"VERL_USE_EXTERNAL_MODULES"}
    if numerics == "strict":
        strict_changed, strict_env = _apply_strict(cfg)
        changed |= strict_changed
        wanted |= strict_env  # every worker, from its start: the actor's and the engine's processes alike
        required |= set(strict_env)
    # jetrl.verl.engine reads these in the workers; checked here, not at the first sync after Ray has started
    backend, export = os.environ.get(BACKEND_ENV), os.environ.get(EXPORT_ENV)
    if backend and backend not in BACKEND_NAMES:
        raise ConfigError(f"{BACKEND_ENV}={backend!r}: choose one of {BACKEND_NAMES}")
    if export and export not in EXPORT_MODES:
        raise ConfigError(f"{EXPORT_ENV}={export!r}: choose one of {EXPORT_MODES}")
    for key, value in ((BACKEND_ENV, backend), (EXPORT_ENV, export)):
        if value:
            wanted[key] = value
    for k, v in wanted.items():
        if k in required and env.get(k) not in (None, v):
            raise ConfigError(
                f"ray_kwargs.ray_init.runtime_env.env_vars.{k}={env.get(k)!r}: jetrl-unified with "
                f"jetrl.numerics={numerics} needs {v!r}"
            )
        with open_dict(env):
            env[k] = v
        changed[f"ray_kwargs.ray_init.runtime_env.env_vars.{k}"] = v
    return changed


def _apply_strict(cfg: DictConfig) -> tuple[dict[str, str], dict[str, str]]:
    """``jetrl.numerics=strict`` (`jetrl.verl.engine`): refuse what keeps the actor's log-probs apart from the
    strict engine's, naming the key; set the engine's settings (`jetrl.rollout.adapter.strict_engine_settings`
    as ``rollout.engine_kwargs.vllm``, raw log-probs). Returns what it set and the strict environment, which
    every worker needs."""
    from jetrl.rollout.adapter import strict_engine_settings

    arr = cfg.actor_rollout_ref
    rollout = arr.rollout
    why = {
        "actor_rollout_ref.model.use_remove_padding": (
            arr.model.use_remove_padding,
            False,
            "the strict attention takes verl's right-padded batch; remove-padding packs the sequences",
        ),
        "actor_rollout_ref.model.use_fused_kernels": (
            arr.model.use_fused_kernels,
            False,
            "verl's fused kernels compute the log-probs without the logits the strict kernel reads",
        ),
        "actor_rollout_ref.rollout.temperature": (
            rollout.temperature,
            1.0,
            "the strict engine's raw log-probs equal the actor's at temperature 1 only",
        ),
        "actor_rollout_ref.rollout.dtype": (rollout.dtype, "bfloat16", "the strict kernels run on BF16"),
    }
    for role in ("actor", "ref"):
        why[f"actor_rollout_ref.{role}.ulysses_sequence_parallel_size"] = (
            arr[role].get("ulysses_sequence_parallel_size", 1) or 1,
            1,
            "sequence parallelism splits a sequence's attention",
        )
        mp = arr[role].fsdp_config.get("mixed_precision") or {}
        why[f"actor_rollout_ref.{role}.fsdp_config.mixed_precision.param_dtype"] = (
            "bfloat16" if mp.get("param_dtype", "bf16") in ("bf16", "bfloat16") else mp.get("param_dtype"),
            "bfloat16",
            "the actor's forward must run in BF16, as the engine does",
        )
    for key, (value, needed, reason) in why.items():
        if value != needed:
            raise ConfigError(f"{key}={value!r}: jetrl.numerics=strict needs {needed!r} ({reason})")
    changed: dict[str, str] = {}
    if rollout.logprobs_mode not in ("processed_logprobs", "raw_logprobs"):
        raise ConfigError(
            f"actor_rollout_ref.rollout.logprobs_mode={rollout.logprobs_mode!r}: jetrl.numerics=strict compares the "
            "engine's raw log-probs (raw_logprobs; at temperature 1 verl's default processed_logprobs is the same)"
        )
    rollout.logprobs_mode = "raw_logprobs"
    changed["actor_rollout_ref.rollout.logprobs_mode"] = "raw_logprobs"
    kwargs, strict_env = strict_engine_settings()
    with open_dict(rollout):
        if rollout.get("engine_kwargs") is None:
            rollout.engine_kwargs = {}
    with open_dict(rollout.engine_kwargs):
        if rollout.engine_kwargs.get("vllm") is None:
            rollout.engine_kwargs.vllm = {}
    vllm_kwargs = rollout.engine_kwargs.vllm
    for k, v in kwargs.items():
        if vllm_kwargs.get(k) not in (None, v):
            raise ConfigError(
                f"actor_rollout_ref.rollout.engine_kwargs.vllm.{k}={vllm_kwargs.get(k)!r}: jetrl.numerics=strict runs "
                f"the engine with {v!r} (the actor's attention pages its K/V the same way)"
            )
        with open_dict(vllm_kwargs):
            vllm_kwargs[k] = v
        changed[f"actor_rollout_ref.rollout.engine_kwargs.vllm.{k}"] = str(v)
    return changed, strict_env


def _auto_engine_ops(cfg: DictConfig, recipe: str) -> str:
    """``jetrl.engine_ops: auto``: the actor's ops in the engine ('hf') for jetrl-unified, whose rollout is
    jetrl's; 'vllm' for the baselines (verl's own vLLM server). A jetrl-unified model whose architecture
    has no trainer-matched engine model is refused, naming the way out, rather than rolled out otherwise."""
    if recipe != "jetrl-unified":
        return "vllm"
    from jetrl.rollout.vllm_model import engine_overrides

    cfg_file = Path(str(cfg.actor_rollout_ref.model.path)) / "config.json"
    if not cfg_file.is_file():  # check_model_shapes refuses a jetrl-unified model without one
        return "hf"
    try:
        engine_overrides(json.loads(cfg_file.read_text()).get("architectures"), "hf")
    except ValueError as e:
        raise ConfigError(f"jetrl.engine_ops=auto: {cfg_file}: {e}; set jetrl.engine_ops=vllm") from None
    return "hf"


def check_model_shapes(cfg: DictConfig) -> dict[str, int]:
    """For FP8-training recipes: every projection's N and K of the model at ``actor_rollout_ref.model.path``
    must be a multiple of 128. Returns the dims checked; `ConfigError` names the first misfit."""
    recipe = _recipe(cfg)
    path = Path(str(cfg.actor_rollout_ref.model.path))
    if not recipe.train_fp8:
        return {}
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ConfigError(
            f"actor_rollout_ref.model.path={str(path)!r}: no config.json there; jetrl.recipe={recipe.name} checks the "
            "model's Linear shapes against the 128x128 recipe before starting (download the model to a local dir)"
        )
    hf = _hf_config(cfg_file)
    try:
        head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
        dims = {
            "hidden_size": hf["hidden_size"],
            "intermediate_size": hf["intermediate_size"],
            "num_attention_heads*head_dim (q_proj N)": hf["num_attention_heads"] * head_dim,
            "num_key_value_heads*head_dim (k_proj/v_proj N)": hf.get("num_key_value_heads", hf["num_attention_heads"])
            * head_dim,
        }
    except KeyError as e:
        raise ConfigError(f"{cfg_file}: missing {e.args[0]!r}, needed to check the Linear shapes") from e
    bad = {k: v for k, v in dims.items() if v % BLOCK}
    if bad and not recipe.allow_bf16_fallback_shapes:
        raise ConfigError(
            f"{cfg_file}: {bad} not multiples of {BLOCK}; jetrl.recipe={recipe.name} quantizes weights in "
            f"{BLOCK}x{BLOCK} blocks (use jetrl.recipe=bf16 for this model)"
        )
    return dims


def _hf_config(cfg_file: Path) -> dict:
    hf = json.loads(cfg_file.read_text())
    return hf.get("text_config", hf)


def check_parallelism(cfg: DictConfig) -> dict[str, int]:
    """The GPU layout, before Ray starts: ``trainer.n_gpus_per_node * trainer.nnodes`` GPUs hold whole
    rollout replicas (TP x DP x PP; a replica larger than a node spans whole nodes) and whole FSDP
    (``fsdp_config.fsdp_size``) and Ulysses groups of the actor and the ref; for the FP8 recipes (jetrl's
    128x128 rollout, and verl's block-FP8 rollout of ``naive-fp8-rollout``) every TP-split dimension of the
    model at ``actor_rollout_ref.model.path`` splits into multiples of 128 per rank (`jetrl.rollout.tp.tp_dims`).
    Returns the per-rank dims checked (empty for ``bf16``); `ConfigError` names the key and the dimension."""
    from jetrl.rollout.tp import TPLayout, TPShapeError, tp_dims

    recipe = _recipe(cfg)
    arr, trainer = cfg.actor_rollout_ref, cfg.trainer
    gpus_key = f"trainer.n_gpus_per_node={trainer.n_gpus_per_node} x trainer.nnodes={trainer.nnodes}"
    n_gpus = trainer.n_gpus_per_node * trainer.nnodes
    if trainer.n_gpus_per_node < 1 or trainer.nnodes < 1:
        raise ConfigError(f"{gpus_key}: both must be >= 1")
    r = arr.rollout
    tp_key = f"actor_rollout_ref.rollout.tensor_model_parallel_size={r.tensor_model_parallel_size}"
    replica = r.tensor_model_parallel_size * r.data_parallel_size * r.pipeline_model_parallel_size
    if n_gpus % replica or (replica > trainer.n_gpus_per_node and replica % trainer.n_gpus_per_node):
        raise ConfigError(
            f"{tp_key} x data_parallel_size={r.data_parallel_size} x pipeline_model_parallel_size="
            f"{r.pipeline_model_parallel_size} = {replica} GPUs per rollout replica: {gpus_key} = {n_gpus} GPUs do "
            "not hold whole replicas (a replica larger than a node must span whole nodes)"
        )
    for role in ("actor", "ref"):
        fsdp_size = arr[role].fsdp_config.get("fsdp_size", -1)
        if fsdp_size not in (-1, None) and (fsdp_size < 1 or n_gpus % fsdp_size):
            raise ConfigError(
                f"actor_rollout_ref.{role}.fsdp_config.fsdp_size={fsdp_size}: must be -1 (all GPUs) or divide the "
                f"FSDP world of {gpus_key} = {n_gpus} GPUs"
            )
        sp = arr[role].get("ulysses_sequence_parallel_size", 1) or 1
        if n_gpus % sp:
            raise ConfigError(
                f"actor_rollout_ref.{role}.ulysses_sequence_parallel_size={sp}: does not divide {gpus_key} = {n_gpus}"
            )
    if recipe.name == "bf16":
        return {}
    cfg_file = Path(str(arr.model.path)) / "config.json"
    if not cfg_file.is_file():
        raise ConfigError(
            f"actor_rollout_ref.model.path={str(arr.model.path)!r}: no config.json there; jetrl.recipe={recipe.name} "
            f"checks the model's tensor-parallel split ({tp_key}) before starting (download the model to a local dir)"
        )
    try:
        layout = TPLayout.from_hf_config(_hf_config(cfg_file))
        dims = tp_dims(layout, r.tensor_model_parallel_size)
    except TPShapeError as e:
        raise ConfigError(f"{tp_key} with jetrl.recipe={recipe.name} ({cfg_file}): {e}") from e
    if recipe.weight_sync == "fp8-bytes" and os.environ.get("JETRL_FP8_EXPORT") == "shard":
        # jetrl.verl.engine.fp8_export_shards: FSDP2's Shard(0) chunks (torch.chunk) must be whole 128-row blocks
        fsdp_size = arr.actor.fsdp_config.get("fsdp_size", -1)
        world = n_gpus if fsdp_size in (-1, None) else fsdp_size
        n_dims = {**layout.full_dims(), "hidden_size (o_proj/down_proj N)": layout.hidden_size}
        for name, n in n_dims.items():
            if -(-n // world) % BLOCK:
                raise ConfigError(
                    f"JETRL_FP8_EXPORT=shard: {name}={n} in FSDP shards of {-(-n // world)} rows over {world} GPUs, "
                    f"not whole {BLOCK}-row blocks; unset it (the default export quantizes after the gather)"
                )
    return dims


def check_reward(cfg: DictConfig) -> None:
    """DAPO's overlong penalty (verl's ``dapo`` reward manager, ``reward.reward_kwargs``): the soft buffer
    sits inside the response length it penalises, and that length is the one the rollout generates
    (``data.max_response_length``). verl asserts the first only when its reward workers start on Ray, and never
    checks the second (a stale ``max_resp_len`` penalises the wrong tokens); `ConfigError` names the keys."""
    kwargs = (cfg.get("reward") or {}).get("reward_kwargs") or {}
    buf = kwargs.get("overlong_buffer_cfg") or {}
    if not buf.get("enable"):
        return
    max_resp, length = kwargs.get("max_resp_len"), cfg.data.max_response_length
    if max_resp != length:
        raise ConfigError(
            f"reward.reward_kwargs.max_resp_len={max_resp}: the overlong penalty must measure the response length the "
            f"rollout generates, data.max_response_length={length}"
        )
    if not 0 < buf.get("len", 0) < length:
        raise ConfigError(
            f"reward.reward_kwargs.overlong_buffer_cfg.len={buf.get('len')}: the overlong buffer must lie inside "
            f"data.max_response_length={length} (0 < len < {length}; the recipes' OVERLONG_BUFFER)"
        )


def validate(cfg: DictConfig) -> dict[str, str]:
    """`apply_recipe`, verl's ``validate_config``, `check_model_shapes`, `check_parallelism`, `check_reward`;
    returns what `apply_recipe` set."""
    from jetrl.verl.adapter import need_critic, need_reference_policy, validate_config

    changed = apply_recipe(cfg)
    validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    check_model_shapes(cfg)
    check_parallelism(cfg)
    check_reward(cfg)
    return changed


def lint_gate(cfg: DictConfig) -> int:
    """Run ``jetrl lint`` for the recipe on the model; 0 to proceed, 1 to refuse (the report is printed)."""
    from jetrl.lint import lint

    recipe = _recipe(cfg)
    path = str(cfg.actor_rollout_ref.model.path)
    if recipe.name == "jetrl-unified":  # a live engine with jetrl's method, as the rollout will run
        eager = bool(cfg.actor_rollout_ref.rollout.enforce_eager)  # eager or compiled + CUDA graphs, as verl's
        ops = cfg.jetrl.engine_ops  # resolved by apply_recipe
        report = lint(path, recipe, rollout="jetrl-vllm", engine_kwargs={"enforce_eager": eager, "engine_ops": ops})
    else:  # the baselines run stock vLLM: described from its settings, no engine is started
        from jetrl.lint.stock_vllm import StockVllmSettings

        qc = VERL_FP8_ROLLOUT_CONFIG if cfg.actor_rollout_ref.rollout.quantization == "fp8" else None
        # the environment vLLM's workers get: this process's, under the Ray runtime env's variables
        env = {**os.environ, **{k: str(v) for k, v in _env_vars(cfg).items()}}
        stock = StockVllmSettings.from_environment(path, env=env, quant_config=qc)
        report = lint(path, recipe, rollout="stock-vllm", stock=stock)
    print(report.table())
    if report.ok:
        return 0
    if cfg.jetrl.proceed_on_lint_violation:
        print("jetrl lint found violations; starting anyway (jetrl.proceed_on_lint_violation=true)", file=sys.stderr)
        return 0
    print(
        "jetrl lint found violations: refusing to train (set jetrl.proceed_on_lint_violation=true to start anyway)",
        file=sys.stderr,
    )
    return 1


def main(cfg: DictConfig) -> int:
    """The entrypoint's body (exit code): validate, dry-run print, lint, then verl's ``run_ppo``."""
    try:
        changed = validate(cfg)
    except (ConfigError, AssertionError, ValueError) as e:
        print(f"jetrl.verl: invalid configuration: {e}", file=sys.stderr)
        return 2
    if cfg.jetrl.dry_run:
        print(OmegaConf.to_yaml(cfg, resolve=False))
        print(f"jetrl.verl dry run: recipe {cfg.jetrl.recipe}; set by the recipe: {json.dumps(changed, indent=1)}")
        print(
            "jetrl.verl dry run: configuration valid (verl validate_config, jetrl section, model shapes, "
            "GPU layout and tensor-parallel split)"
        )
        return 0
    if cfg.jetrl.lint:
        code = lint_gate(cfg)
        if code:
            return code
    from jetrl.verl.adapter import run_ppo
    from jetrl.verl.trainer import JetrlTaskRunner

    run_ppo(cfg, task_runner_class=JetrlTaskRunner)
    return 0
