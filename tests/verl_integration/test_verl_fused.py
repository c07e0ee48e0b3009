"""``jetrl.engine_ops=fused`` in verl's FSDP2 actor (`JetrlFSDPEngine`, gloo, world size 1): the conversion installs
jetrl's fused producers, the kernels the rollout's ``fused`` engine runs, under the same parameter names; on the CPU
(reference formulas on both paths) the forward and the FP8 stream are the unfused actor's bit for bit, and a
training step runs through the fused backward."""

import pytest
import torch

verl = pytest.importorskip(
    "verl", reason="verl 0.9.1 is installed by `make venv` (third_party/verl-cpu-requirements.txt)"
)

from verl_engine_cases import engine_session  # noqa: E402

from jetrl.linear import JetRMSNormQuant, JetSwiGLUMLP  # noqa: E402
from jetrl.tiny import save_tiny_checkpoint  # noqa: E402

RECIPE = "jetrl-unified"
BACKEND = "emulated" if not torch.cuda.is_available() else "auto"
DEVICE_TYPE = "cpu" if not torch.cuda.is_available() else "cuda"
IDS = torch.randint(3, 70, (2, 16), generator=torch.Generator().manual_seed(1))


def _run(ckpt, ops: str) -> dict:
    """What the actor built with ``JETRL_ENGINE_OPS=ops`` computes: its fused modules, parameter names, logits,
    FP8 stream, and one training step's gradient norm and logits after it."""
    with engine_session(ckpt, RECIPE, BACKEND, env={"JETRL_ENGINE_OPS": ops}) as eng:
        fused = {
            n: type(m).__name__ for n, m in eng.module.named_modules() if isinstance(m, JetRMSNormQuant | JetSwiGLUMLP)
        }
        eng.module.eval()
        with torch.no_grad(), torch.autocast(DEVICE_TYPE, dtype=torch.bfloat16):
            logits = eng.module(input_ids=IDS, use_cache=False).logits.float().cpu()
        gen, _ = eng.get_per_tensor_param()
        stream = {n: t.detach().cpu().clone() for n, t in gen}
        eng.module.train()
        with torch.autocast(DEVICE_TYPE, dtype=torch.bfloat16):
            loss = eng.module(input_ids=IDS, use_cache=False).logits.float().logsumexp(-1).mean()
        loss.backward()
        grad_norm = float(eng.optimizer_step())
        eng.optimizer_zero_grad()
        return {
            "fused": fused,
            "params": [n for n, _ in eng.module.named_parameters()],
            "logits": logits,
            "stream": stream,
            "grad_norm": grad_norm,
        }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    ckpt = save_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "seed3", seed=3)
    return {ops: _run(ckpt, ops) for ops in ("hf", "fused")}


def test_fused_actor_installs_the_producers_under_the_same_names(runs):
    layers = sorted({n.split(".")[2] for n in runs["fused"]["fused"]})
    assert layers and runs["hf"]["fused"] == {}
    want = {}
    for i in layers:
        want |= {f"model.layers.{i}.input_layernorm": "JetRMSNormQuant", f"model.layers.{i}.mlp": "JetSwiGLUMLP"}
        want[f"model.layers.{i}.post_attention_layernorm"] = "JetRMSNormQuant"
    assert runs["fused"]["fused"] == want
    assert runs["fused"]["params"] == runs["hf"]["params"]


def test_fused_actor_forward_and_stream_are_the_unfused_actors(runs):
    fused, hf = runs["fused"], runs["hf"]
    assert torch.equal(fused["logits"], hf["logits"])
    assert fused["stream"].keys() == hf["stream"].keys()
    for name, t in fused["stream"].items():
        assert torch.equal(t.view(torch.uint8), hf["stream"][name].view(torch.uint8)), name


def test_fused_actor_trains_through_the_fused_backward(runs):
    fused, hf = runs["fused"]["grad_norm"], runs["hf"]["grad_norm"]
    assert fused > 0 and torch.isfinite(torch.tensor(fused))
    # the fused backward is jetrl's fp32 formulas, the unfused one autograd of transformers' ops: close, not equal
    assert fused == pytest.approx(hf, rel=1e-2)
