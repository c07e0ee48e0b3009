"""`JetrlFSDPEngine`: verl's FSDP language-model engine training through jetrl's FP8 Linears.

verl builds the actor (and the reference policy) with ``EngineRegistry.new("language_model", strategy,
...)``. `register_engine` files this class under vendor ``jetrl`` for ``fsdp`` and ``fsdp2`` on
``cuda``, so it is chosen only where the workers run with ``VERL_ENGINE_VENDOR=jetrl`` (the
entrypoint `jetrl.verl.__main__` puts that in the Ray runtime env); every other verl run keeps verl's
engine. Registering under vendor ``nvidia`` instead would replace FSDP for every verl job. It runs FSDP2
only (``strategy=fsdp2``, the entrypoint's default; verl's own default ``fsdp`` is FSDP1): under ``fsdp`` it
refuses to build, rather than leave a verl run with this vendor on verl's BF16 engine.

What changes against `FSDPEngineWithLMHead`, and nothing else:

- ``_build_module``: verl loads the HF model (fp32 masters for training, bf16 for a forward-only ref),
  then `jetrl.convert.convert_model` swaps the recipe's Linears for `JetFP8Linear` in place *before*
  FSDP wraps the model. The Parameters are the same objects under the same HF names, so FSDP2's
  sharding, mixed precision (the unsharded weight a Linear sees is the ``param_dtype`` cast of the fp32
  shard), the optimizer, checkpoints and ``get_per_tensor_param`` see an unchanged model.
  With ``JETRL_ENGINE_OPS=fused`` (``jetrl.engine_ops=fused``) the conversion also installs jetrl's fused
  producers (`JetRMSNormQuant` for the norms before FP8 Linears, `JetSwiGLUMLP`; same Parameters, same
  names), the kernels the rollout's ``fused`` engine runs, so both sides hand the same FP8 bytes to the Linears.
- No FP8 weight is kept (`jetrl.linear.set_fp8_weight_caching` off): each forward quantizes the weight FSDP
  has just gathered for fprop, and the backward the weight FSDP gathers again for it for dgrad (same values,
  same bytes), so no full-size FP8 weight is held between forwards nor between a layer's forward and its
  backward. The Linear's cache (keyed on the weight's address and version counter) would otherwise hold a
  full-size FP8 copy of every layer on every rank, undoing the sharding (and the ref policy's, never
  refreshed, through the rollout), and could hand back bytes of weights FSDP has since overwritten in its
  shards: after ``load_checkpoint`` a forward ran on the pre-load weights
  (``tests/verl_integration/test_verl_engine.py``). FSDP re-gathers for every forward anyway, so the cache was hit
  only where a gathered weight happened to come back at the same address (no saving to count on).
- ``save_checkpoint``: verl's checkpoint, plus ``jetrl.json`` (recipe, numerics, the rollout's engine ops, GEMM
  backend, the dtype the weights are quantized from) beside the shards, which ``jetrl export-verl``
  (`jetrl.verl.export`) reads and passes on to ``jetrl lint --model``.
- ``get_per_tensor_param`` (the stream verl sends to the rollout at every sync): for a recipe with
  ``weight_sync == "fp8-bytes"``, each converted Linear's weight leaves as its e4m3 bytes under the HF
  name plus ``<module>.weight_scale_inv`` (fp32 128x128 scales), quantized by the forward's own
  quantizer (`jetrl.gemm.quantize.quantize_128x128`) from the forward's own input: the full weight cast
  to the FSDP ``param_dtype``. Every other tensor leaves in BF16. After each tensor comes
  ``<name>:jetrl_digest`` (its `jetrl.rollout.sync.tensor_digest`, as uint8 text), which the rollout
  worker (`jetrl.verl.worker`) compares against what arrived and then against what it installed.
  BF16 recipes stream exactly what verl streams.

  Two ways to get there, chosen by ``JETRL_FP8_EXPORT``. ``gather`` (default): verl's stream, one full
  tensor gathered at a time (FSDP2 shards each weight along N), quantized after the gather. ``shard``:
  verl's ``get_per_tensor_param_shard`` (each rank's local rows, in BF16); each rank quantizes its own rows
  and only the e4m3 bytes and scales are gathered (`fp8_export_shards`: a quarter of an fp32 gather's
  traffic, the quantization spread over the ranks). The bytes are the same only when every shard boundary
  falls on a 128-row block (then no block spans two ranks): a weight whose FSDP shard is not a multiple
  of 128 rows is refused, naming it (every rank refuses at the same tensor, so no collective is left open).

Strict numerics (``JETRL_NUMERICS=strict``, set with ``jetrl.numerics=strict``; CUDA): the actor computes
each token's log-prob as the strict vLLM engine does (`jetrl.rollout.engine_strict`, as ``jetrl train``'s
``model.numerics: strict``): `jetrl.rollout.engine_strict.match_vllm_strict` after the conversion (attention
through vLLM's FlashAttention forward on paged K/V, vLLM's batch-invariant mode in the process), and
``prepare_model_outputs`` replaces verl's ``log_probs`` with the model's ``_jetrl_token_logprobs`` (vLLM's
sampler kernel) of the same logits (`strict_log_probs`; verl's own are computed first and dropped: one extra
log-softmax per forward). It needs verl's padded batch (``use_remove_padding=false``: right-padded rows, as the
strict attention requires) and temperature 1; `jetrl.verl.launch` checks the configuration before Ray starts.

The recipe comes from ``JETRL_RECIPE`` (set with the vendor by the entrypoint), the GEMM backend from
``JETRL_GEMM_BACKEND`` (default ``auto``). LoRA is refused (its adapter stream is not FP8-exported).
jetrl's ``fp8_param`` storage (`jetrl.fp8_param`) is not used on this path: its fp32 masters live outside
the module, where FSDP would not shard them; the weights stay verl's fp32 masters and the bytes are
quantized from their ``param_dtype`` cast, as the forward does. Tested with FSDP2 (CPU, gloo, 1 and 2
processes, both export modes). FSDP1 is refused: verl's FSDP1 cannot run on a CPU (its
``sync_module_states`` needs a GPU), so nothing here tests it.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from jetrl.convert import ConversionReport, convert_model
from jetrl.gemm.quantize import quantize_128x128
from jetrl.linear import set_fp8_weight_caching
from jetrl.recipe import BLOCK, RECIPE_NAMES, Recipe
from jetrl.rollout.adapter import STRICT_ENV
from jetrl.rollout.sync import WeightSyncError, tensor_digest
from jetrl.verl.adapter import (
    EngineRegistry,
    FSDPEngineWithLMHead,
    micro_batch_setting,
    registered_engine,
)

__all__ = [
    "VENDOR",
    "RECIPE_ENV",
    "BACKEND_ENV",
    "EXPORT_ENV",
    "EXPORT_MODES",
    "ENGINE_OPS_ENV",
    "NUMERICS_ENV",
    "NUMERICS",
    "DIGEST_SUFFIX",
    "CHECKPOINT_INFO",
    "SCALE_SUFFIX",
    "JetrlFSDPEngine",
    "recipe_from_env",
    "numerics_from_env",
    "strict_log_probs",
    "register_engine",
    "encode_digest",
    "fp8_export_stream",
    "fp8_export_shards",
    "decode_digest",
]

VENDOR = "jetrl"
"""verl engine vendor key of `JetrlFSDPEngine` (``VERL_ENGINE_VENDOR=jetrl`` selects it)."""
RECIPE_ENV = "JETRL_RECIPE"
BACKEND_ENV = "JETRL_GEMM_BACKEND"
EXPORT_ENV = "JETRL_FP8_EXPORT"
EXPORT_MODES = ("gather", "shard")
"""``JETRL_FP8_EXPORT``: quantize after gathering each full weight (default) or per FSDP shard (module docstring)."""
ENGINE_OPS_ENV = "JETRL_ENGINE_OPS"
"""``jetrl.engine_ops`` as the entrypoint hands it to every worker: the rollout servers run it
(`jetrl.rollout.vllm_model`), the actor records it in its checkpoints."""
NUMERICS_ENV = "JETRL_NUMERICS"
NUMERICS = ("hf", "strict")
"""``JETRL_NUMERICS`` (``jetrl.numerics``): the actor's numerics, transformers' ('hf', default) or 'strict'."""
CHECKPOINT_INFO = "jetrl.json"
"""Written by `JetrlFSDPEngine.save_checkpoint` beside verl's shards: what the actor trained with."""
DIGEST_SUFFIX = ":jetrl_digest"
"""Suffix of the stream entries carrying the trainer-side digest of the entry before them."""
SCALE_SUFFIX = "weight_scale_inv"
"""vLLM's (and jetrl's) name of a block-FP8 weight's 128x128 dequant scales."""


