"""The trainer's configuration: frozen dataclasses loaded from YAML (or JSON), checked before any work.

A config file has one mapping per section (``run``, ``model``, ``task``, ``warmup``, ``rollout``,
``algo``, ``optim``, ``lint``); every key is a field below, documented by the docstring under it.
`load_config` rejects unknown keys (naming the dotted field and the closest valid one), wrong types
and inconsistent values; `jetrl.train.checks.check_environment` then rejects what the recipe or the
machine cannot run (shapes the FP8 GEMMs cannot take, a GEMM backend or device that is not there)
before a model is built. ``algo.name`` picks a preset (``grpo`` or ``dapo``) whose defaults the other
``algo`` keys override.

Command-line overrides use dotted keys: ``run.steps=5 algo.name=dapo``.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from jetrl.recipe import RECIPE_NAMES, Recipe

from .algo import KL_TYPES, LOSS_AGG_MODES

__all__ = [
    "ConfigError",
    "RunConfig",
    "ModelConfig",
    "TaskConfig",
    "WarmupConfig",
    "RolloutConfig",
    "AlgoConfig",
    "OptimConfig",
    "LintConfig",
    "TrainConfig",
    "load_config",
    "config_from_dict",
    "apply_overrides",
]


LOGGERS = {"tensorboard": "tensorboard", "wandb": "wandb"}
"""``run.loggers`` names -> the Python package each needs (`jetrl.train.loggers` opens them)."""
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "sdpa_causal")
"""``model.attn_implementation`` values (its docstring)."""


class ConfigError(ValueError):
    """A config value that cannot work; the message starts with the dotted field name."""


def _fail(path: str, msg: str) -> ConfigError:
    return ConfigError(f"{path}: {msg}")


@dataclass(frozen=True)
class RunConfig:
    name: str = "tiny-arith"
    """Run name: outputs go to ``<out_dir>/<name>/``."""
    out_dir: str = "runs"
    """Parent directory of run directories."""
    seed: int = 0
    """Seed of the model init, the data order and the rollout sampling (same seed = same data order)."""
    steps: int = 30
    """Number of RL steps."""
    recipe: str = "jetrl-unified"
    """Precision recipe (`jetrl.recipe.RECIPE_NAMES`)."""
    device: str = "cpu"
    """Trainer device: 'cpu' or 'cuda'."""
    gemm_backend: str = "auto"
    """FP8 GEMM backend for the trainer and the rollout: 'auto', 'deepgemm', 'torch-blockwise', 'emulated'."""
    checkpoint_every: int = 10
    """Write an atomic checkpoint every K steps (and after the last step); 0 disables periodic ones."""
    keep_checkpoints: int = 2
    """How many recent checkpoints to keep."""
    eval_every: int = 0
    """Greedy accuracy on the held-out set every K steps (0: only at start and end)."""
    eval_prompts: int = 128
    """Size of the held-out evaluation set (0 disables evaluation)."""
    threads: int = 0
    """torch intra-op threads for the trainer (0 = torch's default)."""
    progress: bool = True
    """Show a progress bar with ETA on stderr."""
    loggers: tuple[str, ...] = ()
    """Metric sinks beside ``metrics.jsonl`` (always written): 'tensorboard' (event files in
    ``<run dir>/tensorboard/``, needs the tensorboard package) and/or 'wandb' (needs wandb; project
    ``$WANDB_PROJECT`` or 'jetrl', run name ``run.name``). Keys that mean what a verl metric means are
    logged under verl's name (`jetrl.train.loggers.VERL_NAMES`)."""


@dataclass(frozen=True)
class ModelConfig:
    path: str | None = None
    """HF model directory (with tokenizer); None builds the embedded tiny Qwen3 with `jetrl.tiny`."""
    tiny: dict[str, Any] = field(default_factory=dict)
    """Overrides for `jetrl.tiny.tiny_qwen3_config` (e.g. ``num_hidden_layers: 2``)."""
    dtype: str = "bfloat16"
    """Dtype of the trainer's compute weights and of the rollout engine ('bfloat16')."""
    attn_implementation: str = "sdpa_causal"
    """HF attention of the trainer: 'sdpa_causal' (`jetrl.train.policy.use_causal_sdpa`: SDPA's causal
    kernels with no mask, which the right-padded batches allow; refuses sliding windows, soft-capping and
    attention sinks), 'sdpa' or 'eager' (transformers' own, with the padding mask; its 'sdpa' then runs
    SDPA's masked kernels, ~4x slower fwd+bwd on an H200 at a Llama-3.1-8B micro-batch,
    ``scripts/results/attention-nvidia-h200.json``); replaced when ``numerics`` is 'vllm-cpu' or 'strict'."""
    numerics: str = "hf"
    """Trainer numerics between the Linears: 'hf' (transformers' model as is), 'vllm-cpu' (RoPE,
    attention and residual+RMSNorm computed as vLLM's CPU kernels do; see `jetrl.rollout.engine_match`) or
    'strict' (CUDA: transformers' model with vLLM's FlashAttention forward and sampler log-probs, the engine
    in vLLM's batch-invariant mode with ``rollout.engine_ops`` 'hf' or 'fused', so that each log-prob is
    the engine's bytes; see `jetrl.rollout.engine_strict`)."""
    fuse_producers: bool = False
    """Install the fused FP8 producers (`jetrl.convert.convert_model` with ``fuse=True``): each decoder
    layer's RMSNorms feeding FP8 Linears become RMSNorm+quantize kernels (q/k/v and gate/up then share
    one quantization and one saved fp8 copy) and its SiLU MLP quantizes down_proj's input in the SwiGLU
    kernel. Fewer launches and less activation memory: on an H200 a Llama-8B-shaped decoder layer
    trains faster with them than without (`scripts/bench_linear.py`; figures in the README and
    scripts/results/linear-nvidia-h200.json). Needs an FP8-training recipe and ``numerics`` 'hf' or 'strict'."""


@dataclass(frozen=True)
class TaskConfig:
    name: str = "arithmetic"
    """Task kind: 'arithmetic' (the synthetic task, `jetrl.tasks.arithmetic`) or 'parquet' (verl RL parquet
    from ``scripts/data/*.py``, scored by `jetrl.tasks.reward`; needs ``model.path``, ``warmup.steps: 0``)."""
    min_operand: int = 0
    """Smallest operand."""
    max_operand: int = 99
    """Largest operand."""
    ops: tuple[str, ...] = ("+",)
    """Operators."""
    train_file: str | None = None
    """task.name 'parquet': the train split, e.g. ``~/data/jetrl/gsm8k/train.parquet``."""
    val_file: str | None = None
    """task.name 'parquet': the evaluation split (``run.eval_prompts`` rows from its start)."""


@dataclass(frozen=True)
class WarmupConfig:
    steps: int = 300
    """Supervised warm-up steps on the task's answers before RL (0 skips). Recipe independent: run once
    in float32 and cached, so every recipe starts from the same weights."""
    batch_size: int = 64
    """Problems per warm-up step."""
    lr: float = 3e-3
    """AdamW learning rate of the warm-up (cosine decay to 10%)."""


@dataclass(frozen=True)
class RolloutConfig:
    prompts_per_step: int = 16
    """Prompts per RL step (B)."""
    samples_per_prompt: int = 8
    """Samples per prompt (G, the GRPO group size)."""
    temperature: float = 1.0
    """Sampling temperature (the trainer scores log-probs at the same temperature)."""
    top_p: float = 1.0
    """Nucleus sampling mass (1.0 = off; < 1 makes the sampling distribution differ from the policy)."""
    max_tokens: int = 8
    """Response budget in tokens (the overlong penalty counts against it)."""
    max_model_len: int = 64
    """Engine context length (prompt + response)."""
    gpu_memory_utilization: float | None = None
    """Fraction of device memory (on CPU: of host memory) vLLM reserves; None = adapter default."""
    engine_ops: str = "auto"
    """The engine's ops between the Linears (`jetrl.rollout.vllm_model`): 'vllm' (vLLM's own model),
    'hf' (transformers' norms, residual adds, RoPE and SiLU-and-mul, as the trainer computes them with
    ``model.numerics`` 'hf' or 'strict'), 'fused' (as 'hf' through the trainer's fused producer kernels; needs
    ``model.fuse_producers: true``). Attention and lm_head stay vLLM's. 'auto' (resolved when the config is
    loaded): the trainer's ops ('hf', or 'fused' with fused producers) for ``jetrl-unified`` on CUDA with
    numerics 'hf' or 'strict' -- on the H200 they bring its mismatch from 4.0x to 0.94x the bf16 recipe's
    (README) -- else 'vllm' (the baselines roll out with vLLM's own model; on CPU ``numerics: vllm-cpu``
    matches the trainer to vLLM instead)."""
    executor: str = "auto"
    """Where the engine runs: 'uni' in the trainer's process (vLLM's in-process engine with its uni-process
    executor), 'mp' in processes of its own -- vLLM's engine core and a worker process, as verl's rollout servers
    run it: the engine core schedules while the worker runs the model and this process handles outputs. The
    weight sync reaches the worker through CUDA IPC handles of the trainer's bytes on a GPU (by value on a CPU),
    digests proving the bytes either way; the lint captures the rollout graph in that worker. 'auto' (resolved
    when the config is loaded): 'mp' for run.device 'cuda' with ``model.numerics: hf`` -- the 8B-class RL
    rollout on the H200 took 18.3 / 15.7 s (unified / BF16) there against 27.6 / 28.7 s in the trainer's
    process (README) -- else 'uni' (CPU; 'vllm-cpu' and 'strict' numerics set vLLM up in this process)."""
    engines: int = 1
    """vLLM engines of the policy on the one device (`jetrl.rollout.group.EngineGroup`); above 1 each step's prompts
    are split between them and decoded at once, each engine core scheduling its share in a process of its own
    (at batch 256 the GPU was busy for under half of a decode step, the worker waiting on the one engine core;
    on one H100, 8-layer Llama-3.1-8B shape, two engines decoded no faster than one, README). Needs ``rollout.executor:
    mp``; every engine reserves ``gpu_memory_utilization`` of the device and receives every weight sync
    (byte-verified in each); the lint captures the first."""
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for `jetrl.rollout.adapter.create_engine`; none may set vLLM's executor or
    parallelism (`ENGINE_PLACEMENT_KEYS`: ``rollout.executor`` chooses the executor; one engine, one device)."""
    ignore_eos: bool = False
    """Generate every response to `max_tokens` (benchmarks: stable token counts; such responses never
    finish with 'stop', so they earn no reward)."""


_ALGO_PRESETS: dict[str, dict[str, Any]] = {
    "grpo": dict(
        clip_low=0.2,
        clip_high=0.2,
        clip_ratio_c=3.0,
        loss_agg="seq-mean-token-mean",
        dynamic_sampling=False,
        overlong_buffer=0,
    ),
    "dapo": dict(
        clip_low=0.2,
        clip_high=0.28,
        clip_ratio_c=10.0,
        loss_agg="token-mean",
        dynamic_sampling=True,
        overlong_buffer=2,
    ),
}


@dataclass(frozen=True)
class AlgoConfig:
    name: str = "grpo"
    """'grpo' or 'dapo'; sets the defaults of the fields below that the config does not give."""
    clip_low: float = 0.2
    """Lower PPO clip: ratio >= 1 - clip_low."""
    clip_high: float = 0.2
    """Upper PPO clip: ratio <= 1 + clip_high (DAPO clip-higher: 0.28)."""
    clip_ratio_c: float | None = 3.0
    """Dual-clip PPO bound (verl's ``actor.clip_ratio_c``, default 3; the DAPO preset, like verl's DAPO
    recipes: 10): for a negative advantage the per-token loss is capped at ``-A * clip_ratio_c``. Must be
    > 1; null turns dual-clip off (jetrl only: verl always applies it)."""
    loss_agg: str = "seq-mean-token-mean"
    """Loss aggregation (`jetrl.train.algo.LOSS_AGG_MODES`, verl's ``actor.loss_agg_mode``): 'token-mean'
    (DAPO), 'token-sum', 'seq-mean-token-mean' (GRPO), 'seq-mean-token-sum', 'seq-mean-token-sum-norm'
    (Dr. GRPO: the token sums divided by `loss_scale_factor`)."""
    loss_scale_factor: int | None = None
    """Divisor of 'seq-mean-token-sum-norm' (verl's ``actor.loss_scale_factor``). null = rollout.max_tokens,
    the response budget. Deliberately unlike verl, whose null means each micro-batch's padded response
    width: jetrl trims micro-batches to their longest sequence, so that width would make the gradient
    depend on how the batch is split."""
    norm_adv_by_std: bool = True
    """Divide group-centred rewards by the group std (False = Dr. GRPO)."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal and sample more prompts to refill the batch."""
    max_gen_batches: int = 3
    """Dynamic sampling: most generation rounds per step before training on what was kept."""
    overlong_buffer: int = 0
    """DAPO overlong penalty buffer in tokens (0 = off); must be < rollout.max_tokens."""
    overlong_penalty: float = 1.0
    """Penalty at the full budget (reward -= factor * overrun fraction)."""
    mini_batches: int = 2
    """Optimizer steps per RL step (the batch is split); later ones are off-policy, hence clipping."""
    epochs: int = 1
    """Passes over the batch per RL step."""
    micro_batch_size: int = 64
    """Sequences per forward/backward (gradient accumulation inside a mini-batch)."""
    micro_batch_tokens: int | None = None
    """Token budget of one forward/backward (verl's ``use_dynamic_bsz`` / ``ppo_max_token_len_per_gpu``):
    a mini-batch's sequences are sorted by length and packed so that each micro-batch's padded size
    (sequences x its longest prompt + response) is at most this; `micro_batch_size` still caps the
    sequences per micro-batch. None = fixed `micro_batch_size` chunks. Either way each micro-batch is
    trimmed to its longest sequence, and the loss is normalized by the whole mini-batch, so the
    gradient does not depend on the partition. Must be >= rollout.max_tokens + 1."""
    cuda_graphs: bool | str = "auto"
    """Run the trainer's micro-batches (the update pass's forward + backward, the old-log-prob pass's forward)
    on CUDA graphs, one per shape bucket, captured before training (`jetrl.train.graphs`: the FP8 Linears'
    host cost gone; log-probs and gradients equal to eager mode's on the same padded shapes). true needs
    run.device 'cuda'; false = eager. 'auto' (resolved when the config is loaded): on for run.device 'cuda'
    with ``model.numerics: hf`` -- on the H200 the graphs halved the 0.6B BF16 training phase on varied
    response lengths, bucket padding included (README; FP8 Linears cost more host time eagerly) -- else eager (CPU;
    ``strict`` numerics, whose graphed run is not GPU-tested). The capture costs start-up time (0.6B FP8:
    minutes), once per run."""
    old_logp: str = "trainer"
    """PPO anchor log-probs: 'trainer' (recomputed with the synced weights) or 'rollout' (the engine's)."""
    tis_cap: float | None = None
    """Truncated importance sampling cap on exp(logp_trainer - logp_rollout); None = no correction."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the reference policy (the model at RL start, run in the recipe's
    precision) added to the loss; 0 = off, no reference model is built (DAPO drops the KL term)."""
    kl_type: str = "k3"
    """KL estimator (`jetrl.train.algo.KL_TYPES`, verl's ``actor.kl_loss_type`` names): 'k3' = 'low_var_kl'
    (GRPO's), 'k1' = 'kl', 'abs', 'k2' = 'mse'; a trailing '+' (e.g. 'k3+') keeps the value and takes
    k2's gradient (straight-through)."""
    eps: float = 1e-6
    """Added to the group std (verl's ``epsilon`` of the GRPO advantage); >= 0."""

    @staticmethod
    def preset(name: str) -> AlgoConfig:
        if name not in _ALGO_PRESETS:
            raise _fail("algo.name", f"unknown algorithm {name!r}; choose one of {sorted(_ALGO_PRESETS)}")
        return AlgoConfig(name=name, **_ALGO_PRESETS[name])


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 2e-4
    """AdamW learning rate (constant after warm-up)."""
    betas: tuple[float, float] = (0.9, 0.99)
    """AdamW betas."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    grad_clip: float = 1.0
    """Clip the global grad norm to this value (0 = off)."""
    lr_warmup_steps: int = 0
    """Linear learning-rate warm-up over this many optimizer steps."""


@dataclass(frozen=True)
class LintConfig:
    enabled: bool = True
    """Run `jetrl.lint.lint` on the model and recipe once before training."""
    allow_violations: bool = False
    """Train even when the lint reports violations (the report is still printed and saved)."""
    numeric: bool = False
    """Ask the lint for its numeric (byte-level) mode as well."""


@dataclass(frozen=True)
class TrainConfig:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    lint: LintConfig = field(default_factory=LintConfig)

    def to_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(dataclasses.asdict(self)))

    def replace(self, **sections: Any) -> TrainConfig:
        """A copy with whole sections or ``section={field: value}`` dicts replaced, validated again."""
        d = self.to_dict()
        for sec, val in sections.items():
            if isinstance(val, dict):
                if sec not in d:
                    raise _fail(sec, f"unknown section; valid: {sorted(d)}")
                d[sec].update(val)
            else:
                d[sec] = dataclasses.asdict(val)
        return config_from_dict(d)

    @property
    def run_dir(self) -> Path:
        return Path(self.run.out_dir) / self.run.name


# ---------------------------------------------------------------------------------------------
# Parsing
# ---------------------------------------------------------------------------------------------


def _coerce(path: str, value: Any, tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errs = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(path, value, a)
            except ConfigError as e:
                errs.append(str(e))
        raise _fail(path, f"expected {tp}, got {value!r}")
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise _fail(path, f"expected a list, got {type(value).__name__} {value!r}")
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(f"{path}[{i}]", v, args[0]) for i, v in enumerate(value))
        if len(value) != len(args):
            raise _fail(path, f"expected {len(args)} values, got {len(value)}: {value!r}")
        return tuple(_coerce(f"{path}[{i}]", v, a) for i, (v, a) in enumerate(zip(value, args, strict=True)))
    if origin is dict:
        if not isinstance(value, dict):
            raise _fail(path, f"expected a mapping, got {type(value).__name__} {value!r}")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise _fail(path, f"expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _fail(path, f"expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "2e-4" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                raise _fail(path, f"expected a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _fail(path, f"expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise _fail(path, f"expected a string, got {value!r}")
        return value
    raise _fail(path, f"unsupported field type {tp}")  # pragma: no cover - a bug in this module


def _build(cls: type, path: str, raw: Any, base: Any = None) -> Any:
    if not isinstance(raw, dict):
        raise _fail(path, f"expected a mapping of fields, got {type(raw).__name__} {raw!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in raw:
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f"; did you mean '{path}.{close[0]}'?" if close else ""
            raise _fail(f"{path}.{key}", f"unknown key{hint} (valid keys: {', '.join(names)})")
    values = {k: _coerce(f"{path}.{k}", v, hints[k]) for k, v in raw.items()}
    return dataclasses.replace(base, **values) if base is not None else cls(**values)


def _check_values(cfg: TrainConfig) -> None:
    r, ro, a, w, o, t = cfg.run, cfg.rollout, cfg.algo, cfg.warmup, cfg.optim, cfg.task
    positive = {
        "run.steps": r.steps,
        "rollout.prompts_per_step": ro.prompts_per_step,
        "rollout.samples_per_prompt": ro.samples_per_prompt,
        "rollout.max_tokens": ro.max_tokens,
        "rollout.max_model_len": ro.max_model_len,
        "algo.mini_batches": a.mini_batches,
        "algo.epochs": a.epochs,
        "algo.max_gen_batches": a.max_gen_batches,
        "algo.micro_batch_size": a.micro_batch_size,
        "warmup.batch_size": w.batch_size,
        "run.keep_checkpoints": r.keep_checkpoints,
    }
    for k, v in positive.items():
        if v < 1:
            raise _fail(k, f"must be >= 1, got {v}")
    for k, v in {
        "run.checkpoint_every": r.checkpoint_every,
        "run.eval_every": r.eval_every,
        "run.eval_prompts": r.eval_prompts,
        "run.threads": r.threads,
        "warmup.steps": w.steps,
        "algo.overlong_buffer": a.overlong_buffer,
        "optim.lr_warmup_steps": o.lr_warmup_steps,
    }.items():
        if v < 0:
            raise _fail(k, f"must be >= 0, got {v}")
    if not r.name or "/" in r.name or r.name in (".", ".."):
        raise _fail("run.name", f"{r.name!r} must be a plain directory name")
    if r.recipe not in RECIPE_NAMES:
        raise _fail("run.recipe", f"unknown recipe {r.recipe!r}; choose one of {list(RECIPE_NAMES)}")
    if r.device not in ("cpu", "cuda"):
        raise _fail("run.device", f"{r.device!r}: choose 'cpu' or 'cuda'")
    if r.gemm_backend not in ("auto", "deepgemm", "torch-blockwise", "emulated"):
        raise _fail("run.gemm_backend", f"{r.gemm_backend!r}: choose auto, deepgemm, torch-blockwise or emulated")
    if cfg.model.dtype != "bfloat16":
        raise _fail("model.dtype", f"{cfg.model.dtype!r}: only 'bfloat16' is supported (the rollout engine's dtype)")
    if cfg.model.attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise _fail(
            "model.attn_implementation",
            f"{cfg.model.attn_implementation!r}: choose one of {list(ATTN_IMPLEMENTATIONS)}",
        )
    if cfg.model.numerics not in ("hf", "vllm-cpu", "strict"):
        raise _fail("model.numerics", f"{cfg.model.numerics!r}: choose 'hf', 'vllm-cpu' or 'strict'")
    if cfg.model.numerics == "strict":
        if r.device != "cuda":
            raise _fail("model.numerics", f"'strict' runs vLLM's CUDA kernels in the trainer; run.device={r.device!r}")
        if cfg.rollout.engine_ops == "vllm":
            raise _fail(
                "model.numerics",
                "'strict' needs the trainer's norms, RoPE and SiLU-and-mul in the engine: rollout.engine_ops "
                f"'{'fused' if cfg.model.fuse_producers else 'hf'}' (this config: 'vllm')",
            )
        if cfg.rollout.temperature != 1.0:
            raise _fail(
                "model.numerics",
                "'strict' compares the engine's raw log-probs (temperature 1); "
                f"rollout.temperature={cfg.rollout.temperature}",
            )
    if cfg.model.fuse_producers:
        if not Recipe.from_name(r.recipe).train_fp8:
            raise _fail(
                "model.fuse_producers",
                f"the fused producers quantize for FP8 Linears; run.recipe={r.recipe!r} trains in BF16",
            )
        if cfg.model.numerics == "vllm-cpu":
            raise _fail(
                "model.fuse_producers",
                f"replaces the RMSNorms that model.numerics={cfg.model.numerics!r} matches to the rollout engine's "
                "kernels; use one or the other (numerics 'hf' with fused producers)",
            )
    ops = cfg.rollout.engine_ops
    if ops not in ("vllm", "hf", "fused"):
        raise _fail("rollout.engine_ops", f"{ops!r}: choose 'auto', 'vllm', 'hf' or 'fused'")
    if ops != "vllm" and cfg.model.numerics == "vllm-cpu":
        raise _fail(
            "rollout.engine_ops",
            f"{ops!r} runs the trainer's own ops inside the engine; model.numerics={cfg.model.numerics!r} "
            "changes the trainer's to vLLM's instead (use one or the other)",
        )
    if ops != "vllm" and cfg.model.fuse_producers != (ops == "fused"):
        want = "true" if ops == "fused" else "false"
        raise _fail(
            "rollout.engine_ops",
            f"{ops!r} computes the norms and SwiGLU as a trainer with model.fuse_producers={want} does "
            f"(this config: {str(cfg.model.fuse_producers).lower()}); use "
            f"{'fused' if cfg.model.fuse_producers else 'hf'}",
        )
    if "engine_ops" in cfg.rollout.engine_kwargs:
        raise _fail("rollout.engine_kwargs", "engine_ops is the key rollout.engine_ops")
    if cfg.rollout.executor not in ("uni", "mp"):
        raise _fail("rollout.executor", f"{cfg.rollout.executor!r}: choose 'auto', 'uni' or 'mp'")
    if cfg.rollout.executor == "mp" and cfg.model.numerics in ("vllm-cpu", "strict"):
        why = {
            "vllm-cpu": "matches vLLM's CPU kernels by probing them in the trainer's process",
            "strict": "sets vLLM's batch-invariant mode in the trainer's process",
        }[cfg.model.numerics]
        raise _fail(
            "rollout.executor",
            f"'mp' runs the engine in other processes; model.numerics={cfg.model.numerics!r} {why} (use 'uni')",
        )
    if cfg.rollout.engines < 1:
        raise _fail("rollout.engines", f"{cfg.rollout.engines}: at least one engine")
    if cfg.rollout.engines > 1 and cfg.rollout.executor != "mp":
        raise _fail(
            "rollout.engines",
            f"{cfg.rollout.engines} engines need rollout.executor 'mp' (each engine core in a process of its own); "
            f"this config runs {cfg.rollout.executor!r}",
        )
    _check_engine_placement(cfg.rollout.engine_kwargs)
    if cfg.model.path is not None and cfg.model.tiny:
        raise _fail("model.tiny", "overrides for the embedded tiny model cannot be combined with model.path")
    if t.name not in ("arithmetic", "parquet"):
        raise _fail("task.name", f"{t.name!r}: choose 'arithmetic' or 'parquet'")
    if t.name == "parquet" and cfg.model.path is None:
        raise _fail("task.name", "'parquet' needs model.path (an HF model whose tokenizer has a chat template)")
    if cfg.model.path is not None and w.steps:
        raise _fail(
            "warmup.steps",
            f"{w.steps}: the supervised warm-up is for the embedded tiny model; set warmup.steps=0 when "
            "model.path is given",
        )
    for name in r.loggers:
        if name not in LOGGERS:
            raise _fail("run.loggers", f"unknown logger {name!r}; choose from {list(LOGGERS)}")
    if len(set(r.loggers)) != len(r.loggers):
        raise _fail("run.loggers", f"{list(r.loggers)} names a logger twice")
    if ro.samples_per_prompt < 2:
        raise _fail("rollout.samples_per_prompt", f"GRPO needs groups of >= 2 samples, got {ro.samples_per_prompt}")
    if not 0.0 < ro.temperature:
        raise _fail("rollout.temperature", f"must be > 0 (greedy sampling gives no group signal), got {ro.temperature}")
    if not 0.0 < ro.top_p <= 1.0:
        raise _fail("rollout.top_p", f"must be in (0, 1], got {ro.top_p}")
    if ro.gpu_memory_utilization is not None and not 0.0 < ro.gpu_memory_utilization <= 1.0:
        raise _fail("rollout.gpu_memory_utilization", f"must be in (0, 1], got {ro.gpu_memory_utilization}")
    n = ro.prompts_per_step * ro.samples_per_prompt
    if ro.prompts_per_step % a.mini_batches:
        raise _fail(
            "algo.mini_batches",
            f"{a.mini_batches} does not divide rollout.prompts_per_step={ro.prompts_per_step} (mini-batches hold "
            f"whole groups; {n} samples in all)",
        )
    if a.loss_agg not in LOSS_AGG_MODES:
        raise _fail("algo.loss_agg", f"{a.loss_agg!r}: choose one of {list(LOSS_AGG_MODES)}")
    if not 0.0 <= a.clip_low < 1.0:
        raise _fail("algo.clip_low", f"must be in [0, 1), got {a.clip_low}")
    if a.clip_high < 0.0:
        raise _fail("algo.clip_high", f"must be >= 0, got {a.clip_high}")
    if a.overlong_buffer >= ro.max_tokens:
        raise _fail("algo.overlong_buffer", f"{a.overlong_buffer} must be < rollout.max_tokens={ro.max_tokens}")
    if a.old_logp not in ("trainer", "rollout"):
        raise _fail("algo.old_logp", f"{a.old_logp!r}: choose 'trainer' or 'rollout'")
    if a.micro_batch_tokens is not None:
        if a.micro_batch_tokens <= 0:
            raise _fail("algo.micro_batch_tokens", f"must be > 0 or null, got {a.micro_batch_tokens}")
        if a.micro_batch_tokens < ro.max_tokens + 1:
            raise _fail(
                "algo.micro_batch_tokens",
                f"{a.micro_batch_tokens} must be >= rollout.max_tokens + 1 = {ro.max_tokens + 1} (one sequence, a "
                "prompt token and a full response, must fit in a micro-batch)",
            )
    if not isinstance(a.cuda_graphs, bool):
        raise _fail("algo.cuda_graphs", f"{a.cuda_graphs!r}: choose true, false or 'auto'")
    if a.cuda_graphs and r.device != "cuda":
        raise _fail("algo.cuda_graphs", f"CUDA graphs need run.device 'cuda', got {r.device!r}")
    if a.tis_cap is not None and a.tis_cap <= 0:
        raise _fail("algo.tis_cap", f"must be > 0 or null, got {a.tis_cap}")
    if a.kl_coef < 0:
        raise _fail("algo.kl_coef", f"must be >= 0, got {a.kl_coef}")
    if a.kl_type not in KL_TYPES:
        raise _fail("algo.kl_type", f"{a.kl_type!r}: choose one of {list(KL_TYPES)}")
    if a.clip_ratio_c is not None and not a.clip_ratio_c > 1.0:
        raise _fail("algo.clip_ratio_c", f"must be > 1 (the dual-clip bound) or null (off), got {a.clip_ratio_c}")
    if a.loss_scale_factor is not None and a.loss_scale_factor < 1:
        raise _fail("algo.loss_scale_factor", f"must be >= 1 or null (= rollout.max_tokens), got {a.loss_scale_factor}")
    if not 0.0 <= a.eps < math.inf:
        raise _fail("algo.eps", f"must be finite and >= 0, got {a.eps}")
    if o.lr <= 0:
        raise _fail("optim.lr", f"must be > 0, got {o.lr}")
    if w.steps and w.lr <= 0:
        raise _fail("warmup.lr", f"must be > 0, got {w.lr}")
    if o.grad_clip < 0:
        raise _fail("optim.grad_clip", f"must be >= 0, got {o.grad_clip}")
    if not all(0.0 <= b < 1.0 for b in o.betas):
        raise _fail("optim.betas", f"each beta must be in [0, 1), got {o.betas}")


def config_from_dict(raw: dict[str, Any]) -> TrainConfig:
    """Build and check a `TrainConfig` from a nested mapping (unknown keys raise `ConfigError`)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"config: expected a mapping of sections, got {type(raw).__name__}")
    sections = {f.name: f for f in dataclasses.fields(TrainConfig)}
    for key in raw:
        if key not in sections:
            close = difflib.get_close_matches(str(key), list(sections), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise _fail(str(key), f"unknown section{hint} (valid sections: {', '.join(sections)})")
    built = {}
    hints = typing.get_type_hints(TrainConfig)
    for name in sections:
        sub = raw.get(name) or {}
        if name == "algo":
            if not isinstance(sub, dict):
                raise _fail("algo", f"expected a mapping of fields, got {type(sub).__name__}")
            built[name] = _build(AlgoConfig, "algo", sub, base=AlgoConfig.preset(sub.get("name", "grpo")))
        else:
            built[name] = _build(hints[name], name, sub)
    try:
        _check_task(built["task"])
    except ValueError as e:
        raise ConfigError(str(e)) from None
    cfg = _resolve_auto(TrainConfig(**built))
    _check_values(cfg)
    return cfg


def _resolve_auto(cfg: TrainConfig) -> TrainConfig:
    """``rollout.engine_ops``, ``rollout.executor`` and ``algo.cuda_graphs`` 'auto' as their docstrings say (the
    saved config records the resolved values)."""
    cuda = cfg.run.device == "cuda"
    if cfg.rollout.engine_ops == "auto":
        trainer_ops = cfg.run.recipe == "jetrl-unified" and cuda and cfg.model.numerics in ("hf", "strict")
        ops = ("fused" if cfg.model.fuse_producers else "hf") if trainer_ops else "vllm"
        cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, engine_ops=ops))
    if cfg.algo.cuda_graphs == "auto":
        graphs = cuda and cfg.model.numerics == "hf"
        cfg = dataclasses.replace(cfg, algo=dataclasses.replace(cfg.algo, cuda_graphs=graphs))
    if cfg.rollout.executor == "auto":
        executor = "mp" if cuda and cfg.model.numerics == "hf" else "uni"
        cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, executor=executor))
    return cfg


