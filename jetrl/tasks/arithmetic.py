"""A synthetic arithmetic task with verifiable answers: the embedded default's environment.

A problem is a prompt such as ``"37+45="`` and a ground-truth answer ``"82"``; the policy must emit the
answer's digits and then end the sequence. The reward is verifiable by construction: 1.0 when the
decoded response (up to end of sequence, surrounding whitespace removed) equals the answer, else 0.0.

Data order is a pure function of ``(seed, stream, index)``: the RL prompts of step ``t`` are the same
for every recipe run with the same seed, and a resumed run draws exactly the prompts the killed run
would have drawn. Streams keep the supervised warm-up, the RL prompts and the held-out evaluation set
apart (no evaluation prompt leaks into training by construction of the seeds; overlaps of identical
problem strings are possible for small operand ranges and are harmless for a demo).

`compute_score` keeps the old float-returning form for the local trainer; verl runs point
``custom_reward_function`` at `jetrl.tasks.reward`, which dispatches ``data_source == "jetrl/arithmetic"``
here and returns ``{"score", "acc"}``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

__all__ = ["DATA_SOURCE", "Problem", "ArithmeticTask", "Stream", "score", "compute_score"]

DATA_SOURCE = "jetrl/arithmetic"
"""``data_source`` of the task's rows in verl parquet (`scripts/data/arithmetic.py`)."""


class Stream(enum.IntEnum):
    """Independent problem streams of one task seed."""

    WARMUP = 1
    RL = 2
    EVAL = 3


@dataclass(frozen=True)
class Problem:
    prompt: str
    """Text the policy is conditioned on, e.g. ``"37+45="``."""
    answer: str
    """Ground-truth response text, e.g. ``"82"`` (a parquet row's ``reward_model.ground_truth``)."""
    data_source: str = DATA_SOURCE
    """Which scorer of `jetrl.tasks.reward` grades it."""
    messages: tuple[tuple[str, str], ...] | None = None
    """(role, content) chat messages of a parquet row, rendered with the model's chat template; None:
    `prompt` is the text."""


_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def score(response: str, answer: str) -> float:
    """1.0 when `response` (whitespace stripped) is exactly `answer`, else 0.0."""
    return 1.0 if response.strip() == answer else 0.0


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """verl's reward-function signature returning a float (the dict form is `jetrl.tasks.reward.compute_score`)."""
    del data_source, extra_info
    return score(solution_str, ground_truth)


@dataclass(frozen=True)
class ArithmeticTask:
    """Binary integer arithmetic over ``[min_operand, max_operand]`` with operators from `ops`."""

    seed: int = 0
    """Seed of every stream (the same seed gives the same data order in every recipe)."""
    min_operand: int = 0
    """Smallest operand (inclusive, >= 0)."""
    max_operand: int = 99
    """Largest operand (inclusive)."""
    ops: tuple[str, ...] = ("+",)
    """Operators drawn uniformly: any of '+', '-', '*'."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "ops", tuple(self.ops))
        if not self.ops:
            raise ValueError("task.ops: give at least one operator")
        bad = [o for o in self.ops if o not in _OPS]
        if bad:
            raise ValueError(f"task.ops: unknown operator(s) {bad}; choose from {sorted(_OPS)}")
        if self.min_operand < 0:
            raise ValueError(f"task.min_operand={self.min_operand} must be >= 0")
        if self.max_operand < self.min_operand:
            raise ValueError(f"task.max_operand={self.max_operand} must be >= task.min_operand={self.min_operand}")

    @property
    def charset(self) -> frozenset[str]:
        """Every character a prompt or an answer can contain."""
        return frozenset("0123456789=" + "".join(self.ops))  # a negative answer needs '-', i.e. a '-' op

    @property
    def max_prompt_chars(self) -> int:
        return 2 * len(str(self.max_operand)) + 2

    @property
    def max_answer_chars(self) -> int:
        hi, lo = self.max_operand, self.min_operand
        cands = [0]
        for o in self.ops:
            cands += [_OPS[o](a, b) for a in (lo, hi) for b in (lo, hi)]
        return max(len(str(c)) for c in cands)

    def score_response(self, response: str, problem: Problem) -> float:
        """The reward of `response` to `problem` (`score`)."""
        return score(response, problem.answer)

    def problems(self, stream: Stream | int, index: int, n: int, *, round_: int = 0) -> list[Problem]:
        """The `n` problems of batch `index` of `stream` (deterministic). `round_` > 0 draws the extra
        batches of DAPO dynamic sampling for the same step (round 0 is the step's own batch)."""
        if n < 0 or index < 0 or round_ < 0:
            raise ValueError(f"problems: n={n}, index={index} and round_={round_} must be >= 0")
        rng = np.random.default_rng([self.seed, int(stream), index] + ([round_] if round_ else []))
        a = rng.integers(self.min_operand, self.max_operand + 1, size=n)
        b = rng.integers(self.min_operand, self.max_operand + 1, size=n)
        op = rng.integers(0, len(self.ops), size=n)
        out = []
        for x, y, k in zip(a.tolist(), b.tolist(), op.tolist(), strict=True):
            o = self.ops[k]
            out.append(Problem(prompt=f"{x}{o}{y}=", answer=str(_OPS[o](x, y))))
        return out


INSTRUCTION = "Compute the result. Reply with the number only."
"""Put before each problem in the verl rows of the task (a chat model needs to be told the format)."""


def chat_messages(p: Problem) -> list[dict[str, str]]:
    """The chat messages of `p` in a verl row (and in ``jetrl warmup --format chat``): one user turn."""
    from jetrl.tasks.rows import chat_prompt

    return chat_prompt(f"{INSTRUCTION} {p.prompt}")


def verl_rows(task: ArithmeticTask, split: str, n: int, *, batch: int = 256) -> list[dict]:
    """`n` problems of the task as verl RL rows (``data_source = DATA_SOURCE``): ``train`` draws the RL
    stream, ``test`` the evaluation stream, `batch` problems per stream index (deterministic)."""
    from jetrl.tasks.rows import verl_row

    streams = {"train": Stream.RL, "test": Stream.EVAL}
    if split not in streams:
        raise ValueError(f"arithmetic split {split!r}: choose from {sorted(streams)}")
    if n <= 0 or batch <= 0:
        raise ValueError(f"arithmetic rows: n={n} and batch={batch} must be > 0")
    problems: list[Problem] = []
    index = 0
    while len(problems) < n:
        problems += task.problems(streams[split], index, min(batch, n - len(problems)))
        index += 1
    return [
        verl_row(
            data_source=DATA_SOURCE,
            prompt=chat_messages(p),
            ability="arithmetic",
            ground_truth=p.answer,
            index=i,
            split=split,
            extra={"problem": p.prompt},
        )
        for i, p in enumerate(problems)
    ]