def recipe_from_env() -> Recipe:
    """The recipe named by ``JETRL_RECIPE``; an error naming the variable when it is unset or unknown."""
    name = os.environ.get(RECIPE_ENV)
    if not name:
        raise RuntimeError(
            f"{RECIPE_ENV} is not set: the jetrl verl engine (VERL_ENGINE_VENDOR={VENDOR}) needs the recipe; "
            f"run through `python -m jetrl.verl jetrl.recipe=...` or set {RECIPE_ENV} to one of {RECIPE_NAMES}"
        )
    if name not in RECIPE_NAMES:
        raise RuntimeError(f"{RECIPE_ENV}={name!r}: choose one of {RECIPE_NAMES}")
    return Recipe.from_name(name)


def numerics_from_env() -> str:
    """``JETRL_NUMERICS`` ('hf' when unset). For 'strict' every variable of `STRICT_ENV` must hold its value in
    this process from its start (cuBLAS reads its limits at the process's first GEMM), as the entrypoint's Ray
    runtime env sets them; a RuntimeError names what differs."""
    name = os.environ.get(NUMERICS_ENV) or "hf"
    if name not in NUMERICS:
        raise RuntimeError(f"{NUMERICS_ENV}={name!r}: choose one of {NUMERICS}")
    if name == "strict":
        wrong = {k: os.environ.get(k) for k, v in STRICT_ENV.items() if os.environ.get(k) != v}
        if wrong:
            raise RuntimeError(
                f"{NUMERICS_ENV}=strict but this process has {wrong} (needs {STRICT_ENV} from its start); run "
                "through `python -m jetrl.verl jetrl.numerics=strict`, which puts them in the Ray runtime env"
            )
    return name


