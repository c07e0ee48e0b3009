"""Strict numerics on CUDA (``model.numerics: strict``): the trainer computes each token's log-prob with
the bytes the vLLM engine computes it with.

Why. Under ``jetrl-unified`` the Linears are the same FP8 bytes on both sides and, with ``engine_ops:
hf``, the engine runs the trainer's norms, RoPE and SiLU-and-mul (`jetrl.rollout.vllm_model`). What is
left apart is attention (vLLM's paged FlashAttention, decoding one token at a time, against the
trainer's SDPA over the whole sequence), the lm_head GEMM (M = the decode batch against M = every
token) and the log-softmax; and any reduction whose order depends on how many rows a kernel sees
(RMSNorm's mean). On the H200 that left 40% of the tokens of 8k-token responses within 1e-6 of the
trainer's log-prob (README, ``scripts/results/fidelity-nvidia-h200.json``).

What. The engine runs in vLLM's batch-invariant mode (`jetrl.rollout.adapter.STRICT_ENV`: FlashAttention
with one KV split, Triton mean / softmax / log-softmax for ``aten``, cuBLAS without split-K, V2 model
runner), with the trainer's ops (``engine_ops`` 'hf' or 'fused'). The trainer, in the same process
(`enable_batch_invariance` there too), changes three things on the model instance (`match_vllm_strict`;
no global patch):

1. Attention, registered with transformers' AttentionInterface as ``jetrl_vllm_fa``: vLLM's own
   FlashAttention varlen forward (`jetrl.rollout.adapter.vllm_flash_attn_varlen`) on the BF16 q/k/v the
   engine holds, K/V paged in `STRICT_BLOCK_SIZE` blocks through a block table as the engine's KV cache
   is, causal, one KV split, the module's softmax scale. A query row's result depends on its own keys:
   the kernel visits them in the same blocks and order whether the row is one of a prefill (trainer)
   or a decode step (engine); blocks past its causal limit add exact zeros. Backward: the gradient of
   exact attention by autograd through SDPA on the saved q/k/v (what the default trainer runs), so the
   forward's rounding is not differentiated (as a rounding cast's is not).
2. Log-probs (`strict_token_logprobs`): the Triton kernel of vLLM's sampler (one program per row:
   max, sum of exponentials, log, in fp32). Backward: ``g * (onehot - softmax)`` in fp32.
3. Nothing else: transformers' ops are the engine's; the lm_head GEMM and the reductions are
   batch-invariant in both (vLLM's mode, one process).

Padding. The trainer's rows are right-padded (`jetrl.train.policy.TokenBatch`); under a causal mask a
real token never sees the padding to its right, so every row is attended at the batch width without
packing or a host-side length (CUDA-graph friendly). A mask that is not right-padded is refused
(checked at the first layer outside graph capture).

Whether FlashAttention's prefill and decode rows, and cuBLAS's lm_head rows, really agree bit for bit
is the GPU's to say: ``tests/rollout/test_engine_strict.py`` (``gpu``) and ``scripts/bench_fidelity.py``'s
``*_strict`` modes measure it; the lint's numeric mode names the first op whose bytes differ.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from jetrl.rollout.adapter import STRICT_BLOCK_SIZE

__all__ = [
    "ATTN_NAME",
    "match_vllm_strict",
    "paged_kv",
    "strict_attention",
    "strict_token_logprobs",
    "torch_paged_attention",
    "torch_token_logprobs",
]

ATTN_NAME = "jetrl_vllm_fa"
"""Name of the strict attention function registered with transformers' AttentionInterface."""

Kernel = Callable[..., torch.Tensor]


