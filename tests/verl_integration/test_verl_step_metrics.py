"""jetrl's per-step metrics in verl 0.9.1's V1 trainer (`jetrl.verl.trainer`), without Ray.

verl's own ``PPOTrainer._compute_old_log_prob`` runs here on a batch laid out as verl's V1 trainer
holds it (TransferQueue: jagged per-sample tensors; the actor's log-probs over prompt + response,
shifted by one; a padding row as ``padding_utils`` builds it), with an in-memory TransferQueue and an
actor worker group that scores the sequences with a tiny Qwen3. jetrl's ``mismatch/*`` land in the
same metrics dict as verl's ``training/rollout_probs_diff_*`` and equal `jetrl.rollout.parity` on the
same numbers (teacher-forced log-probs of the same model). The sync metrics go through verl's
``on_step_end`` / ``_consume_sync_metrics`` with the rollout server's report call.
"""

import asyncio
import math
from types import SimpleNamespace

import pytest
import torch

verl = pytest.importorskip(
    "verl", reason="verl 0.9.1 is installed by `make venv` (third_party/verl-cpu-requirements.txt)"
)

from tensordict import TensorDict  # noqa: E402
from transfer_queue import KVBatchMeta  # noqa: E402

import jetrl.verl.trainer as jtrainer  # noqa: E402
from jetrl.rollout.parity import logprob_mismatch  # noqa: E402
from jetrl.tiny import build_tiny_model  # noqa: E402
from jetrl.verl.adapter import get_trainer_cls, tq  # noqa: E402
from jetrl.verl.launch import ConfigError, apply_recipe, compose  # noqa: E402
from jetrl.verl.metrics import (  # noqa: E402
    METRIC_KEYS,
    MissingLogProbsError,
    batch_mismatch_metrics,
    is_metric_key,
    mismatch_metrics,
    sync_metrics,
)
from jetrl.verl.worker import JetrlvLLMHttpServer, JetrlWorkerExtension  # noqa: E402

MISMATCH_KEYS = [k for k in METRIC_KEYS if k.startswith("mismatch/")]
PROMPTS = [[5, 9, 12], [7, 7], [3, 4, 5, 6]]
RESPONSES = [[20, 21, 22, 23], [30], [11, 12, 13]]
GARBAGE = 123.0  # what the actor's output holds where no response token is scored


class FakeTransferQueue:
    """In-memory ``kv_batch_get`` / ``kv_batch_put`` with TransferQueue's shapes (jagged per-sample fields)."""

    def __init__(self):
        self.rows: dict[str, dict[str, torch.Tensor]] = {}

    def kv_batch_get(self, keys, partition_id, select_fields=None):
        missing = [f for f in select_fields if any(f not in self.rows[k] for k in keys)]
        if missing:
            raise KeyError(f"fake TransferQueue: no field {missing[0]!r}")
        fields = {
            f: torch.nested.as_nested_tensor([self.rows[k][f] for k in keys], layout=torch.jagged)
            for f in select_fields
        }
        return TensorDict(fields, batch_size=[len(keys)])

    def kv_batch_put(self, keys, partition_id, fields=None, tags=None):
        for name in fields.keys():
            for k, row in zip(keys, fields[name].unbind(0), strict=True):
                self.rows[k][name] = row
        return KVBatchMeta(keys=list(keys), tags=[{} for _ in keys], partition_id=partition_id)


class ScoringActor:
    """verl's actor worker group, reduced to ``compute_log_prob``: the model's log-prob of token i+1 at
    position i of prompt + response (as verl's engine returns it), garbage where nothing is scored."""

    def __init__(self, model, store: FakeTransferQueue):
        self.model, self.store = model, store

    def compute_log_prob(self, batch):
        for k in batch.keys:
            row = self.store.rows[k]
            ids = torch.cat([row["prompts"], row["responses"]])
            with torch.no_grad():
                logp = self.model(ids[None]).logits.float().log_softmax(-1)[0]
            scored = logp[:-1].gather(-1, ids[1:, None])[:, 0]
            n_prompt = len(row["prompts"])
            lp = torch.full((len(ids),), GARBAGE)
            lp[n_prompt - 1 : -1] = scored[n_prompt - 1 :]  # response tokens only: prompt tokens stay garbage
            row["log_probs"], row["entropy"] = lp, torch.zeros(len(ids))
        return batch


@pytest.fixture(scope="module")
def model():
    return build_tiny_model(seed=0).float()


