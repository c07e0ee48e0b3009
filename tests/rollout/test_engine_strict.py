"""Strict numerics (`jetrl.rollout.engine_strict`): the paged layout and varlen arguments handed to vLLM's
FlashAttention, the backward passes, and the model switch, on CPU through the torch references of vLLM's
kernels; on an sm_90 GPU with vLLM, the kernels themselves (prefill rows against decode rows, the lm_head
rows against M, the backward against float64)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from jetrl.rollout import engine_strict as es
from jetrl.testing.numerics import has_sm90, max_abs_diff
from jetrl.tiny import build_tiny_model

HAS_VLLM_GPU = has_sm90() and importlib.util.find_spec("vllm") is not None
gpu = pytest.mark.skipif(not HAS_VLLM_GPU, reason="needs an sm_90 GPU with vLLM (FlashAttention 3, its sampler)")

# (batch, query heads, KV heads, sequence length, head dim): GQA and MHA, S below / on / past a block
SHAPES = [(1, 4, 4, 1, 64), (2, 4, 2, 16, 64), (3, 8, 2, 37, 128), (2, 2, 1, 129, 32)]
IDS = [f"B{b}-H{h}-Hkv{hk}-S{s}-D{d}" for b, h, hk, s, d in SHAPES]


def _qkv(b, h, hk, s, d, *, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(b, h, s, d, generator=g, device=device)
    k = torch.randn(b, hk, s, d, generator=g, device=device)
    v = torch.randn(b, hk, s, d, generator=g, device=device)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def test_paged_kv_pages_each_sequence_in_order():
    x = torch.arange(2 * 3 * 21 * 4, dtype=torch.float32).view(2, 3, 21, 4)
    pages, table = es.paged_kv(x, block_size=8)
    assert pages.shape == (2 * 3, 8, 3, 4) and table.tolist() == [[0, 1, 2], [3, 4, 5]]
    for b in range(2):
        seq = pages[table[b].long()].flatten(0, 1)  # [24, Hkv, D]
        assert torch.equal(seq[:21], x[b].transpose(0, 1)) and not seq[21:].any()


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_strict_attention_layout_is_causal_attention(shape):
    """Through the reference of vLLM's varlen contract, `strict_attention` is causal SDPA: the paging,
    block table, cu_seqlens and seqused_k it builds describe each sequence and nothing else."""
    b, h, hk, s, d = shape
    q, k, v = _qkv(*shape)
    scale = d**-0.5
    out = es.strict_attention(q, k, v, scale, kernel=es.torch_paged_attention)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=hk != h).transpose(1, 2)
    assert out.shape == (b, s, h, d)
    assert max_abs_diff(out, ref) < 1e-5, f"{shape=} err={max_abs_diff(out, ref):.3e}"


def test_right_padded_rows_are_the_rows_of_their_own_length():
    """Right padding never reaches a real token: each row's real positions equal its unpadded attention."""
    q, k, v = _qkv(2, 4, 2, 20, 32)
    out = es.strict_attention(q, k, v, 0.2, kernel=es.torch_paged_attention)
    short = es.strict_attention(q[:1, :, :13], k[:1, :, :13], v[:1, :, :13], 0.2, kernel=es.torch_paged_attention)
    assert max_abs_diff(out[:1, :13], short) < 1e-6


def test_strict_attention_backward_is_sdpa_backward():
    """The gradient is exact attention's (autograd through SDPA on the saved q/k/v), checked in float64."""
    q, k, v = (t.double().requires_grad_(True) for t in _qkv(2, 4, 2, 19, 16, seed=3))
    out = es.strict_attention(q, k, v, 0.25, kernel=es.torch_paged_attention)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    q2, k2, v2 = (t.detach().requires_grad_(True) for t in (q, k, v))
    ref = F.scaled_dot_product_attention(q2, k2, v2, is_causal=True, scale=0.25, enable_gqa=True).transpose(1, 2)
    for got, want in zip(grads, torch.autograd.grad(ref, (q2, k2, v2), g), strict=True):
        assert max_abs_diff(got, want) < 1e-10


def test_strict_token_logprobs_backward_is_log_softmax_gradient():
    logits = torch.randn(3, 5, 50, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (3, 5))
    f = lambda x: es.strict_token_logprobs(x, targets, kernel=es.torch_token_logprobs)  # noqa: E731
    assert torch.autograd.gradcheck(f, (logits,))
    got = f(logits)
    want = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    assert got.shape == targets.shape and torch.equal(got, want)