def strict_log_probs(token_logprobs, logits: torch.Tensor, labels: torch.Tensor, cu_seqlens: torch.Tensor):
    """verl's nested ``log_probs`` of a padded forward (``use_remove_padding=false``), each token's computed by
    `token_logprobs` (the strict model's ``_jetrl_token_logprobs``) on the logits row it was sampled from.

    `logits` ``[B, S, V]`` (sequence ``i``'s rows first, right-padded), `labels` verl's ``input_ids_rmpad_rolled``
    (every sequence's ids concatenated, rolled by one), `cu_seqlens` the jagged offsets. Sequence by sequence,
    on the contiguous ``logits[i, :n_i]`` (no copy: its rows are as far apart as the engine's for a vocabulary
    that is a multiple of 64); the kernel's rows do not depend on each other, so the split changes nothing."""
    if logits.dtype != torch.bfloat16:
        raise RuntimeError(
            f"{NUMERICS_ENV}=strict: the actor's logits are {logits.dtype}, the strict engine samples from BF16 "
            "logits (actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype must be bf16)"
        )
    offsets = cu_seqlens.tolist()
    parts = [
        token_logprobs(logits[i, : end - start], labels[start:end])
        for i, (start, end) in enumerate(zip(offsets[:-1], offsets[1:], strict=True))
    ]
    return torch.nested.nested_tensor_from_jagged(torch.cat(parts), cu_seqlens)