def _rollout_logprobs(model) -> list[torch.Tensor]:
    """What vLLM would report: the trainer's log-probs off by a known, token-dependent amount."""
    out = []
    for p, r in zip(PROMPTS, RESPONSES, strict=True):
        ids = torch.tensor(p + r)
        with torch.no_grad():
            logp = model(ids[None]).logits.float().log_softmax(-1)[0]
        mine = logp[len(p) - 1 : -1].gather(-1, torch.tensor(r)[:, None])[:, 0]
        out.append(mine + 0.05 * torch.arange(1, len(r) + 1) * (-1) ** len(p))
    return out


def _setup(model, monkeypatch, overrides=()):
    store = FakeTransferQueue()
    monkeypatch.setattr(tq, "kv_batch_get", store.kv_batch_get)
    monkeypatch.setattr(tq, "kv_batch_put", store.kv_batch_put)
    rollout = _rollout_logprobs(model)
    keys, tags = [], []
    for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES, strict=True)):
        keys.append(f"uid{i}_0_0")
        tags.append({})
        store.rows[keys[-1]] = {
            "prompts": torch.tensor(p),
            "responses": torch.tensor(r),
            "response_mask": torch.ones(len(r), dtype=torch.int64),
            "rollout_log_probs": rollout[i],
        }
    # a padding row as verl's upsample_batch_to_divisible_size builds it: one response token, masked out
    keys.append("padding_0")
    tags.append({"is_padding": True})
    store.rows["padding_0"] = {
        "prompts": torch.tensor([1, 2]),
        "responses": torch.tensor([2]),
        "response_mask": torch.zeros(1, dtype=torch.int64),
        "rollout_log_probs": torch.zeros(1),
    }
    cfg = compose(["actor_rollout_ref.model.path=/unused", "actor_rollout_ref.rollout.name=vllm", *overrides])
    trainer = object.__new__(jtrainer.jetrl_trainer_class(get_trainer_cls(cfg.trainer.v1.trainer_mode)))
    trainer.config = cfg
    trainer.actor_rollout_wg = ScoringActor(model, store)
    batch = KVBatchMeta(keys=keys, tags=tags, partition_id="train")
    samples = [
        SimpleNamespace(prompt_ids=p, response_ids=r, response_logprobs=rollout[i].tolist())
        for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES, strict=True))
    ]
    return trainer, batch, store, samples


def test_mismatch_metrics_join_verls_own_in_the_step(model, monkeypatch):
    trainer, batch, store, samples = _setup(model, monkeypatch)
    assert type(trainer).__name__ == "JetrlPPOTrainerSync"
    metrics: dict = {}
    trainer._compute_old_log_prob(batch, metrics)

    # verl's own metrics of the same step are there, untouched
    assert metrics["training/rollout_probs_diff_valid"] == 1 and "actor/entropy" in metrics
    # jetrl's equal jetrl.rollout.parity on the same model and the same rollout log-probs
    want = logprob_mismatch(model, samples)
    assert metrics["mismatch/tokens"] == want["tokens"] == sum(map(len, RESPONSES))
    assert metrics["mismatch/logp_abs_diff_mean"] == pytest.approx(want["mean_abs"], rel=1e-5)
    assert metrics["mismatch/logp_abs_diff_max"] == pytest.approx(want["max_abs"], rel=1e-5)
    assert metrics["mismatch/is_ratio_mean"] == pytest.approx(want["is_ratio_mean"], rel=1e-5)
    # the offsets put in by _rollout_logprobs, known in closed form: 0.05 * position, sign by prompt length
    assert metrics["mismatch/logp_abs_diff_max"] == pytest.approx(0.05 * 4, rel=1e-4)
    deltas = [-0.05 * j * (-1) ** len(p) for p, r in zip(PROMPTS, RESPONSES, strict=True) for j in range(1, len(r) + 1)]
    assert metrics["mismatch/is_ratio_max"] == pytest.approx(max(math.exp(d) for d in deltas), rel=1e-4)
    assert metrics["mismatch/logp_abs_diff_mean"] == pytest.approx(sum(map(abs, deltas)) / len(deltas), rel=1e-4)

    # and equal jetrl.verl.metrics on the batch verl left in TransferQueue (old_log_probs written by verl)
    data = store.kv_batch_get(batch.keys, "train", ["response_mask", "old_log_probs", "rollout_log_probs"])
    assert {k: metrics[k] for k in MISMATCH_KEYS} == batch_mismatch_metrics(data)
    padded = data.to_padded_tensor()
    assert batch_mismatch_metrics(data) == mismatch_metrics(
        padded["old_log_probs"], padded["rollout_log_probs"], padded["response_mask"]
    )
    assert not (padded["old_log_probs"] == GARBAGE)[padded["response_mask"].bool()].any()


