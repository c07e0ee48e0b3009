"""Shared by the verl engine tests: `JetrlFSDPEngine` built by verl's own code for a tiny checkpoint, a free port."""

from __future__ import annotations

import contextlib
import os
import socket

import torch


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


@contextlib.contextmanager
def engine_session(ckpt, recipe: str, backend: str, env: dict[str, str] | None = None):
    """A world-size-1 process group (gloo on CPU) and `build_engine(ckpt)` with ``JETRL_RECIPE``,
    ``JETRL_GEMM_BACKEND`` and `env` set while it lives; then the group is destroyed, the environment restored."""
    import torch.distributed as dist

    env = {"JETRL_RECIPE": recipe, "JETRL_GEMM_BACKEND": backend, "MASTER_ADDR": "127.0.0.1", **(env or {})}
    env["MASTER_PORT"] = str(free_port())
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=0, world_size=1)
    try:
        yield build_engine(ckpt)
    finally:
        dist.destroy_process_group()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