def encode_digest(digest: str, device: torch.device | str) -> torch.Tensor:
    """A digest string as a uint8 tensor (it travels in verl's tensor stream)."""
    return torch.tensor(list(digest.encode("ascii")), dtype=torch.uint8, device=device)


def decode_digest(t: torch.Tensor) -> str:
    return bytes(t.detach().cpu().tolist()).decode("ascii")


class JetrlFSDPEngine(FSDPEngineWithLMHead):
    """`FSDPEngineWithLMHead` whose Linears are jetrl FP8 Linears (see the module docstring)."""

    jetrl_recipe: Recipe
    jetrl_conversion: ConversionReport
    jetrl_last_export: dict
    """Stats of the last fully consumed ``get_per_tensor_param`` stream (bytes, seconds, counts)."""
    jetrl_numerics: str
    """'hf' or 'strict' (``JETRL_NUMERICS``)."""

    def _build_module(self):
        numerics = numerics_from_env()
        if numerics == "strict" and not torch.cuda.is_available():
            raise RuntimeError(f"{NUMERICS_ENV}=strict runs vLLM's CUDA kernels in the actor; no CUDA device here")
        self.jetrl_recipe, self.jetrl_numerics = recipe_from_env(), numerics
        # jetrl.engine_ops=fused: the rollout's norms and SwiGLU run jetrl's fused producers, so the actor's do too
        # (the same kernels and bytes on both sides, as `jetrl train` pairs model.fuse_producers with them)
        fuse = os.environ.get(ENGINE_OPS_ENV) == "fused"
        if fuse and numerics == "strict":
            raise RuntimeError(
                f"{NUMERICS_ENV}=strict with {ENGINE_OPS_ENV}=fused: strict numerics run transformers' norms in the "
                "actor and in the engine (jetrl.engine_ops=hf)"
            )
        self.jetrl_last_export = {}
        if self.engine_config.strategy != "fsdp2":
            raise NotImplementedError(
                f"jetrl verl engine: strategy={self.engine_config.strategy!r}; it runs verl's FSDP2 engine only "
                "(set actor_rollout_ref.actor.strategy=fsdp2; the ref follows it)"
            )
        if self._is_lora:
            raise NotImplementedError(
                "jetrl verl engine: LoRA is not supported (set actor_rollout_ref.model.lora_rank=0)"
            )
        module = super()._build_module()
        backend = os.environ.get(BACKEND_ENV, "auto")
        self.jetrl_conversion = convert_model(module, self.jetrl_recipe, backend=backend, fuse=fuse)
        set_fp8_weight_caching(module, False)
        if self.jetrl_numerics == "strict":
            from jetrl.rollout.adapter import enable_batch_invariance
            from jetrl.rollout.engine_strict import match_vllm_strict

            enable_batch_invariance()
            match_vllm_strict(module, check_dtype=False)  # FSDP casts the fp32 masters to param_dtype (bf16)
        return module

    def prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func):
        token_logprobs = getattr(self.module, "_jetrl_token_logprobs", None)  # set by match_vllm_strict
        if token_logprobs is not None:
            for key, verl_default in (("use_remove_padding", True), ("use_fused_kernels", False)):
                if micro_batch_setting(micro_batch, key, verl_default):
                    raise RuntimeError(
                        f"{NUMERICS_ENV}=strict: the micro-batch has {key}=True; strict log-probs need verl's "
                        f"padded forward with its logits (actor_rollout_ref.model.{key}=false)"
                    )
        out = super().prepare_model_outputs(output, output_args, micro_batch, logits_processor_func)
        if token_logprobs is None or out.get("log_probs") is None:
            return out
        labels, cu_seqlens = output_args["input_ids_rmpad_rolled"], micro_batch["input_ids"].offsets()
        out["log_probs"] = strict_log_probs(token_logprobs, output.logits, labels, cu_seqlens)
        return out

    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None, **kwargs):
        super().save_checkpoint(
            local_path, hdfs_path=hdfs_path, global_step=global_step, max_ckpt_to_keep=max_ckpt_to_keep, **kwargs
        )
        if local_path is None:  # verl's checkpoint manager saves nothing then either
            return
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            info = {
                "recipe": self.jetrl_recipe.name,
                "numerics": self.jetrl_numerics,
                "engine_ops": os.environ.get(ENGINE_OPS_ENV) or "vllm",
                "gemm_backend": os.environ.get(BACKEND_ENV, "auto"),
                "param_dtype": str(self._param_dtype()).removeprefix("torch."),
                "global_step": global_step,
            }
            (Path(local_path) / CHECKPOINT_INFO).write_text(json.dumps(info, indent=2))

    def _param_dtype(self) -> torch.dtype:
        """The dtype FSDP casts the weights to for the forward: what the Linears quantize from."""
        return getattr(self, "_autocast_dtype", torch.bfloat16)

    def _fp8_weight_names(self) -> set[str]:
        return {f"{n}.weight" for n in self.jetrl_conversion.converted_names()}

    def get_per_tensor_param(self, layered_summon=False, base_sync_done=False, **kwargs):
        mode = os.environ.get(EXPORT_ENV) or "gather"
        if mode not in EXPORT_MODES:
            raise ValueError(f"{EXPORT_ENV}={mode!r}: choose one of {EXPORT_MODES}")
        if mode == "shard" and self.jetrl_recipe.weight_sync == "fp8-bytes":
            shards, peft_config = super().get_per_tensor_param_shard(**kwargs)
            if peft_config is not None:
                raise NotImplementedError("jetrl verl engine: LoRA weight streams are not supported")
            return self._fp8_stream(fp8_export_shards, shards), None
        stream, peft_config = super().get_per_tensor_param(
            layered_summon=layered_summon, base_sync_done=base_sync_done, **kwargs
        )
        if peft_config is not None:
            raise NotImplementedError("jetrl verl engine: LoRA weight streams are not supported")
        if self.jetrl_recipe.weight_sync != "fp8-bytes":
            return stream, None
        return self._fp8_stream(fp8_export_stream, stream), None

    def _fp8_stream(self, export, stream) -> Iterator[tuple[str, torch.Tensor]]:
        stats: dict = {}
        yield from export(stream, self._fp8_weight_names(), self._param_dtype(), stats)
        self.jetrl_last_export = stats


