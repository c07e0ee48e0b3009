"""Shared by the verl engine tests: `JetrlFSDPEngine` built by verl's own code for a tiny checkpoint, a free port."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_engine(ckpt):
    """verl's FSDP2 initialisation of `JetrlFSDPEngine` on `ckpt` (sdpa, no remove-padding: the CPU has no
    flash-attn), in the process group already initialised; the recipe comes from ``JETRL_RECIPE``."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig

    from jetrl.verl.engine import JetrlFSDPEngine

    eng = JetrlFSDPEngine(
        HFModelConfig(
            path=str(ckpt),
            use_remove_padding=False,
            enable_gradient_checkpointing=False,
            override_config={"attn_implementation": "sdpa"},
        ),
        FSDPEngineConfig(strategy="fsdp2", forward_only=False, use_torch_compile=False),
        FSDPOptimizerConfig(lr=1e-2, clip_grad=1.0),
        CheckpointConfig(),
    )
    eng.initialize()
    return eng
