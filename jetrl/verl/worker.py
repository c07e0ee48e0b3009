"""The rollout side of jetrl on verl: a vLLM worker extension that installs the trainer's own FP8 bytes.

verl's colocated sync (verl 0.9.1) streams ``engine.get_per_tensor_param()`` through
`BucketedWeightSender` into each vLLM worker, whose extension (`vLLMColocateWorkerExtension`) loads
the tensors with ``model.load_weights`` -- or, for FP8 rollouts, re-quantizes the BF16 weights with
verl's own quantizer (``verl/utils/vllm/vllm_quant_utils.py``, ``448/amax`` scales: not jetrl's
numerics, NUMERICS.md section 2). `JetrlWorkerExtension` replaces only that receive-and-load step,
and only when the engine runs one of jetrl's quantization methods (``jetrl_fp8``, ``jetrl_fp8_naive``,
``jetrl_bf16``; anything else goes to verl's code unchanged):

1. every bucket is copied out of verl's reused transfer buffer as it arrives;
2. `install_received` pairs each ``<module>.weight`` (e4m3) with its ``<module>.weight_scale_inv``,
   checks every tensor against the trainer-side digest that followed it in the stream
   (``<name>:jetrl_digest``, see `jetrl.verl.engine`) -- what arrived is what the trainer sent --,
   then, in a tensor-parallel engine, cuts this worker's slice of every tensor
   (`jetrl.rollout.tp`: fp8 bytes and scale rows / columns on 128 boundaries, nothing re-quantized; every
   worker receives the full stream from its colocated trainer rank, as in verl's own sync), and hands the
   payload to `jetrl.rollout.sync.install_payload`, which places it (fused
   ``qkv_proj`` / ``gate_up_proj`` rows and scale rows), copies it in place, refreshes vLLM's
   CPU prepacked copies, and compares digests of the engine's memory with the payload. Any difference
   raises `WeightSyncError` naming the parameter, which fails verl's ``update_weights`` call.
   Nothing is re-quantized on this side.

`JetrlvLLMHttpServer` (verl's vLLM server with this extension and jetrl's quantization method for the
recipe in ``JETRL_RECIPE``) and `JetrlvLLMReplica` are what rollout name ``jetrl_vllm`` resolves to
(`register_rollout`); the trainer-side adapter stays verl's vLLM ``ServerAdapter``.

verl 0.9.1 drops what ``update_weights_from_ipc`` returns (``ServerAdapter.update_weights`` awaits the
collective RPC and discards it), so each worker keeps its last report (`jetrl_sync_report`: the
`SyncReport` fields, ``n_arrival_digests`` and a running ``sync_index``) and the server hands every
worker's report to the trainer on request (``JetrlvLLMHttpServer.jetrl_sync_reports``, called by
`jetrl.verl.trainer` after each step's sync).
"""

from __future__ import annotations

import logging
import os

import torch

from jetrl.recipe import Recipe
from jetrl.rollout.adapter import (
    model_packed_modules,
    model_param_info,
    model_tensor_parallel,
    refresh_after_weight_update,
)
from jetrl.rollout.methods import RolloutQuantConfig
from jetrl.rollout.sync import SyncReport, WeightSyncError, install_payload, tensor_digests
from jetrl.rollout.tp import TPShapeError
from jetrl.verl.adapter import (
    BucketedWeightReceiver,
    register_rollout_name,
    vLLMColocateWorkerExtension,
    vLLMHttpServer,
    vLLMReplica,
)
from jetrl.verl.engine import (
    BACKEND_ENV,
    DIGEST_SUFFIX,
    ENGINE_OPS_ENV,
    SCALE_SUFFIX,
    decode_digest,
    numerics_from_env,
    recipe_from_env,
)

__all__ = [
    "ROLLOUT_NAME",
    "WORKER_EXTENSION",
    "JetrlWorkerExtension",
    "JetrlvLLMHttpServer",
    "JetrlvLLMReplica",
    "install_received",
    "jetrl_quant_config",
    "register_rollout",
]