def _strict_tiny(seed=0, **kw):
    model = build_tiny_model(seed, **kw)
    es.match_vllm_strict(model, reference=True)
    return model


def test_strict_model_matches_sdpa_model_and_trains():
    """The switched model (torch references of the kernels) computes transformers' model: logits close to
    SDPA's, log-probs through the model's strict log-prob function, gradients everywhere."""
    from jetrl.train.policy import forward_logprobs, make_batch

    model, ref = _strict_tiny(), build_tiny_model(0)
    batch = make_batch([[3, 4, 5], [6, 7]], [[8, 9, 10, 11], [12]], [[0.0] * 4, [0.0]], pad_id=0)
    ids, mask = batch.input_ids, batch.attention_mask
    with torch.no_grad():
        a = model(input_ids=ids, attention_mask=mask).logits.float()
        b = ref(input_ids=ids, attention_mask=mask).logits.float()
    real = mask.bool()
    assert max_abs_diff(a[real], b[real]) < 0.1  # BF16 attention computed another way: close, not equal
    calls = []
    strict_fn = model._jetrl_token_logprobs
    model._jetrl_token_logprobs = lambda lg, t: calls.append(t.shape) or strict_fn(lg, t)
    lp, _ = forward_logprobs(model, batch)
    assert calls == [batch.targets.shape]  # the trainer's log-probs went through the strict function
    (lp * batch.mask).sum().backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (its sampler module)")
@pytest.mark.parametrize("vocab,stride", [(78, 128), (151_936, 151_936), (128, 128)])
def test_sampler_kernel_sees_rows_laid_out_like_the_engines_logits(monkeypatch, vocab, stride):
    """The engine samples from a ``[:, :V]`` view of logits padded to 64 rows; the trainer's rows reach the
    kernel the same distance apart (the kernel's sum order follows that stride's alignment), values unchanged."""
    import vllm.v1.worker.gpu.sample.logprob as vllm_logprob

    from jetrl.rollout.adapter import vllm_token_logprobs

    seen = {}

    def kernel(logits, token_ids):
        seen["stride"], seen["logits"] = logits.stride(), logits.clone()
        return torch.log_softmax(logits.float(), -1).gather(-1, token_ids)

    monkeypatch.setattr(vllm_logprob, "compute_token_logprobs", kernel)
    logits = torch.randn(5, vocab).to(torch.bfloat16)
    targets = torch.randint(0, vocab, (5, 1))
    out = vllm_token_logprobs(logits, targets)
    assert seen["stride"] == (stride, 1)
    assert torch.equal(seen["logits"], logits)
    assert torch.equal(out, torch.log_softmax(logits.float(), -1).gather(-1, targets))