def test_a_batch_without_rollout_log_probs_is_refused_naming_the_key(model, monkeypatch):
    trainer, batch, store, _ = _setup(model, monkeypatch)
    data = store.kv_batch_get(batch.keys, "train", ["response_mask", "rollout_log_probs"])
    trainer._compute_old_log_prob(batch, {})
    with pytest.raises(MissingLogProbsError, match=r"'rollout_log_probs'.*calculate_log_probs=true"):
        batch_mismatch_metrics(data.exclude("rollout_log_probs").update({"old_log_probs": data["response_mask"]}))
    with pytest.raises(MissingLogProbsError, match=r"no 'old_log_probs'"):
        batch_mismatch_metrics(data)
    # the DataProto verl's debug metrics read (padded) works the same way
    full = store.kv_batch_get(batch.keys, "train", ["response_mask", "old_log_probs", "rollout_log_probs"])
    dp = verl.DataProto(batch=full.to_padded_tensor())
    assert batch_mismatch_metrics(dp) == batch_mismatch_metrics(full)


def test_calculate_log_probs_false_is_refused_by_the_hook_and_the_entrypoint(model, monkeypatch):
    off = ["actor_rollout_ref.rollout.calculate_log_probs=false"]
    trainer, batch, _, _ = _setup(model, monkeypatch, off)
    with pytest.raises(MissingLogProbsError, match=r"actor_rollout_ref\.rollout\.calculate_log_probs=false"):
        trainer._compute_old_log_prob(batch, {})
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.rollout\.calculate_log_probs=false"):
        apply_recipe(compose(["actor_rollout_ref.model.path=/unused", *off]))
    with pytest.raises(ConfigError, match=r"trainer\.use_v1=false"):
        apply_recipe(compose(["actor_rollout_ref.model.path=/unused", "trainer.use_v1=false"]))
    # separate_async syncs standalone rollouts through a checkpoint engine, not jetrl's worker extension
    with pytest.raises(ConfigError, match=r"trainer\.v1\.trainer_mode='separate_async'"):
        apply_recipe(compose(["actor_rollout_ref.model.path=/unused", "trainer.v1.trainer_mode=separate_async"]))


def test_bypass_mode_has_no_mismatch_to_measure(model, monkeypatch, caplog):
    bypass = ["algorithm.rollout_correction.bypass_mode=true"]
    trainer, batch, store, _ = _setup(model, monkeypatch, bypass)
    metrics: dict = {}
    trainer._compute_old_log_prob(batch, metrics)
    assert not any(k.startswith("mismatch/") for k in metrics)
    assert "bypass_mode=true" in caplog.text and "not computed" in caplog.text
    # verl copied the rollout's log-probs: the difference would be identically zero
    assert torch.equal(store.rows["uid0_0_0"]["old_log_probs"], store.rows["uid0_0_0"]["rollout_log_probs"])


def _worker(report: dict) -> JetrlWorkerExtension:
    ext = object.__new__(JetrlWorkerExtension)
    ext.jetrl_last_sync, ext.jetrl_sync_index = None, 0
    ext._next = report
    return ext


def _install(ext: JetrlWorkerExtension) -> None:
    """What `update_weights_from_ipc` records after `install_received` (its last lines)."""
    ext.jetrl_sync_index += 1
    ext.jetrl_last_sync = {**ext._next, "sync_index": ext.jetrl_sync_index}


class FakeServer:
    """A Ray handle of `JetrlvLLMHttpServer`: ``.jetrl_sync_reports.remote()`` runs the server's real method
    over an engine whose ``collective_rpc`` reaches these worker extensions."""

    def __init__(self, workers):
        async def collective_rpc(method, **kw):
            return [getattr(w, method)() for w in workers]

        server = SimpleNamespace(engine=SimpleNamespace(collective_rpc=collective_rpc))
        self.jetrl_sync_reports = SimpleNamespace(
            remote=lambda: asyncio.run(JetrlvLLMHttpServer.jetrl_sync_reports(server))
        )


REPORT = {
    "bytes": 4096,
    "seconds": 0.25,
    "n_params": 25,
    "digests_equal": True,
    "mode": "block",
    "n_digests": 40,
    "n_arrival_digests": 39,
}


