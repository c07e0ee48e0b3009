"""The reward of every jetrl task, with verl's ``custom_reward_function`` signature.

verl loads it by path::

    custom_reward_function.path=jetrl/tasks/reward.py custom_reward_function.name=compute_score

(verl imports the file as a standalone module, so this file uses absolute imports only; the
``jetrl`` package must be importable in the reward workers, as it is in an editable install), and
``jetrl train`` imports it as `jetrl.tasks.reward`. `compute_score` dispatches on ``data_source``
(`SCORERS`) and returns ``{"score": float, "acc": float, ...}``: verl uses ``score`` as the
sequence reward and logs the other keys per data source. An unknown ``data_source`` raises
`UnknownDataSource` naming it and the known ones -- a row is never scored 0 for lack of a scorer.

Length shaping (DAPO's overlong penalty) is not applied here: it stays with the algorithm
(`jetrl.train.algo` locally, verl's ``reward_model.overlong_buffer`` on the verl path).
Extra keyword arguments (verl's ``custom_reward_function.reward_kwargs``, e.g. ``method=flexible``
for GSM8K) are passed to the task's scorer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jetrl.tasks import arithmetic, gsm8k
from jetrl.tasks import math as math_task

__all__ = ["SCORERS", "ALIASES", "UnknownDataSource", "compute_score", "scorer_for"]


def _arithmetic(solution_str: str, ground_truth: str, **_: Any) -> dict[str, float]:
    s = arithmetic.score(solution_str, str(ground_truth))
    return {"score": s, "acc": s}


SCORERS: dict[str, Callable[..., dict[str, float]]] = {
    gsm8k.DATA_SOURCE: gsm8k.compute_score,
    math_task.MATH_SOURCE: math_task.compute_score,
    math_task.DEEPMATH_SOURCE: math_task.compute_score,
    arithmetic.DATA_SOURCE: _arithmetic,
}
"""``data_source`` written by ``scripts/data/*.py`` -> scorer ``(solution_str, ground_truth, **kw) -> dict``."""

ALIASES: dict[str, str] = {
    "lighteval/MATH": math_task.MATH_SOURCE,
    "DigitalLearningGmbH/MATH-lighteval": math_task.MATH_SOURCE,
    "zwhe99/DeepMath-103K": math_task.DEEPMATH_SOURCE,
}
"""``data_source`` values of parquet made by other tools (verl's own MATH preprocessing) -> ours."""


class UnknownDataSource(KeyError):
    """No scorer is registered for a row's ``data_source``."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


def scorer_for(data_source: str) -> Callable[..., dict[str, float]]:
    """The scorer of `data_source` (after `ALIASES`); raises `UnknownDataSource` naming it."""
    key = ALIASES.get(data_source, data_source)
    try:
        return SCORERS[key]
    except KeyError:
        known = sorted([*SCORERS, *ALIASES])
        raise UnknownDataSource(
            f"jetrl.tasks.reward: no scorer for data_source {data_source!r}; known: {known}"
        ) from None


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict | None = None,
    **kwargs: Any,
) -> dict[str, float]:
    """verl's reward-function signature: ``{"score", "acc", ...}`` of one decoded response."""
    del extra_info  # no scorer reads it; verl passes it (split, index, dataset fields)
    out = scorer_for(data_source)(solution_str, ground_truth, **kwargs)
    return {k: float(v) for k, v in out.items()}