_log = logging.getLogger(__name__)

ROLLOUT_NAME = "jetrl_vllm"
"""``actor_rollout_ref.rollout.name`` of verl's vLLM rollout with jetrl's worker extension."""
WORKER_EXTENSION = "jetrl.verl.worker.JetrlWorkerExtension"


def jetrl_quant_config(vllm_config) -> RolloutQuantConfig | None:
    """The jetrl quantization config a vLLM engine runs with, or None (not a jetrl method)."""
    cfg = getattr(getattr(vllm_config, "quant_config", None), "cfg", None)
    return cfg if isinstance(cfg, RolloutQuantConfig) else None


def install_received(model, received: dict[str, torch.Tensor], recipe: Recipe) -> SyncReport:
    """Install one verl weight stream (name -> tensor, digest entries included) into a live vLLM model (this
    worker's tensor-parallel slice of it in a TP engine).

    Raises `WeightSyncError` naming the tensor when a digest is missing, when what arrived differs from
    what the trainer sent, when a weight's scales are missing, or when the engine does not end up
    holding exactly the payload (`jetrl.rollout.sync.install_payload`)."""
    digests = {n[: -len(DIGEST_SUFFIX)]: decode_digest(t) for n, t in received.items() if n.endswith(DIGEST_SUFFIX)}
    tensors = {n: t for n, t in received.items() if not n.endswith(DIGEST_SUFFIX)}
    undigested = sorted(set(tensors) - set(digests))
    if undigested:
        raise WeightSyncError(
            f"{undigested[0]}: arrived without its trainer digest ({len(undigested)} such tensors); the sender is "
            "not jetrl's verl engine (set VERL_ENGINE_VENDOR=jetrl for the actor)"
        )
    orphans = sorted(set(digests) - set(tensors))
    if orphans:
        raise WeightSyncError(f"{orphans[0]}: its trainer digest arrived but the tensor did not")
    arrived = tensor_digests(tensors)
    bad = [n for n in tensors if arrived[n] != digests[n]]
    if bad:
        lines = "\n".join(f"  {n}: trainer {digests[n]} arrived {arrived[n]}" for n in bad[:10])
        raise WeightSyncError(f"{len(bad)} tensor(s) changed between the trainer and the rollout worker:\n{lines}")
    payload: dict = {}
    for name, t in tensors.items():
        if name.endswith(SCALE_SUFFIX):
            continue
        if t.dtype == torch.float8_e4m3fn:
            sname = name[: -len("weight")] + SCALE_SUFFIX
            if not name.endswith(".weight") or sname not in tensors:
                raise WeightSyncError(f"{name}: fp8 bytes arrived without their 128x128 scales {sname}")
            payload[name] = (t, tensors[sname])
        else:
            payload[name] = t
    stray = [n for n in tensors if n.endswith(SCALE_SUFFIX) and n[: -len(SCALE_SUFFIX)] + "weight" not in payload]
    if stray:
        raise WeightSyncError(f"{stray[0]}: scales arrived without their fp8 weight")
    tp = model_tensor_parallel(model)
    try:
        payload = tp.slice_payload(payload)
    except TPShapeError as e:
        raise WeightSyncError(f"tensor-parallel rank {tp.rank} of {tp.size}: {e}") from e
    return install_payload(
        model,
        payload,
        recipe,
        model_param_info(model),
        model_packed_modules(model),
        finalize=refresh_after_weight_update,
    )