# ---------------------------------------------------------------------------------------------- attention
def paged_kv(x: torch.Tensor, block_size: int = STRICT_BLOCK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """K or V ``[B, Hkv, S, D]`` (transformers' layout) as a paged cache ``[B * nb, block_size, Hkv, D]``
    (vLLM's FlashAttention KV-cache layout; ``nb = ceil(S / block_size)``, the tail block zero-padded) and
    the block table ``[B, nb]`` int32 (sequence ``b`` owns blocks ``b * nb .. b * nb + nb - 1``)."""
    b, h, s, d = x.shape
    nb = -(-s // block_size)
    pages = x.transpose(1, 2)
    if nb * block_size != s:
        pages = F.pad(pages, (0, 0, 0, 0, 0, nb * block_size - s))
    pages = pages.reshape(b * nb, block_size, h, d)
    table = torch.arange(b * nb, device=x.device, dtype=torch.int32).view(b, nb)
    return pages, table


def torch_paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    max_seqlen_q: int,
    cu_seqlens_q: torch.Tensor,
    max_seqlen_k: int,
    seqused_k: torch.Tensor,
    block_table: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    num_splits: int,
    **_ignored,
) -> torch.Tensor:
    """The contract of vLLM's ``flash_attn_varlen_func`` with a paged KV cache, in fp32 torch (the CPU
    reference of `strict_attention`'s layout): q ``[total_q, H, D]`` packed by ``cu_seqlens_q``, k/v pages
    ``[blocks, block_size, Hkv, D]``, sequence ``i`` attending its first ``seqused_k[i]`` keys through
    ``block_table[i]``; causal aligned bottom-right (query ``j`` of ``n`` sees keys ``<= j + k_len - n``).
    Output: ``[total_q, H, D]`` in q's dtype."""
    out = torch.empty_like(q)
    h, hkv = q.shape[1], k.shape[2]
    for i in range(block_table.shape[0]):
        q0, q1 = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        n, kl = q1 - q0, int(seqused_k[i])
        keys = k[block_table[i].long()].flatten(0, 1)[:kl].float()  # [kl, Hkv, D]
        vals = v[block_table[i].long()].flatten(0, 1)[:kl].float()
        keys = keys.repeat_interleave(h // hkv, dim=1)
        vals = vals.repeat_interleave(h // hkv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[q0:q1].float(), keys) * softmax_scale
        if causal:
            allowed = torch.arange(kl)[None, :] <= torch.arange(n)[:, None] + (kl - n)
            scores = scores.masked_fill(~allowed.to(scores.device), float("-inf"))
        out[q0:q1] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vals).to(q.dtype)
    return out


def _flash_forward(q, k, v, scale: float, kernel: Kernel) -> torch.Tensor:
    """q ``[B, H, S, D]``, k/v ``[B, Hkv, S, D]`` -> ``[B, S, H, D]`` through `kernel` as vLLM calls it."""
    b, h, s, d = q.shape
    k_pages, table = paged_kv(k)
    v_pages, _ = paged_kv(v)
    out = kernel(
        q=q.transpose(1, 2).reshape(b * s, h, d),
        k=k_pages,
        v=v_pages,
        max_seqlen_q=s,
        cu_seqlens_q=torch.arange(0, (b + 1) * s, s, device=q.device, dtype=torch.int32),
        max_seqlen_k=s,
        seqused_k=torch.full((b,), s, device=q.device, dtype=torch.int32),
        block_table=table,
        softmax_scale=scale,
        causal=True,
        num_splits=1,  # VLLM_BATCH_INVARIANT's setting in the engine
    )
    return out.view(b, s, h, d)


class _StrictAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale: float, kernel: Kernel):
        ctx.save_for_backward(q, k, v)
        ctx.scale = scale
        return _flash_forward(q, k, v, scale, kernel)

    @staticmethod
    def backward(ctx, grad):
        q, k, v = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
            ref = F.scaled_dot_product_attention(
                *leaves, is_causal=True, scale=ctx.scale, enable_gqa=k.shape[1] != q.shape[1]
            )
            grads = torch.autograd.grad(ref.transpose(1, 2), leaves, grad)
        return (*grads, None, None)


def strict_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *, kernel: Kernel | None = None
) -> torch.Tensor:
    """Causal attention of q ``[B, H, S, D]`` over k/v ``[B, Hkv, S, D]`` (BF16, right-padded rows) as the
    strict engine computes it -> ``[B, S, H, D]``; differentiable (module docstring). `kernel`: vLLM's
    FlashAttention varlen forward unless given (`torch_paged_attention` on CPU)."""
    if kernel is None:
        from jetrl.rollout.adapter import vllm_flash_attn_varlen

        kernel = vllm_flash_attn_varlen(q.shape[-1])
    return _StrictAttention.apply(q, k, v, scale, kernel)


def _right_padded(mask: torch.Tensor) -> bool:
    m = mask.to(torch.int32)
    return bool((m[:, 1:] <= m[:, :-1]).all())