ENGINE_PLACEMENT_KEYS = {
    "tensor_parallel_size": (1,),
    "pipeline_parallel_size": (1,),
    "data_parallel_size": (1,),
}
"""``rollout.engine_kwargs`` that spread vLLM's engine over devices, and the values allowed there: `jetrl train` runs
one engine on one device (tensor-parallel and multi-GPU rollouts run through verl: ``python -m jetrl.verl``). Its
executor (``distributed_executor_backend``) is never an engine_kwargs key: ``rollout.executor`` chooses it."""


def _check_engine_placement(engine_kwargs: dict[str, Any]) -> None:
    if "distributed_executor_backend" in engine_kwargs:
        raise _fail(
            "rollout.engine_kwargs.distributed_executor_backend",
            f"{engine_kwargs['distributed_executor_backend']!r}: the engine's executor is the key rollout.executor "
            "('uni': in the trainer's process, 'mp': in processes of its own)",
        )
    for key, keep in ENGINE_PLACEMENT_KEYS.items():
        if key in engine_kwargs and engine_kwargs[key] not in keep:
            raise _fail(
                f"rollout.engine_kwargs.{key}",
                f"{engine_kwargs[key]!r}: jetrl train runs one engine on one device (allowed: "
                f"{', '.join(map(repr, keep))}). Tensor-parallel and multi-GPU rollouts run through verl: "
                "python -m jetrl.verl",
            )


