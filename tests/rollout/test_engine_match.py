"""vLLM-CPU-matched trainer numerics: same model up to BF16 rounding, differentiable, and bit-equal to
the rollout engine's log-probs (the last test needs vllm-cpu)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from torch import nn

from jetrl.rollout.engine_match import VllmCpuPath, match_vllm_cpu, round_bf16, vllm_cpu_path
from jetrl.tiny import CharTokenizer, build_tiny_model, save_checkpoint


def _ids():
    return torch.tensor([CharTokenizer().encode("7+8=15 3+4=7 9+9=18 2+5=")])


def test_matched_model_is_the_same_function_and_trains():
    ref = build_tiny_model(0)
    m = build_tiny_model(0)
    match_vllm_cpu(m)
    ids = _ids()
    with torch.no_grad():
        a = torch.log_softmax(ref(input_ids=ids, use_cache=False).logits.float(), -1)
        b = torch.log_softmax(m(input_ids=ids, use_cache=False).logits.float(), -1)
    # only rounding differs: BF16 logits of the same model
    assert float((a - b).abs().max()) < 0.1, float((a - b).abs().max())
    assert not torch.equal(a, b)  # ... and the rounding does differ (else the patch would be a no-op)
    loss = m(input_ids=ids, use_cache=False).logits.float().logsumexp(-1).mean()
    loss.backward()
    grads = [p.grad for p in m.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


def test_rejects_other_architectures():
    with pytest.raises(ValueError, match="model.numerics='vllm-cpu'"):
        match_vllm_cpu(nn.Sequential(nn.Linear(2, 2)))


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (vllm-cpu on CPU)")
def test_trainer_logprobs_equal_the_engines(tmp_path):
    """As `jetrl train` runs them with ``model.numerics: vllm-cpu``: the engine kept off vLLM's AMX kernels
    (``cpu_amx=False``; nothing changes on a CPU without AMX) and the trainer matched to that path."""
    path = vllm_cpu_path(amx=False)
    assert path.matched, path.describe()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from jetrl.convert import convert_model
    from jetrl.rollout.adapter import create_engine

    ckpt = save_checkpoint(build_tiny_model(3), CharTokenizer(), tmp_path / "m")
    prompt = _ids()[0].tolist()
    engine = create_engine(ckpt, "jetrl-unified", seed=0, max_model_len=64, cpu_amx=False)
    try:
        assert engine.cpu_attention_isas() == {path.attention_isa}
        s = engine.generate([prompt], n=4, temperature=1.0, max_tokens=6, seed=1)
    finally:
        engine.close()
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16)
    convert_model(m, "jetrl-unified")
    match_vllm_cpu(m, path)
    for sample in s:
        ids = torch.tensor([prompt + sample.response_ids])
        with torch.no_grad():
            lp = torch.log_softmax(m(input_ids=ids, use_cache=False).logits[0, :-1].float(), -1)
        got = [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(sample.response_ids)]
        assert got == sample.response_logprobs, (got, sample.response_logprobs)


def test_round_bf16_truncates_exactly_and_passes_the_gradient():
    x = torch.tensor(
        [1.0 + 2**-8 + 2**-20, -(1.0 + 2**-7 + 2**-8 + 2**-10), 3.0, 2**-140, float("inf")], requires_grad=True
    )
    t = round_bf16(x, "toward-zero")
    assert t.dtype == torch.bfloat16
    assert t.float().tolist()[:4] == [
        1.0,
        -(1.0 + 2**-7),
        3.0,
        0.0,
    ]  # low 16 bits dropped, never rounded up (a subnormal too)
    assert t.float()[4] == float("inf")
    assert round_bf16(x, "nearest-even").float().tolist()[:2] == [1.0 + 2**-7, -(1.0 + 2**-6)]
    t.float().sum().backward()
    assert x.grad.tolist() == [1.0] * 5
    with pytest.raises(ValueError, match="rounding='up'"):
        round_bf16(x, "up")


@pytest.mark.parametrize(
    "probes, kernels, rounding, matched",
    [
        ({"_is_avx512_supported": True, "_is_avx512_bf16_supported": True}, "_C", "nearest-even", True),
        ({"_is_avx512_supported": True, "_is_avx512_bf16_supported": False}, "_C_AVX512", "toward-zero", True),
        ({"_is_avx512_supported": False, "_is_avx512_bf16_supported": False}, "_C_AVX2", "toward-zero", True),
        (
            {"_is_avx512_supported": True, "_is_avx512_bf16_supported": True, "_is_amx_tile_supported": True},
            "_C",
            "nearest-even",
            False,
        ),
    ],
    ids=["avx512-bf16", "avx512", "avx2", "amx"],
)
def test_vllm_cpu_path_follows_vllms_probes(monkeypatch, probes, kernels, rounding, matched):
    import platform

    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setattr("jetrl.rollout.adapter.vllm_cpu_attention_isa", lambda hd, bs, amx=True: "vec")
    for name in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        value = probes.get(name, False)
        monkeypatch.setattr(torch.cpu, name, lambda v=value: v)
    path = vllm_cpu_path()
    assert (path.kernels, path.rounding, path.matched) == (kernels, rounding, matched)
    if not matched:
        assert "AMX" in path.reason and "NOT matched" in path.describe()
    # an engine started with cpu_amx=False runs the non-AMX kernels, which are reproduced
    assert vllm_cpu_path(amx=False).matched


def test_without_amx_hides_the_amx_probes_and_restores_them(monkeypatch):
    pytest.importorskip("vllm")
    from jetrl.rollout.adapter import vllm_cpu_attention_isa, vllm_cpu_without_amx

    probe = lambda: True  # noqa: E731 - an AMX CPU, whatever this one is
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", probe)
    assert vllm_cpu_attention_isa(128, 128) == "amx"
    assert vllm_cpu_attention_isa(128, 128, amx=False) == "vec"
    with pytest.raises(KeyError), vllm_cpu_without_amx():
        assert not torch.cpu._is_amx_tile_supported()
        raise KeyError("restored on the way out of an error too")
    assert torch.cpu._is_amx_tile_supported is probe


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"in_process": False}, r"cpu_amx=False\) needs the model in this process"),
        ({"distributed_executor_backend": "mp"}, r"cpu_amx=False\) needs the model in this process"),
        ({"rollout": "stock"}, r"cpu_amx=False, rollout='stock'\): vLLM's CPU FP8 path needs AMX"),
    ],
)
def test_create_engine_refuses_cpu_amx_off_where_it_cannot_hold(tmp_path, kw, match):
    pytest.importorskip("vllm")
    from jetrl.rollout.adapter import create_engine

    ckpt = save_checkpoint(build_tiny_model(0), CharTokenizer(), tmp_path / "m")
    with pytest.raises(ValueError, match=match):
        create_engine(ckpt, "jetrl-unified", seed=0, max_model_len=64, cpu_amx=False, **kw)


def test_match_reports_the_path_it_applied():
    m = build_tiny_model(0)
    path = match_vllm_cpu(m)
    assert path == m._jetrl_vllm_cpu_path
    assert all(layer.self_attn._jetrl_rounding == path.rounding for layer in m.model.layers)


def test_matched_fp32_copy_stays_fp32():
    """An fp32 copy of a matched model (what the micro-batch partition test trains) casts, not rounds to
    BF16: only BF16 models get the engine kernels' rounding."""
    m = build_tiny_model(0)
    match_vllm_cpu(m, VllmCpuPath("_C_AVX2", "vec", "toward-zero", True))
    m = m.float()
    with torch.no_grad():
        logits = m(input_ids=_ids(), use_cache=False).logits
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