def _attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    if dropout:
        raise ValueError(f"{ATTN_NAME}: dropout={dropout} (strict attention has none)")
    if kwargs.get("sliding_window") is not None:
        raise ValueError(f"{ATTN_NAME}: layer {module.layer_idx} uses a sliding window; strict attention is causal")
    if query.shape[2] != key.shape[2]:
        raise ValueError(f"{ATTN_NAME}: {query.shape[2]} queries over {key.shape[2]} keys (no KV cache in training)")
    if (
        attention_mask is not None
        and getattr(module, "layer_idx", 0) == 0
        and not (query.is_cuda and torch.cuda.is_current_stream_capturing())
        and not _right_padded(attention_mask)
    ):
        raise ValueError(f"{ATTN_NAME}: the attention_mask is not right-padded (strict attention needs it)")
    scale = scaling if scaling is not None else module.scaling
    return strict_attention(query, key, value, scale, kernel=getattr(module, "_jetrl_attn_kernel", None)), None


def _mask_2d(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, attention_mask=None, **kwargs):
    """The 2D padding mask as given (no sync; `_attention` checks it is right-padded)."""
    return attention_mask


# ---------------------------------------------------------------------------------------------- log-probs
def torch_token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """The contract of `jetrl.rollout.adapter.vllm_token_logprobs` in torch: logits ``[M, V]``, token_ids
    ``[M, k]`` -> ``[M, k]`` log-probs in float32 (float64 for float64 logits: gradient checks)."""
    return torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1).gather(
        -1, token_ids.long()
    )


class _StrictTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, kernel: Kernel):
        ctx.save_for_backward(logits, targets)
        return kernel(logits, targets.unsqueeze(-1))[:, 0]

    @staticmethod
    def backward(ctx, grad):
        logits, targets = ctx.saved_tensors
        g = grad.float().unsqueeze(-1)
        dlogits = torch.softmax(logits.float(), dim=-1).mul_(-g)
        dlogits.scatter_add_(-1, targets.unsqueeze(-1), g)
        return dlogits.to(logits.dtype), None, None


def strict_token_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, kernel: Kernel | None = None) -> torch.Tensor:
    """Log-prob of `targets` ``[...]`` under ``softmax(logits)`` ``[..., V]`` -> ``[...]`` float32, by vLLM's
    sampler kernel (`kernel` on CPU tests); differentiable. The drop-in for
    `jetrl.train.algo.token_logprobs` of a strict model."""
    if kernel is None:
        from jetrl.rollout.adapter import vllm_token_logprobs as kernel
    v = logits.shape[-1]
    flat = logits.reshape(-1, v)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    out = _StrictTokenLogprobs.apply(flat, targets.reshape(-1).long(), kernel)
    return out.view(targets.shape)


# ---------------------------------------------------------------------------------------------- the model
def match_vllm_strict(model: nn.Module, *, reference: bool = False, check_dtype: bool = True) -> None:
    """Switch a loaded HF decoder (BF16) to strict numerics, in place (module docstring): attention through
    ``jetrl_vllm_fa``, and the model's ``_jetrl_token_logprobs`` (read by
    `jetrl.train.policy.forward_logprobs` and `jetrl.verl.engine.JetrlFSDPEngine`) set to
    `strict_token_logprobs`. `reference`: the torch references of vLLM's kernels instead
    (`torch_paged_attention`, `torch_token_logprobs`: CPU tests of the plumbing). `check_dtype=False` for a
    model whose fp32 masters are cast to BF16 at the forward by its caller (verl's FSDP mixed precision, which
    `jetrl.verl.launch` checks). Raises ValueError naming what does not fit: sliding-window attention,
    non-BF16 weights."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    cfg = model.config
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", False):
        raise ValueError(f"model.numerics='strict': {type(model).__name__} uses sliding-window attention")
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if check_dtype and dtypes != {torch.bfloat16}:
        raise ValueError(f"model.numerics='strict': the model's parameters are {sorted(map(str, dtypes))}, not BF16")
    attn = [m for m in model.modules() if hasattr(m, "scaling") and hasattr(m, "o_proj")]
    if not attn:
        raise ValueError(f"model.numerics='strict': {type(model).__name__} has no attention module with o_proj")
    # registration happens here, in the set-up that asks for it, not at import
    AttentionInterface.register(ATTN_NAME, _attention)
    AttentionMaskInterface.register(ATTN_NAME, _mask_2d)
    model.set_attn_implementation(ATTN_NAME)
    for m in attn:
        m._jetrl_attn_kernel = torch_paged_attention if reference else None
    model._jetrl_token_logprobs = functools.partial(
        strict_token_logprobs, kernel=torch_token_logprobs if reference else None
    )
