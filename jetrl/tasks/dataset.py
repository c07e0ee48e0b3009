"""A task read from verl RL parquet, for the local trainer (``jetrl train`` with ``task.name: parquet``).

The same ``{train,test}.parquet`` files that ``scripts/data/*.py`` write for verl: each row's ``prompt``
(chat messages) is rendered by the trainer with the model's chat template, its response is graded by
`jetrl.tasks.reward` for the row's ``data_source`` -- the scorer the verl path uses.

Data order mirrors `jetrl.tasks.arithmetic.ArithmeticTask`: the RL prompts of step ``index`` (and of
DAPO's extra generation rounds ``round_``) are ``n`` distinct train rows drawn by a generator seeded
with ``(seed, stream, index, round_)``, a pure function of those numbers, so a resumed run draws what
the killed one would have. Evaluation takes the first ``n`` rows of the validation file. Every row is
checked when the files are read: a row without a scorer raises naming the file, the row and the
``data_source``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jetrl.tasks.arithmetic import Problem, Stream
from jetrl.tasks.parquet import read_parquet
from jetrl.tasks.reward import UnknownDataSource, compute_score, scorer_for
from jetrl.tasks.rows import DataError

__all__ = ["ParquetTask"]


class ParquetTask:
    """Problems from a train and a validation parquet (verl's RL schema), scored by `jetrl.tasks.reward`."""

    def __init__(self, train_file: str | Path, val_file: str | Path, *, seed: int = 0):
        self.seed = seed
        self.train_file, self.val_file = Path(train_file).expanduser(), Path(val_file).expanduser()
        self.train = [self._problem(r, self.train_file, i) for i, r in enumerate(read_parquet(self.train_file))]
        self.val = [self._problem(r, self.val_file, i) for i, r in enumerate(read_parquet(self.val_file))]

    @staticmethod
    def _problem(row: dict, path: Path, i: int) -> Problem:
        try:
            scorer_for(row["data_source"])
        except UnknownDataSource as e:
            raise DataError(f"{path} row {i}: {e}") from None
        messages = tuple((m["role"], m["content"]) for m in row["prompt"])
        return Problem(
            prompt=messages[-1][1],
            answer=row["reward_model"]["ground_truth"],
            data_source=row["data_source"],
            messages=messages,
        )

    def score_response(self, response: str, problem: Problem) -> float:
        """``score`` of `jetrl.tasks.reward.compute_score` for the problem's data source."""
        return compute_score(problem.data_source, response, problem.answer)["score"]

    def problems(self, stream: Stream | int, index: int, n: int, *, round_: int = 0) -> list[Problem]:
        """`n` problems: distinct seeded train rows for batch `index` (the RL / warm-up streams), the first
        `n` validation rows for `Stream.EVAL`."""
        if n < 0 or index < 0 or round_ < 0:
            raise ValueError(f"problems: n={n}, index={index} and round_={round_} must be >= 0")
        if int(stream) == Stream.EVAL:
            if n > len(self.val):
                raise ValueError(f"{self.val_file}: {len(self.val)} rows, fewer than the {n} evaluation prompts asked")
            return self.val[:n]
        if n > len(self.train):
            raise ValueError(f"{self.train_file}: {len(self.train)} rows, fewer than the {n} prompts of a step")
        rng = np.random.default_rng([self.seed, int(stream), index] + ([round_] if round_ else []))
        return [self.train[i] for i in rng.choice(len(self.train), size=n, replace=False).tolist()]
