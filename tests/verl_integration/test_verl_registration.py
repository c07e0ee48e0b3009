"""Registration under jetrl's own keys: the engine vendor ``jetrl`` and the rollout name ``jetrl_vllm``."""

import types

import pytest

verl = pytest.importorskip(
    "verl", reason="verl 0.9.1 is installed by `make venv` (third_party/verl-cpu-requirements.txt)"
)

from verl.workers.engine.base import EngineRegistry  # noqa: E402
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead  # noqa: E402
from verl.workers.rollout.replica import RolloutReplicaRegistry  # noqa: E402
from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension  # noqa: E402

import jetrl.verl.plugin  # noqa: E402, F401  (what verl imports through external_lib)
from jetrl.verl.adapter import rollout_class_of  # noqa: E402
from jetrl.verl.engine import JetrlFSDPEngine, recipe_from_env, register_engine  # noqa: E402
from jetrl.verl.worker import (  # noqa: E402
    ROLLOUT_NAME,
    WORKER_EXTENSION,
    JetrlvLLMHttpServer,
    JetrlvLLMReplica,
    JetrlWorkerExtension,
    register_rollout,
)


@pytest.mark.parametrize("backend", ["fsdp", "fsdp2"])
def test_vendor_jetrl_resolves_to_the_jetrl_engine_and_nothing_else_changes(monkeypatch, backend):
    monkeypatch.setenv("VERL_ENGINE_DEVICE", "cuda")
    monkeypatch.setenv("VERL_ENGINE_VENDOR", "jetrl")
    assert EngineRegistry.get_engine_cls("language_model", backend) is JetrlFSDPEngine
    assert issubclass(JetrlFSDPEngine, FSDPEngineWithLMHead)
    assert EngineRegistry.get_engine_cls("value_model", backend) is FSDPEngineWithValueHead
    for vendor in ("nvidia", "metax"):  # verl's own vendors keep verl's engine
        monkeypatch.setenv("VERL_ENGINE_VENDOR", vendor)
        assert EngineRegistry.get_engine_cls("language_model", backend) is FSDPEngineWithLMHead
    monkeypatch.delenv("VERL_ENGINE_VENDOR")
    assert EngineRegistry.get_engine_cls("language_model", backend) is FSDPEngineWithLMHead


def test_registration_is_idempotent_and_under_jetrl_keys_only():
    before = {b: dict(EngineRegistry._engines["language_model"][b]) for b in ("fsdp", "fsdp2")}
    register_engine()
    register_rollout()
    for b in ("fsdp", "fsdp2"):
        assert EngineRegistry._engines["language_model"][b] == before[b]
        jetrl_keys = [k for k, v in before[b].items() if v is JetrlFSDPEngine]
        assert jetrl_keys == [("cuda", "jetrl")], jetrl_keys
    assert RolloutReplicaRegistry.get(ROLLOUT_NAME) is JetrlvLLMReplica
    assert RolloutReplicaRegistry.get("vllm") is not JetrlvLLMReplica
    # the trainer-side sender of jetrl_vllm is verl's own vLLM ServerAdapter
    assert (
        rollout_class_of(ROLLOUT_NAME) == rollout_class_of("vllm") == "verl.workers.rollout.vllm_rollout.ServerAdapter"
    )


def test_the_server_actor_is_named_where_the_trainer_side_looks_it_up():
    # verl's ServerAdapter (the sender in every actor worker) finds the server by rollout.name; the replica
    # creates it under its own prefix. A mismatch fails the first weight sync ("Failed to look up actor").
    from verl.workers.rollout.vllm_rollout import ServerAdapter

    adapter = types.SimpleNamespace(config={"name": ROLLOUT_NAME})
    replica_prefix = JetrlvLLMReplica._get_server_name_prefix(None)
    assert replica_prefix == ServerAdapter._get_server_name_prefix(adapter) == "jetrl_vllm_"


def test_the_engine_needs_the_recipe_from_the_runtime_env(monkeypatch):
    monkeypatch.delenv("JETRL_RECIPE", raising=False)
    with pytest.raises(RuntimeError, match="JETRL_RECIPE is not set"):
        recipe_from_env()
    monkeypatch.setenv("JETRL_RECIPE", "fp4-magic")
    with pytest.raises(RuntimeError, match="JETRL_RECIPE='fp4-magic'"):
        recipe_from_env()
    monkeypatch.setenv("JETRL_RECIPE", "jetrl-unified")
    assert recipe_from_env().name == "jetrl-unified"


def test_server_runs_jetrls_method_with_the_extension(monkeypatch):
    monkeypatch.setenv("JETRL_RECIPE", "jetrl-unified")
    server = object.__new__(JetrlvLLMHttpServer)  # only the two hooks are exercised
    server.config = types.SimpleNamespace(quantization=None)
    server.model_config = types.SimpleNamespace(hf_config=types.SimpleNamespace(architectures=["Qwen3ForCausalLM"]))
    assert server._get_worker_extension_cls() == WORKER_EXTENSION
    module, _, cls = WORKER_EXTENSION.rpartition(".")
    ext = getattr(__import__(module, fromlist=[cls]), cls)
    assert ext is JetrlWorkerExtension and issubclass(ext, vLLMColocateWorkerExtension)
    method, overrides = server._apply_quantization()
    assert method == "jetrl_fp8"
    assert overrides["quantization_config"]["quant_method"] == "jetrl_fp8"
    assert overrides["quantization_config"]["recipe"] == "jetrl-unified"
    assert "architectures" not in overrides  # JETRL_ENGINE_OPS unset: vLLM's own model
    monkeypatch.setenv("JETRL_ENGINE_OPS", "hf")
    _, overrides = server._apply_quantization()
    assert overrides["architectures"] == ["JetrlQwen3ForCausalLM"] and overrides["jetrl_ops"] == "hf"
    monkeypatch.setenv("JETRL_ENGINE_OPS", "fused")  # the actor fuses its producers too (test_verl_fused)
    _, overrides = server._apply_quantization()
    assert overrides["architectures"] == ["JetrlQwen3ForCausalLM"] and overrides["jetrl_ops"] == "fused"
    server.config = types.SimpleNamespace(quantization="fp8")
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.rollout\.quantization='fp8'"):
        server._apply_quantization()
