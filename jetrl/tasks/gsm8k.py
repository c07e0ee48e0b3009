"""GSM8K (openai/gsm8k, config ``main``): grade-school word problems whose answer is one number.

Data. A dataset row is ``{"question", "answer"}``; the answer field is a worked solution ending in
``#### <number>`` (e.g. ``"... so she has 72 cookies.\\n#### 72"``). The ground truth is that number
with thousands separators removed (``"1,000"`` -> ``"1000"``). A row whose answer has no ``####``
line, or whose ``####`` is not followed by a number, is malformed: `make_row` raises `DataError`
naming the row, it is never dropped or scored against a made-up answer.

Prompt. verl's GSM8K recipe: the question, a space, and the instruction `INSTRUCTION` (answer after
``####``), as one user chat message.

Reward (`compute_score`), the two extractions of verl's GSM8K scorer:

- ``strict`` (default): the last ``#### <number>`` in the response; a response without one scores
  0 (it did not follow the format).
- ``flexible``: the last number anywhere in the response (lone ``.`` / ``,`` matches skipped).

Both look at the response's last `CLIP_CHARS` characters only (as verl does: the answer is at the
end, and regex work on 16k-token responses is not free). The extracted number matches when it
equals the ground truth as a decimal after removing ``,`` and ``$`` (``"72.00"`` matches ``"72"``;
verl compares the strings, which calls that a miss). ``score`` is 1.0 on a match,
``format_score`` (default 0.0) when a number was extracted but is wrong, 0.0 when none was found;
``acc`` is 1.0 on a match else 0.0.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any

from jetrl.tasks.rows import DataError, chat_prompt, require_text, verl_row

__all__ = [
    "DATA_SOURCE",
    "INSTRUCTION",
    "CLIP_CHARS",
    "extract_answer",
    "ground_truth_from_solution",
    "make_row",
    "compute_score",
]

DATA_SOURCE = "openai/gsm8k"
"""``data_source`` of GSM8K rows (the HF dataset id)."""
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
"""Appended to each question (verl's GSM8K instruction)."""
CLIP_CHARS = 300
"""Extraction reads only this many trailing characters of a response."""

_NUMBER = r"-?[0-9.,]+"
_STRICT = re.compile(r"#### (" + _NUMBER + ")")
_FLEXIBLE = re.compile("(" + _NUMBER + ")")
_GOLD = re.compile(r"####\s*(\S+)")


def _to_decimal(text: str) -> Decimal | None:
    cleaned = text.replace(",", "").replace("$", "").strip()
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def extract_answer(response: str, method: str = "strict") -> str | None:
    """The answer string the response commits to (commas and ``$`` removed), or None."""
    if method not in ("strict", "flexible"):
        raise ValueError(f"gsm8k extraction method {method!r}: choose 'strict' or 'flexible'")
    tail = response[-CLIP_CHARS:]
    if method == "strict":
        found = _STRICT.findall(tail)
        return found[-1].replace(",", "").replace("$", "") if found else None
    for cand in reversed(_FLEXIBLE.findall(tail)):
        if cand.strip(".,"):
            return cand.replace(",", "").replace("$", "")
    return None


def ground_truth_from_solution(solution: str, *, where: str = "row") -> str:
    """The number after the last ``####`` of a dataset answer field, without separators.
    Raises `DataError` naming `where` when there is no ``####`` or it is not followed by a number."""
    found = _GOLD.findall(solution or "")
    if not found:
        raise DataError(f"{where}: answer has no '#### <number>' line: {solution!r:.200}")
    gold = found[-1].replace(",", "").replace("$", "")
    if _to_decimal(gold) is None:
        raise DataError(f"{where}: answer after '####' is not a number: {found[-1]!r}")
    return gold


def make_row(raw: dict[str, Any], index: int, split: str, *, where: str) -> dict[str, Any]:
    """One verl row from a dataset row ``{"question", "answer"}``; `where` names the row in errors."""
    question = require_text(raw, "question", where)
    gold = ground_truth_from_solution(require_text(raw, "answer", where), where=where)
    return verl_row(
        data_source=DATA_SOURCE,
        prompt=chat_prompt(f"{question} {INSTRUCTION}"),
        ability="math",
        ground_truth=gold,
        index=index,
        split=split,
        extra={"question": question, "answer": raw["answer"]},
    )


def compute_score(
    solution_str: str, ground_truth: str, *, method: str = "strict", format_score: float = 0.0, **_: Any
) -> dict[str, float]:
    """``{"score", "acc"}`` of one response (see the module docstring)."""
    gold = _to_decimal(str(ground_truth))
    if gold is None:
        raise ValueError(f"gsm8k ground_truth {ground_truth!r} is not a number")
    answer = extract_answer(solution_str, method)
    if answer is None:
        return {"score": 0.0, "acc": 0.0}
    ok = _to_decimal(answer) == gold
    return {"score": 1.0 if ok else float(format_score), "acc": 1.0 if ok else 0.0}