def test_sync_metrics_reach_verls_step_metrics(model, monkeypatch):
    trainer, _, _, _ = _setup(model, monkeypatch, ["actor_rollout_ref.rollout.name=jetrl_vllm"])
    monkeypatch.setattr(jtrainer.ray, "get", lambda refs: refs)  # the fake handles return values, not refs
    workers = [_worker(REPORT), _worker({**REPORT, "seconds": 0.5})]
    trainer.checkpoint_manager = SimpleNamespace(
        replicas=[SimpleNamespace(servers=[FakeServer(workers[:1]), FakeServer(workers[1:])])],
        update_weights=lambda step: [_install(w) for w in workers],
    )
    trainer.global_steps, trainer.timing_raw = 1, {}
    trainer.on_step_end()  # verl's PPOTrainerSync.on_step_end: update_weights, timed by verl's marked_timer
    got = trainer._consume_sync_metrics()  # what verl's fit merges into the step's metrics
    assert got == {
        "sync/bytes": 4096,
        "sync/seconds": trainer.timing_raw["update_weights"],
        "sync/install_seconds": 0.5,
        "sync/arrival_digests": 78,
        "sync/digests": 80,
        "sync/digests_equal": 1.0,
        "sync/workers": 2,
        "sync/tp_ranks": 1,
    }
    assert set(got) <= set(METRIC_KEYS) and trainer._consume_sync_metrics() == {}  # one TP rank: no per-rank keys

    # a step whose update_weights installed nothing on a worker is an error, not last step's numbers
    trainer.checkpoint_manager.update_weights = lambda step: _install(workers[0])
    trainer.global_steps = 2
    with pytest.raises(RuntimeError, match=r"rollout worker 1 installed no weight sync in step 2"):
        trainer.on_step_end()


def test_stock_rollouts_have_no_sync_report(model, monkeypatch):
    trainer, _, _, _ = _setup(model, monkeypatch)  # rollout.name=vllm: verl's own worker extension
    calls = []
    trainer.checkpoint_manager = SimpleNamespace(replicas=[], update_weights=calls.append)
    trainer.global_steps, trainer.timing_raw = 3, {}
    trainer.on_step_end()
    assert calls == [3] and trainer._consume_sync_metrics() == {}


def test_sync_metrics_refuse_inconsistent_reports():
    with pytest.raises(ValueError, match="no rollout worker reported"):
        sync_metrics([])
    with pytest.raises(ValueError, match=r"rollout worker 1 has installed no jetrl weight sync"):
        sync_metrics([REPORT, None])
    with pytest.raises(ValueError, match=r"different payloads: bytes by rank \{0: \[4095, 4096\]\}"):
        sync_metrics([REPORT, {**REPORT, "bytes": 4095}])
    assert "sync/seconds" not in sync_metrics([REPORT])
    # two TP-2 replicas: each rank installs its own slice; a replica installs the sum of its ranks'
    tp = [{**REPORT, "tp_rank": r, "bytes": 4096 - 1024 * r} for _replica in range(2) for r in (0, 1)]
    tp[2]["seconds"] = 0.75  # rank 0 of the second replica is the slowest
    got = sync_metrics(tp)
    assert (got["sync/bytes"], got["sync/tp_ranks"], got["sync/workers"]) == (4096 + 3072, 2, 4)
    per_rank = {k: v for k, v in got.items() if k.startswith("sync/tp") and k != "sync/tp_ranks"}
    assert per_rank == {
        "sync/tp0/bytes": 4096,
        "sync/tp0/install_seconds": 0.75,
        "sync/tp0/digests": 80,
        "sync/tp1/bytes": 3072,
        "sync/tp1/install_seconds": 0.25,
        "sync/tp1/digests": 80,
    }
    assert all(is_metric_key(k) for k in got) and not is_metric_key("sync/tp1/seconds")
    with pytest.raises(ValueError, match=r"bytes by rank \{1: \[3071, 3072\]\}"):
        sync_metrics(tp[:3] + [{**tp[3], "bytes": 3071}])


def test_every_v1_trainer_mode_gets_the_hook():
    for mode in ("sync", "colocate_async", "separate_async"):
        cls = jtrainer.jetrl_trainer_class(get_trainer_cls(mode))
        assert issubclass(cls, get_trainer_cls(mode)) and cls.__mro__[1] is jtrainer.JetrlStepMetrics
        assert jtrainer.jetrl_trainer_class(cls) is cls
    with pytest.raises(TypeError, match="not a verl V1 PPOTrainer"):
        jtrainer.jetrl_trainer_class(dict)
    assert jtrainer.JetrlTaskRunner.__ray_actor_class__.run.__doc__.startswith("verl 0.9.1's ``TaskRunnerV1.run``")