def fp8_export_stream(
    stream, fp8_names: set[str], param_dtype: torch.dtype, stats: dict | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """verl's ``(HF name, full tensor)`` stream -> jetrl's: each weight in `fp8_names` as e4m3 bytes plus
    ``weight_scale_inv`` (quantized from its `param_dtype` cast, as the forward does, unless it arrives as
    ``(q, s)`` already, from `fp8_export_shards`), every other tensor
    in BF16, each followed by its ``:jetrl_digest`` entry. Fills `stats` (bytes, counts, seconds) once the
    stream is exhausted; raises `WeightSyncError` if a weight of `fp8_names` never came."""
    seen: set[str] = set()
    acc = {"bytes": 0, "n_tensors": 0, "n_fp8": 0, "n_digests": 0}
    t0 = time.perf_counter()

    def emit(name: str, t: torch.Tensor):
        acc["bytes"] += t.nbytes
        acc["n_tensors"] += 1
        acc["n_digests"] += 1
        yield name, t
        yield name + DIGEST_SUFFIX, encode_digest(tensor_digest(t), t.device)

    for name, t in stream:
        if name in fp8_names:
            seen.add(name)
            if isinstance(t, tuple):  # quantized already, per shard (`fp8_export_shards`)
                q, s = t
            else:  # the forward's input: FSDP casts the fp32 shard to param_dtype before the all-gather
                q, s = quantize_128x128(t.detach().to(param_dtype), name=name)
            acc["n_fp8"] += 1
            yield from emit(name, q)
            yield from emit(name[: -len("weight")] + SCALE_SUFFIX, s)
        else:
            yield from emit(name, t.detach().to(torch.bfloat16) if t.is_floating_point() else t.detach())
    missing = sorted(fp8_names - seen)
    if missing:
        raise WeightSyncError(
            f"jetrl verl engine: converted Linear weights missing from verl's parameter stream: {missing[:5]}"
            + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        )
    acc["seconds"] = time.perf_counter() - t0
    if stats is not None:
        stats.update(acc)


def _full(local: torch.Tensor, spec, shape: tuple[int, ...]) -> torch.Tensor:
    """The full tensor of a rank's `local` part laid out as `spec` (verl's ``ShardSpec``) says; `shape` is the
    full tensor's (the scale grid's for scales)."""
    if spec.mesh is None:
        return local.reshape(shape)
    from torch.distributed.tensor import DTensor

    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, spec.mesh, spec.placements, shape=torch.Size(shape), stride=stride).full_tensor()


