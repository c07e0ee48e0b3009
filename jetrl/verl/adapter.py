"""The verl adapter: every ``import verl...`` of jetrl lives here (a verl upgrade touches this file only).

Written against verl 0.9.1 (read from its wheel). The hooks jetrl uses, and where they live there:

- the training engine: ``verl/workers/engine/fsdp/transformer_impl.py`` -- `FSDPEngineWithLMHead`
  (``_build_module``, ``optimizer_step``, ``get_per_tensor_param``), chosen by
  ``verl/workers/engine/base.py`` `EngineRegistry.get_engine_cls` from ``(device, vendor)``, where
  ``VERL_ENGINE_VENDOR`` overrides the detected vendor;
- the rollout: ``verl/workers/rollout/vllm_rollout/utils.py`` `vLLMColocateWorkerExtension` (the vLLM
  worker mix-in receiving weights through `BucketedWeightReceiver`), the server
  ``vllm_async_server.py`` `vLLMHttpServer` (``_get_worker_extension_cls``, ``_apply_quantization``) and
  its replica `vLLMReplica`, looked up by ``rollout.name`` in ``verl/workers/rollout/replica.py``
  `RolloutReplicaRegistry` and, for the trainer-side adapter, in ``verl/workers/rollout/base.py``'s
  rollout-class table;
- the trainer: ``verl/trainer/main_ppo.py`` `run_ppo` / `TaskRunnerV1`, the hydra config
  ``verl/trainer/config/ppo_trainer.yaml`` and ``verl/utils/config.py`` `validate_config`; the V1
  trainers (``verl/trainer/ppo/v1/trainer_base.py`` `PPOTrainer`, chosen by ``trainer.v1.trainer_mode``
  through `get_trainer_cls`), whose per-step data lives in TransferQueue (``transfer_queue``, verl 0.9.1's
  V1 data plane, ``tq.kv_batch_get`` returning TensorDicts of jagged per-sample tensors);
- checkpoints: ``verl/utils/checkpoint/fsdp_checkpoint_manager.py`` (what ``save_checkpoint`` writes) and
  ``verl/model_merger/fsdp_model_merger.py`` `FSDPModelMerger` (``python -m verl.model_merger merge``).

Nothing here patches verl or vLLM: registering jetrl's classes under jetrl's own keys (vendor ``jetrl``,
rollout ``jetrl_vllm``) is done by `jetrl.verl.plugin`, which verl imports through
``actor_rollout_ref.model.external_lib`` / ``VERL_USE_EXTERNAL_MODULES``.
"""

from __future__ import annotations

import os
from pathlib import Path

import transfer_queue as tq
import verl
from verl.trainer.main_ppo import TaskRunnerV1, run_ppo
from verl.trainer.ppo.utils import need_critic, need_reference_policy
from verl.trainer.ppo.v1 import PPOTrainer, get_trainer_cls
from verl.utils import tensordict_utils as _tu
from verl.utils.config import validate_config
from verl.utils.logging_utils import configure_verl_logging
from verl.workers.engine.base import EngineRegistry
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
from verl.workers.rollout import base as _rollout_base
from verl.workers.rollout.replica import RolloutReplicaRegistry
from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightReceiver, BucketedWeightSender
from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension
from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer, vLLMReplica

__all__ = [
    "VERL_VERSION",
    "VERL_CONFIG_DIR",
    "VLLM_ROLLOUT_NAME",
    "BucketedWeightReceiver",
    "BucketedWeightSender",
    "EngineRegistry",
    "FSDPEngineWithLMHead",
    "RolloutReplicaRegistry",
    "PPOTrainer",
    "TaskRunnerV1",
    "TaskRunnerV1Class",
    "get_trainer_cls",
    "merge_fsdp_checkpoint",
    "micro_batch_setting",
    "configure_verl_logging",
    "tq",
    "need_critic",
    "need_reference_policy",
    "register_rollout_name",
    "registered_engine",
    "rollout_class_of",
    "run_ppo",
    "validate_config",
    "vLLMColocateWorkerExtension",
    "vLLMHttpServer",
    "vLLMReplica",
]

VERL_VERSION = verl.__version__
"""The installed verl (jetrl is written for 0.9.1)."""

VERL_CONFIG_DIR = Path(verl.__file__).parent / "trainer" / "config"
"""verl's hydra config directory (``ppo_trainer.yaml`` and its groups)."""

TaskRunnerV1Class = TaskRunnerV1.__ray_actor_class__
"""`TaskRunnerV1` is a Ray actor class (``@ray.remote``); this is the plain class under it, to subclass."""


VLLM_ROLLOUT_NAME = "vllm"
"""verl's own rollout name for vLLM, whose trainer-side adapter jetrl's rollout reuses."""


def rollout_class_of(name: str, mode: str = "async") -> str | None:
    """The trainer-side rollout adapter (fully qualified name) verl uses for ``rollout.name=name``."""
    return _rollout_base._ROLLOUT_REGISTRY.get((name, mode))


def register_rollout_name(name: str, replica_loader) -> None:
    """Register rollout ``name``: its replica (``RolloutReplicaRegistry``, the server side) and, for the
    trainer-side weight sender, verl's own vLLM ``ServerAdapter`` (verl 0.9.1 keeps that table as a plain
    dict without a register function). Idempotent; refuses to rebind a name verl or someone else owns."""
    key, vllm_adapter = (name, "async"), rollout_class_of(VLLM_ROLLOUT_NAME)
    current = _rollout_base._ROLLOUT_REGISTRY.get(key)
    if current is not None and current != vllm_adapter:
        raise ValueError(f"verl rollout name {name!r} is already bound to {current}; jetrl will not rebind it")
    _rollout_base._ROLLOUT_REGISTRY[key] = vllm_adapter
    RolloutReplicaRegistry.register(name, replica_loader)


def registered_engine(model_type: str, backend: str, device: str, vendor: str | None):
    """The engine class verl has filed under exactly ``(device, vendor)`` (no fallback), or None."""
    key = (device, vendor) if vendor else device
    return EngineRegistry._engines.get(model_type, {}).get(backend, {}).get(key)


def micro_batch_setting(micro_batch, key: str, default):
    """A non-tensor setting verl's engine reads from a micro-batch TensorDict (``use_remove_padding``,
    ``use_fused_kernels``, ...: ``verl/utils/tensordict_utils.py`` `get_non_tensor_data`)."""
    return _tu.get_non_tensor_data(data=micro_batch, key=key, default=default)


def merge_fsdp_checkpoint(local_dir: str | os.PathLike, target_dir: str | os.PathLike) -> None:
    """verl's own model merger (``python -m verl.model_merger merge --backend fsdp``): the FSDP shards that
    ``save_checkpoint`` wrote to `local_dir` (``model_world_size_<W>_rank_<r>.pt`` + ``huggingface/``) as one HF
    checkpoint with its tokenizer in `target_dir`, every tensor the BF16 cast of its fp32 master."""
    from verl.model_merger.base_model_merger import ModelMergerConfig
    from verl.model_merger.fsdp_model_merger import FSDPModelMerger

    cfg = ModelMergerConfig(
        operation="merge",
        backend="fsdp",
        local_dir=str(local_dir),
        target_dir=str(target_dir),
        hf_model_config_path=str(Path(local_dir) / "huggingface"),
    )
    FSDPModelMerger(cfg).merge_and_save()
