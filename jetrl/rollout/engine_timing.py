"""Per-step host time of vLLM's engine core, recorded in the process that runs it.

vLLM's engine core (the scheduler's loop) runs in the caller's process with the in-process engine and in a
process of its own otherwise (``VLLM_ENABLE_V1_MULTIPROCESSING=1``, `jetrl train`'s ``rollout.executor: mp``,
verl's rollout servers); no profiler of the caller's or the worker's process sees it. jetrl's vLLM plugin
(`jetrl.rollout.vllm_plugin.register`, which vLLM loads in every process it starts) calls `install`, which wraps
vLLM's ``Scheduler.schedule`` and ``Scheduler.update_from_output`` in that process. With
``JETRL_ENGINE_CORE_TIMING=DIR`` in the environment of the engine core's process (inherited from the process
that starts the engine), each turn of the engine core's loop -- from one ``schedule`` call to the next --
appends one JSON line to ``DIR/engine-core-<pid>.jsonl``: its start (``time.time()``, comparable across
processes), wall, the time inside ``schedule`` and ``update_from_output`` (host work by construction: the
scheduler's Python), the hand-off between them (``handoff_ms``: from ``schedule``'s return to the turn's
``update_from_output`` call, where vLLM's engine core hands the scheduled step to its executor and waits for a model
output -- with async scheduling the previous step's; with the model in a worker process, the scheduler output's
trip there and the wait), and the tokens and requests scheduled. What the wall holds besides these three is the rest
of the loop (sending the outputs to the front-end, taking in requests). CPU times are not recorded: with vLLM's
multiprocess executor the loop's thread busy-polls the worker's shared-memory queue while it waits, so its CPU
time is about the wall whatever paces the step (116 / 114 of 128 / 126 ms a step, medians, on a 2-core CPU
where the model paced it: ``rollout-engine-core-mp-cpu.json``, recorded before they were dropped). A process
that never schedules (vLLM's front-end with the engine core elsewhere, the workers) writes nothing.

`summarize` reads the turns of a time window, e.g. one generate's; `recorded` those of this process's `ENV`.
"""

from __future__ import annotations

import functools
import json
import os
import time
from pathlib import Path

__all__ = ["ENV", "install", "recorded", "summarize"]

ENV = "JETRL_ENGINE_CORE_TIMING"
FIELDS = ("wall_ms", "schedule_ms", "update_ms", "handoff_ms")


class _Recorder:
    def __init__(self):
        self.pid, self.folder, self.file = os.getpid(), None, None
        self.turn: dict | None = None  # the turn in progress: its start, its clocks at that start, its sums

    def begin(self) -> dict | None:
        """Called as ``schedule`` starts: close the previous turn (one line) and open the next, into the folder
        `ENV` names now; None (nothing recorded) while it is unset."""
        folder = os.environ.get(ENV)
        if self.pid != os.getpid() or folder != self.folder:  # a forked process, or another folder: start afresh
            if self.file is not None and self.pid == os.getpid():
                self.file.close()
            self.pid, self.folder, self.file, self.turn = os.getpid(), folder, None, None
        if not folder:
            return None
        now = {"t": time.time(), "p": time.perf_counter()}
        if (prev := self.turn) is not None:
            if self.file is None:
                Path(self.folder).mkdir(parents=True, exist_ok=True)
                path = Path(self.folder) / f"engine-core-{os.getpid()}.jsonl"
                self.file = path.open("a", buffering=1)  # line-buffered: a reader sees every finished turn
            row = {
                "t": prev["t"],
                "wall_ms": (now["p"] - prev["p"]) * 1e3,
                "schedule_ms": prev["schedule_ms"],
                "update_ms": prev["update_ms"],
                "handoff_ms": prev["handoff_ms"],
                "tokens": prev["tokens"],
                "requests": prev["requests"],
            }
            self.file.write(json.dumps(row) + "\n")
        self.turn = {**now, "schedule_ms": 0.0, "update_ms": 0.0, "handoff_ms": 0.0, "tokens": 0, "requests": 0}
        return self.turn


def install(scheduler_cls: type) -> None:
    """Wrap `scheduler_cls`'s (vLLM's ``vllm.v1.core.sched.scheduler.Scheduler``, the base of its async scheduler)
    ``schedule`` and ``update_from_output`` in this process (idempotent). The turns go to the folder `ENV` names
    as each begins; while it is unset the wrappers only call through (an environment lookup a step). The plugin
    passes the class: this module imports no vLLM."""
    if getattr(scheduler_cls.schedule, "_jetrl_timed", False):
        return
    rec = _Recorder()
    schedule, update = scheduler_cls.schedule, scheduler_cls.update_from_output

    @functools.wraps(schedule)
    def timed_schedule(self, *args, **kwargs):
        if (turn := rec.begin()) is None:
            return schedule(self, *args, **kwargs)
        t0 = time.perf_counter()
        out = schedule(self, *args, **kwargs)
        turn["scheduled_at"] = time.perf_counter()
        turn["schedule_ms"] += (turn["scheduled_at"] - t0) * 1e3
        turn["tokens"] += int(out.total_num_scheduled_tokens)
        turn["requests"] += len(out.num_scheduled_tokens)
        return out

    @functools.wraps(update)
    def timed_update(self, *args, **kwargs):
        if (turn := rec.turn) is None:
            return update(self, *args, **kwargs)
        t0 = time.perf_counter()
        if (scheduled_at := turn.pop("scheduled_at", None)) is not None:
            turn["handoff_ms"] += (t0 - scheduled_at) * 1e3
        try:
            return update(self, *args, **kwargs)
        finally:
            turn["update_ms"] += (time.perf_counter() - t0) * 1e3

    timed_schedule._jetrl_timed = True
    scheduler_cls.schedule, scheduler_cls.update_from_output = timed_schedule, timed_update


def summarize(folder: str | Path, start: float, end: float) -> dict:
    """The engine-core turns that began and ended inside ``[start, end]`` (``time.time()`` values, e.g. around a
    generate), from every process that recorded into `folder`: ``steps`` (the turns that scheduled tokens),
    ``turns`` (all), the processes, each field of `FIELDS` summed over all turns (``total_s``) and that sum
    divided by the steps (``per_step_ms``), and the tokens scheduled. Raises ValueError when no step falls
    inside (the engine was started without `ENV`, or the window holds no engine step)."""
    rows, pids = [], set()
    for path in sorted(Path(folder).glob("engine-core-*.jsonl")):
        for line in path.read_text().splitlines():
            r = json.loads(line)
            if r["t"] >= start and r["t"] + r["wall_ms"] / 1e3 <= end:
                rows.append(r)
                pids.add(int(path.stem.rsplit("-", 1)[1]))
    steps = sum(r["tokens"] > 0 for r in rows)
    if not steps:
        raise ValueError(
            f"engine_timing.summarize: no engine-core step recorded in {folder} between {start:.3f} and {end:.3f} "
            f"(was the engine started with {ENV} set?)"
        )
    total = {f.removesuffix("_ms"): sum(r[f] for r in rows) / 1e3 for f in FIELDS}
    return {
        "steps": steps,
        "turns": len(rows),
        "pids": sorted(pids),
        "tokens": sum(r["tokens"] for r in rows),
        "total_s": total,
        "per_step_ms": {k: v * 1e3 / steps for k, v in total.items()},
    }


def recorded(start: float, end: float) -> dict | None:
    """`summarize` of the folder `ENV` names in this process's environment (the one the engines it starts record
    into); None where it is unset."""
    folder = os.environ.get(ENV)
    return summarize(folder, start, end) if folder else None
