"""Shared, expensive fixtures of the lint tests: tiny checkpoints, training captures, live engines.

Everything is session-scoped and built once: the whole lint suite must stay under two minutes on
two CPU cores, and a vLLM engine start or a first transformers load costs seconds each.
"""

from __future__ import annotations

import pytest

from jetrl.lint.builders import capture_training, probe_ids
from jetrl.recipe import Recipe

BLOCK_FP8_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
"""A stock vLLM block-FP8 checkpoint config with no scale_fmt (NUMERICS.md section 2)."""
COMPATIBLE_ENV = {"VLLM_USE_DEEP_GEMM_E8M0": "0", "VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER": "0"}
"""The stock environment that computes the jetrl numerics on Hopper."""


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    from jetrl.tiny import save_tiny_checkpoint

    return save_tiny_checkpoint(tmp_path_factory.mktemp("lint") / "tiny", seed=0)


@pytest.fixture(scope="session")
def probe(tiny_ckpt):
    return probe_ids(tiny_ckpt)


@pytest.fixture(scope="session")
def unified_training(tiny_ckpt, probe):
    """The jetrl-unified training capture, with tensors (reused by graph and numeric tests)."""
    return capture_training(tiny_ckpt, Recipe.from_name("jetrl-unified"), probe=probe, keep_tensors=True)


@pytest.fixture(scope="session")
def unified_engine(tiny_ckpt):
    if not vllm_available():
        pytest.skip("vLLM is not importable")
    from jetrl.rollout.adapter import create_engine

    engine = create_engine(tiny_ckpt, "jetrl-unified", seed=0, max_model_len=256, backend="emulated")
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def naive_engine(tiny_ckpt):
    if not vllm_available():
        pytest.skip("vLLM is not importable")
    from jetrl.rollout.adapter import create_engine

    engine = create_engine(tiny_ckpt, "naive-fp8-rollout", seed=0, max_model_len=256)
    yield engine
    engine.close()


def fp8_export(ckpt, recipe: Recipe, path):
    """The trainer's FP8 export (`jetrl.rollout.checkpoint.save_fp8_checkpoint`) of `ckpt` under `recipe`."""
    from jetrl.convert import convert_model
    from jetrl.lint.builders import load_training_model
    from jetrl.rollout.checkpoint import save_fp8_checkpoint
    from jetrl.tiny import CharTokenizer

    model = load_training_model(ckpt)
    convert_model(model, recipe)
    return save_fp8_checkpoint(model, CharTokenizer(), path)
