"""``jetrl.numerics=strict`` in verl's actor (`jetrl.verl.engine`), on CPU with the torch references of vLLM's
kernels (`match_vllm_strict(reference=True)`): verl's own padded forward reaches the strict attention in every
layer, each sequence's log-probs come from the strict log-prob function on its own logits rows with verl's
label alignment, the loss backpropagates through them, and what the strict path cannot serve is refused.
Bit-equality with a live strict engine is the GPU's to show (``scripts/bench_verl.py``)."""

import functools

import pytest
import torch

verl = pytest.importorskip(
    "verl", reason="verl 0.9.1 is installed by `make venv` (third_party/verl-cpu-requirements.txt)"
)

from tensordict import TensorDict  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl_engine_cases import engine_session  # noqa: E402

from jetrl.linear import JetFP8Linear  # noqa: E402
from jetrl.rollout.adapter import STRICT_ENV  # noqa: E402
from jetrl.rollout.engine_strict import (  # noqa: E402
    match_vllm_strict,
    strict_token_logprobs,
    torch_paged_attention,
    torch_token_logprobs,
)
from jetrl.tiny import save_tiny_checkpoint, tiny_qwen3_config  # noqa: E402
from jetrl.verl.engine import NUMERICS_ENV, numerics_from_env  # noqa: E402

LENGTHS = (11, 7)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "seed3", seed=3)


@pytest.fixture(scope="module")
def strict_engine(ckpt):
    """The actor engine with strict numerics on the reference kernels, each call recorded."""
    calls = {"attention_q_rows": [], "logprob_rows": []}

    def attention(**kw):
        calls["attention_q_rows"].append(kw["q"].shape[0])
        return torch_paged_attention(**kw)

    def token_logprobs(logits, ids):
        calls["logprob_rows"].append(logits.shape[0])
        return torch_token_logprobs(logits, ids)

    with engine_session(ckpt, "jetrl-unified", "emulated") as eng:
        match_vllm_strict(eng.module, reference=True, check_dtype=False)  # fp32 masters, as verl keeps them
        for m in eng.module.modules():
            if hasattr(m, "_jetrl_attn_kernel"):
                m._jetrl_attn_kernel = attention
        eng.module._jetrl_token_logprobs = functools.partial(strict_token_logprobs, kernel=token_logprobs)
        yield eng, calls


def _micro_batch(remove_padding: bool = False) -> TensorDict:
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 70, (n,), generator=g) for n in LENGTHS]
    td = TensorDict(
        {
            "input_ids": torch.nested.nested_tensor(seqs, layout=torch.jagged),
            "position_ids": torch.nested.nested_tensor([torch.arange(n) for n in LENGTHS], layout=torch.jagged),
        },
        batch_size=[len(seqs)],
    )
    tu.assign_non_tensor(td, use_remove_padding=remove_padding, temperature=1.0)
    return td


def test_the_actor_s_log_probs_come_from_the_strict_path_of_each_sequence(strict_engine):
    eng, calls = strict_engine
    for v in calls.values():
        v.clear()
    eng.module.eval()
    td = _micro_batch()
    with torch.no_grad():
        _, out = eng.forward_step(td, loss_function=None, forward_only=True)
    log_probs = out["model_output"]["log_probs"]
    assert calls["logprob_rows"] == list(LENGTHS)  # one kernel call per sequence, on its own rows only
    layers = tiny_qwen3_config().num_hidden_layers
    assert calls["attention_q_rows"] == [len(LENGTHS) * max(LENGTHS)] * layers  # every layer, the padded batch
    # verl's alignment: position j holds log p(token j+1 | tokens <= j), from the same padded forward
    seqs = td["input_ids"].unbind()
    padded = torch.zeros(len(seqs), max(LENGTHS), dtype=torch.long)
    mask = torch.zeros_like(padded)
    for i, s in enumerate(seqs):
        padded[i, : len(s)], mask[i, : len(s)] = s, 1
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logits = eng.module(input_ids=padded, attention_mask=mask, use_cache=False).logits
    assert logits.dtype == torch.bfloat16
    for i, (s, got) in enumerate(zip(seqs, log_probs.unbind(), strict=True)):
        want = torch.log_softmax(logits[i, : len(s) - 1].float(), -1).gather(-1, s[1:, None])[:, 0]
        assert torch.equal(got[:-1], want), f"sequence {i}: max |diff| {(got[:-1] - want).abs().max():.3e}"


def test_the_loss_backpropagates_through_the_strict_log_probs(strict_engine):
    eng, calls = strict_engine
    eng.module.train()
    eng.optimizer_zero_grad()

    def loss_function(model_output, data, dp_group):
        return -model_output["log_probs"].values().mean(), {}

    loss, _ = eng.forward_step(_micro_batch(), loss_function=loss_function, forward_only=False)
    loss.backward()
    for name, m in eng.module.named_modules():
        if isinstance(m, JetFP8Linear):
            g = m.weight.grad
            g = g.full_tensor() if hasattr(g, "full_tensor") else g
            assert torch.isfinite(g).all() and g.abs().sum() > 0, f"{name}: gradient {g.abs().sum()}"
    eng.optimizer_zero_grad()


def test_a_packed_micro_batch_is_refused_naming_the_key(strict_engine):
    eng, _ = strict_engine
    with pytest.raises(RuntimeError, match=r"use_remove_padding=True.*actor_rollout_ref\.model\.use_remove_padding"):
        eng.prepare_model_outputs(None, {}, _micro_batch(remove_padding=True), None)


def test_numerics_come_from_the_environment_with_the_strict_settings(monkeypatch):
    monkeypatch.delenv(NUMERICS_ENV, raising=False)
    assert numerics_from_env() == "hf"
    monkeypatch.setenv(NUMERICS_ENV, "bitwise")
    with pytest.raises(RuntimeError, match="JETRL_NUMERICS='bitwise'"):
        numerics_from_env()
    monkeypatch.setenv(NUMERICS_ENV, "strict")
    for k in STRICT_ENV:
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(RuntimeError, match=r"JETRL_NUMERICS=strict but this process has .*VLLM_BATCH_INVARIANT"):
        numerics_from_env()
    for k, v in STRICT_ENV.items():
        monkeypatch.setenv(k, v)
    assert numerics_from_env() == "strict"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of strict numerics where there is no CUDA")
def test_strict_numerics_without_cuda_are_refused_before_the_model_loads(strict_engine, monkeypatch):
    eng, _ = strict_engine
    for k, v in {NUMERICS_ENV: "strict", **STRICT_ENV}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(RuntimeError, match="JETRL_NUMERICS=strict runs vLLM's CUDA kernels in the actor; no CUDA"):
        eng._build_module()
    assert eng.jetrl_numerics == "hf"