class JetrlWorkerExtension(vLLMColocateWorkerExtension):
    """verl's colocated vLLM worker extension, receiving jetrl's byte-verified FP8 stream (module docstring)."""

    jetrl_last_sync: dict | None = None
    jetrl_sync_index: int = 0

    def update_weights_from_ipc(self, peft_config: dict = None, base_sync_done=False, use_shm: bool = False):
        cfg = jetrl_quant_config(self.model_runner.vllm_config)
        if cfg is None or peft_config:
            return super().update_weights_from_ipc(
                peft_config=peft_config, base_sync_done=base_sync_done, use_shm=use_shm
            )
        if self.device is None:
            self.device = torch.device(self.model_runner.device)
        received: dict[str, torch.Tensor] = {}

        def on_bucket_received(weights, is_last: bool) -> None:
            for name, t in weights:
                if name in received:
                    raise WeightSyncError(f"{name}: arrived twice in one weight sync")
                received[name] = t.clone()  # the receiver reuses its buffer for the next bucket

        BucketedWeightReceiver(zmq_handle=self._get_zmq_handle(), device=self.device, use_shm=use_shm).receive_weights(
            on_bucket_received=on_bucket_received
        )
        report = install_received(self.model_runner.model, received, cfg.recipe_obj)
        self.jetrl_sync_index += 1
        self.jetrl_last_sync = {
            **report.to_dict(),
            "n_arrival_digests": sum(n.endswith(DIGEST_SUFFIX) for n in received),
            "sync_index": self.jetrl_sync_index,
            "tp_rank": model_tensor_parallel(self.model_runner.model).rank,
        }
        _log.info("jetrl weight sync: %s", self.jetrl_last_sync)
        return self.jetrl_last_sync

    def jetrl_sync_report(self) -> dict | None:
        """This worker's last installed sync (see `update_weights_from_ipc`), None before the first one."""
        return self.jetrl_last_sync


class JetrlvLLMHttpServer(vLLMHttpServer):
    """verl's vLLM server running jetrl's quantization method for ``JETRL_RECIPE`` with `JetrlWorkerExtension`."""

    def _get_worker_extension_cls(self) -> str:
        return WORKER_EXTENSION

    async def jetrl_sync_reports(self) -> list[dict | None]:
        """Every worker's `JetrlWorkerExtension.jetrl_sync_report` (verl's own ``collective_rpc`` here returns
        nothing)."""
        return list(await self.engine.collective_rpc("jetrl_sync_report"))

    def _apply_quantization(self):
        if self.config.quantization is not None:
            raise ValueError(
                f"rollout name {ROLLOUT_NAME!r} runs jetrl's own quantization method for the recipe; "
                f"actor_rollout_ref.rollout.quantization={self.config.quantization!r} (verl's re-quantizing FP8 "
                "rollout) must be null -- that baseline is jetrl.recipe=naive-fp8-rollout with rollout.name=vllm"
            )
        from jetrl.rollout.vllm_model import engine_overrides

        recipe = recipe_from_env()
        numerics_from_env()  # strict: vLLM's batch-invariant settings must be in this server's environment
        cfg = RolloutQuantConfig(recipe=recipe.name, backend=os.environ.get(BACKEND_ENV, "auto"))
        ops = engine_overrides(self.model_config.hf_config.architectures, os.environ.get(ENGINE_OPS_ENV) or "vllm")
        return cfg.method_name, {"quantization_config": cfg.to_hf_dict(), **ops}


class JetrlvLLMReplica(vLLMReplica):
    """verl's vLLM replica whose servers are `JetrlvLLMHttpServer`."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        import ray

        self.server_class = ray.remote(JetrlvLLMHttpServer)

    def _get_server_name_prefix(self) -> str:
        # The trainer side (verl's ServerAdapter) looks the server actor up as f"{rollout.name}_server_...";
        # verl's replica names it "vllm_server_..." whatever the rollout name, so name it for ours.
        return f"{ROLLOUT_NAME}_"


def register_rollout() -> None:
    """Make ``actor_rollout_ref.rollout.name=jetrl_vllm`` resolve to `JetrlvLLMReplica` (idempotent)."""
    register_rollout_name(ROLLOUT_NAME, lambda: JetrlvLLMReplica)