def test_strict_attention_refuses_a_left_padded_mask():
    model = _strict_tiny()
    ids = torch.tensor([[1, 2, 3, 4], [0, 0, 5, 6]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
    with pytest.raises(ValueError, match="not right-padded"):
        model(input_ids=ids, attention_mask=mask)


def test_match_refuses_a_model_that_is_not_bf16():
    model = build_tiny_model(0).float()
    with pytest.raises(ValueError, match="not BF16"):
        es.match_vllm_strict(model)


# ------------------------------------------------------------------------------------------------ GPU
@gpu
@pytest.mark.parametrize("shape", [(1, 16, 8, 700, 128), (1, 32, 8, 300, 128)], ids=["Qwen3-1.7B", "Llama-8B"])
def test_gpu_flash_attention_prefill_rows_equal_decode_rows(shape):
    """The premise of strict attention: vLLM's FlashAttention gives a query row the same bytes computed
    in a prefill of the whole sequence (the trainer) as in a decode step over the paged cache (the
    engine), with one KV split. Every position's row is compared bit for bit."""
    from jetrl.rollout.adapter import vllm_flash_attn_varlen

    kernel = vllm_flash_attn_varlen(shape[-1])
    q, k, v = _qkv(*shape, dtype=torch.bfloat16, device="cuda")
    scale = shape[-1] ** -0.5
    full = es.strict_attention(q, k, v, scale, kernel=kernel)[0]  # [S, H, D]
    pages, table = es.paged_kv(k)
    v_pages, _ = es.paged_kv(v)
    s, unequal = shape[3], []
    for t in range(s):  # the decode step of position t: one query, keys 0..t
        row = kernel(
            q=q[0, :, t : t + 1].transpose(0, 1).contiguous(),
            k=pages,
            v=v_pages,
            max_seqlen_q=1,
            cu_seqlens_q=torch.tensor([0, 1], device="cuda", dtype=torch.int32),
            max_seqlen_k=t + 1,
            seqused_k=torch.tensor([t + 1], device="cuda", dtype=torch.int32),
            block_table=table,
            softmax_scale=scale,
            causal=True,
            num_splits=1,
        )
        if not torch.equal(row[0], full[t]):
            unequal.append(t)
    assert not unequal, f"{len(unequal)}/{s} decode rows differ from the prefill's, first at position {unequal[0]}"


@gpu
def test_gpu_strict_attention_backward_matches_float64():
    q, k, v = (t.requires_grad_(True) for t in _qkv(2, 8, 2, 200, 128, dtype=torch.bfloat16, device="cuda"))
    out = es.strict_attention(q, k, v, 128**-0.5)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*leaves, is_causal=True, scale=128**-0.5, enable_gqa=True).transpose(1, 2)
    assert max_abs_diff(out, ref) < 2e-2
    from jetrl.testing.numerics import sqnr_db

    for got, want in zip(grads, torch.autograd.grad(ref, leaves, g.double()), strict=True):
        assert sqnr_db(want, got) > 35, f"sqnr={sqnr_db(want, got):.1f} dB"


@gpu
def test_gpu_strict_token_logprobs_are_the_samplers_per_row():
    """The kernel's row does not depend on the other rows: a row's log-prob alone equals it in a batch."""
    from jetrl.rollout.adapter import vllm_token_logprobs

    logits = (torch.randn(300, 151_936, device="cuda") * 4).to(torch.bfloat16)
    targets = torch.randint(0, 151_936, (300,), device="cuda")
    batch = es.strict_token_logprobs(logits, targets)
    rows = torch.cat([vllm_token_logprobs(logits[i : i + 1], targets[i : i + 1, None])[:, 0] for i in range(300)])
    assert torch.equal(batch, rows)
    assert max_abs_diff(batch, torch.log_softmax(logits.float(), -1).gather(-1, targets[:, None])[:, 0]) < 1e-4


_LM_HEAD_PROBE = r"""
import os, torch
from jetrl.rollout.adapter import STRICT_ENV
os.environ.update(STRICT_ENV)  # before the process's first GEMM
from jetrl.rollout.adapter import enable_batch_invariance
enable_batch_invariance()
g = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn(4096, 1024, device="cuda", generator=g).to(torch.bfloat16)
w = (torch.randn(151_936, 1024, device="cuda", generator=g) * 0.03).to(torch.bfloat16)
full = torch.nn.functional.linear(x, w)
bad = [m for m in (1, 2, 3, 8, 13, 64, 255, 256, 1000)
       if not torch.equal(torch.nn.functional.linear(x[:m], w), full[:m])]
print("UNEQUAL", bad)
"""


@gpu
def test_gpu_lm_head_rows_do_not_depend_on_m_in_batch_invariant_mode():
    """vLLM 0.26 on sm_90 makes BF16 GEMMs batch-invariant by cuBLAS's workspace limits alone (no split-K):
    the lm_head row of a decode batch of M must equal that row computed among all the trainer's tokens.
    In a fresh process, because cuBLAS reads the limits at its first GEMM."""
    env = {k: v for k, v in os.environ.items() if k not in ("CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE")}
    out = subprocess.run([sys.executable, "-c", _LM_HEAD_PROBE], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "UNEQUAL []" in out.stdout, out.stdout


@gpu
def test_gpu_strict_rollout_logprobs_equal_the_trainers(tmp_path):
    """The claim, end to end on the tiny Qwen3 (jetrl-unified, CUDA graphs): every sampled token's log-prob
    from the strict engine equals the strict trainer's, through `scripts/bench_fidelity.py` (its own process:
    batch-invariant mode changes ``aten`` for the whole process)."""
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "f.json"
    args = "--modes jetrl_fp8_strict --prompts 4 --max-tokens 512 --warmup-steps 50 --plot none".split()
    cmd = [sys.executable, str(root / "scripts" / "bench_fidelity.py"), *args, "--out", str(out)]
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    overall = json.loads(out.read_text())["modes"]["jetrl_fp8_strict"]["overall"]
    assert overall["frac_equal"] >= 0.999 and overall["max_abs"] < 1e-3, overall