def _shard_rows(name: str, spec) -> int:
    """Rows per FSDP shard of a weight sharded along N (the full N when it is not sharded)."""
    n = spec.full_shape[0]
    if spec.mesh is None:
        return n
    sharded = [(i, p) for i, p in enumerate(spec.placements) if p.is_shard()]
    if any(p.dim != 0 for _, p in sharded) or len(sharded) > 1:
        raise WeightSyncError(f"{name}: placements {tuple(spec.placements)}; per-shard FP8 export needs one Shard(0)")
    if not sharded:
        return n
    world = spec.mesh.size(sharded[0][0])
    return -(-n // world)  # torch.chunk's split, which FSDP2 uses


def fp8_export_shards(
    shards, fp8_names: set[str], param_dtype: torch.dtype, stats: dict | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """verl's ``get_per_tensor_param_shard`` stream ``(HF name, this rank's flat BF16 shard, ShardSpec)`` ->
    the same ``(name, tensor)`` stream as `fp8_export_stream`: each weight of `fp8_names` quantized on its own
    rows, then its e4m3 bytes and scales gathered (every rank gets the full tensors, as verl sends them);
    everything else gathered in BF16. `WeightSyncError` names a weight whose shards do not fall on 128-row
    blocks (its bytes would differ from the unsharded weight's), and any weight of `fp8_names` that never came."""
    if param_dtype != torch.bfloat16:
        raise WeightSyncError(
            f"per-shard FP8 export: verl's shard stream is BF16 but the forward runs {param_dtype}; use "
            f"{EXPORT_ENV}=gather"
        )

    def full_tensors():
        for name, flat, spec in shards:
            shape = tuple(spec.full_shape)
            local = flat.reshape(-1, *shape[1:]) if len(shape) > 1 else flat
            if name not in fp8_names:
                yield name, _full(local, spec, shape)
                continue
            rows = _shard_rows(name, spec)
            if rows % BLOCK and rows != shape[0]:
                raise WeightSyncError(
                    f"{name}: N={shape[0]} is sharded into {rows}-row FSDP shards, not on {BLOCK}-row blocks, so a "
                    f"128x128 block would span two ranks; per-shard FP8 export refused (use {EXPORT_ENV}=gather)"
                )
            q, s = quantize_128x128(local.detach().to(param_dtype), name=name)
            grid = (-(-shape[0] // BLOCK), -(-shape[1] // BLOCK))
            yield name, (_full(q.view(torch.uint8), spec, shape).view(torch.float8_e4m3fn), _full(s, spec, grid))

    yield from fp8_export_stream(full_tensors(), fp8_names, param_dtype, stats)


def register_engine() -> None:
    """File `JetrlFSDPEngine` in verl's EngineRegistry under vendor ``jetrl`` (idempotent)."""
    if all(registered_engine("language_model", b, "cuda", VENDOR) is JetrlFSDPEngine for b in ("fsdp", "fsdp2")):
        return
    EngineRegistry.register(model_type="language_model", backend=["fsdp", "fsdp2"], device="cuda", vendor=VENDOR)(
        JetrlFSDPEngine
    )