def _check_task(task: TaskConfig) -> None:
    """Validate the task fields by building the task (its errors name ``task.<field>``)."""
    from .task import ArithmeticTask

    if task.name == "parquet":
        for key in ("train_file", "val_file"):
            value = getattr(task, key)
            if value is None or not Path(value).expanduser().is_file():
                raise ValueError(f"task.{key}: {value!r} is not a parquet file (task.name 'parquet' needs it)")
        return
    ArithmeticTask(seed=0, min_operand=task.min_operand, max_operand=task.max_operand, ops=task.ops)


def _parse_value(text: str) -> Any:
    return yaml.safe_load(text)


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``section.key=value`` strings (values parsed as YAML) to a raw config mapping."""
    out = json.loads(json.dumps(raw))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected section.key=value")
        key, text = item.split("=", 1)
        parts = key.split(".")
        if len(parts) < 2 or not all(parts):
            raise ConfigError(f"override {item!r}: expected section.key=value")
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {p} is not a section")
        node[parts[-1]] = _parse_value(text)
    return out


def load_raw(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    text = p.read_text()
    try:
        raw = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        kind = "JSON" if p.suffix == ".json" else "YAML"
        raise ConfigError(f"config file {str(p)!r} is not valid {kind}: {e}") from None
    return raw or {}


def load_config(path: str | Path, overrides: list[str] | None = None) -> TrainConfig:
    """Read a YAML (``.yaml``/``.yml``) or JSON (``.json``) config and apply dotted overrides."""
    return config_from_dict(apply_overrides(load_raw(path), overrides or []))
