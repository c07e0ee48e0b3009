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


def build_engine(ckpt, gradient_checkpointing: bool = False, strategy: str = "fsdp2"):
    """verl's FSDP2 (`strategy`) initialisation of `JetrlFSDPEngine` on `ckpt` (sdpa, no remove-padding: the CPU
    has no flash-attn), in the process group already initialised; the recipe comes from ``JETRL_RECIPE``."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig

    from jetrl.verl.engine import JetrlFSDPEngine

    eng = JetrlFSDPEngine(
        HFModelConfig(
            path=str(ckpt),
            use_remove_padding=False,
            enable_gradient_checkpointing=gradient_checkpointing,
            override_config={"attn_implementation": "sdpa"},
        ),
        FSDPEngineConfig(strategy=strategy, forward_only=False, use_torch_compile=False),
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


def fp8_weight_probe(eng, ids) -> dict:
    """One forward + backward of `eng` on `ids` with jetrl's FP8 weight cache off (the engine's setting) and one
    with it on: each pass's gradients (this rank's shards) and the shapes of the FP8 weights its forward left
    alive for its backward (not alive before it), and the weight quantizations of the pass with the cache off."""
    from jetrl.linear import JetFP8Linear, set_fp8_weight_caching
    from jetrl.testing.numerics import fp8_weights_alive

    linears = [m for m in eng.module.modules() if isinstance(m, JetFP8Linear)]
    device_type = "cuda" if torch.cuda.is_available() else "cpu"

    def one_pass():
        eng.module.train()
        before = {id(t): t for t in fp8_weights_alive(*linears)}  # held, so that no id of it is reused
        with torch.autocast(device_type, dtype=torch.bfloat16):
            loss = eng.module(input_ids=ids, use_cache=False).logits.float().logsumexp(-1).mean()
        new = sorted({tuple(t.shape) for t in fp8_weights_alive(*linears, exclude=before)})
        del before
        loss.backward()
        grads = {n: p.grad.to_local().detach().clone() for n, p in eng.module.named_parameters()}
        eng.optimizer_zero_grad()
        return grads, new

    out = {"cache_weight": [m.cache_weight for m in linears]}
    n = sum(m.weight_quantizations for m in linears)
    out["grads"], out["alive"] = one_pass()
    out["quantizations"] = sum(m.weight_quantizations for m in linears) - n
    out["linears"] = len(linears)
    set_fp8_weight_caching(eng.module, True)
    try:
        out["grads_cached"], out["alive_cached"] = one_pass()
    finally:
        set_fp8_weight_caching(eng.module, False)
    return out
