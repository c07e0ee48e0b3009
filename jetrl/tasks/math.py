"""MATH (Hendrycks et al.; the lighteval release) and DeepMath-103K: competition math graded by math-verify.

Data.

- MATH rows are ``{"problem", "solution", "level", "type"}``; the solution is worked LaTeX whose
  final answer is the last ``\\boxed{...}`` (or ``\\fbox{...}``). The ground truth is that box's
  content (`last_boxed`, brace-balanced). A solution without a box is malformed (`DataError`).
- DeepMath-103K rows (zwhe99/DeepMath-103K) are ``{"question", "final_answer", "difficulty",
  "topic", "r1_solution_1..3"}``; the ground truth is ``final_answer``. The R1 solutions are not
  copied into the parquet (three long traces per row; nothing reads them).

Prompt. The problem, a space, and `INSTRUCTION` (verl's MATH instruction: final answer in
``\\boxed{}``), as one user message; the same for both datasets.

Reward. `compute_score` parses the ground truth (as the content of a ``\\boxed{}``) and the response
with math-verify (the response's last ``\\boxed{}`` when it has one, else LaTeX and plain-expression
extraction from its last `NO_BOX_TAIL_CHARS` characters) and asks
`math_verify.verify` whether they are equal: symbolic and numeric equality, sets, intervals,
matrices -- no hand-written LaTeX normalisation here. ``score`` = ``acc`` = 1.0 when
equal else 0.0. A ground truth that math-verify cannot parse at all (some DeepMath answers are
words) is compared as text with the response's last ``\\boxed{}`` content, whitespace-normalised;
``gold_parsed`` (1.0 / 0.0) in the result says which path graded the row.

Timeouts. math-verify bounds each parse / comparison with ``signal.alarm``, which works only on the
main thread; elsewhere (verl's threaded reward workers) the bounds are off, as math-verify requires.
"""

from __future__ import annotations

import re
import threading
from typing import Any

from jetrl.tasks.rows import DataError, chat_prompt, require_text, verl_row

__all__ = [
    "MATH_SOURCE",
    "DEEPMATH_SOURCE",
    "INSTRUCTION",
    "TIMEOUT_S",
    "NO_BOX_TAIL_CHARS",
    "last_boxed",
    "make_math_row",
    "make_deepmath_row",
    "compute_score",
]

MATH_SOURCE = "math"
"""``data_source`` of MATH rows (Hendrycks MATH, lighteval release)."""
DEEPMATH_SOURCE = "deepmath"
"""``data_source`` of DeepMath-103K rows."""
INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
"""Appended to each problem (verl's MATH instruction)."""
NO_BOX_TAIL_CHARS = 1000
"""A response without a ``\\boxed{}`` is searched for its answer in its last this-many characters only
(the final answer is at the end). Measured on this repo's 2-core CPU host after warm-up: math-verify
takes ~30 ms on a whole 40k-character unboxed response, ~5 ms on its tail; verl's reward threads share
the GIL, so at 8192 responses per DAPO step that is ~4 minutes against ~40 s."""
TIMEOUT_S = 5
"""math-verify's per-parse and per-comparison bound in seconds (main thread only, see module docstring)."""

_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` in `text` (nested braces balanced), or
    None when there is none or its braces never close."""
    starts = [m.end() for m in _BOX.finditer(text)]
    if not starts:
        return None
    i = start = starts[-1]
    depth = 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2  # an escaped character (\{ or \}) does not open or close a group
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[start:i].strip()
        i += 1
    return None


def _prompt(problem: str) -> list[dict[str, str]]:
    return chat_prompt(f"{problem} {INSTRUCTION}")


def make_math_row(raw: dict[str, Any], index: int, split: str, *, where: str) -> dict[str, Any]:
    """One verl row from a MATH row ``{"problem", "solution", ...}``; `where` names the row in errors."""
    problem = require_text(raw, "problem", where)
    solution = require_text(raw, "solution", where)
    gold = last_boxed(solution)
    if not gold:
        raise DataError(f"{where}: solution has no complete \\boxed{{...}} answer: ...{solution[-200:]!r}")
    extra = {k: str(raw[k]) for k in ("level", "type") if raw.get(k) is not None}
    return verl_row(
        data_source=MATH_SOURCE,
        prompt=_prompt(problem),
        ability="math",
        ground_truth=gold,
        index=index,
        split=split,
        extra=extra,
    )


def make_deepmath_row(raw: dict[str, Any], index: int, split: str, *, where: str) -> dict[str, Any]:
    """One verl row from a DeepMath-103K row ``{"question", "final_answer", ...}``."""
    question = require_text(raw, "question", where)
    gold = require_text(raw, "final_answer", where).strip()
    extra = {k: str(raw[k]) for k in ("difficulty", "topic") if raw.get(k) is not None}
    return verl_row(
        data_source=DEEPMATH_SOURCE,
        prompt=_prompt(question),
        ability="math",
        ground_truth=gold,
        index=index,
        split=split,
        extra=extra,
    )


def _squash(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().strip("$").strip()


def compute_score(solution_str: str, ground_truth: str, **_: Any) -> dict[str, float]:
    """``{"score", "acc", "gold_parsed"}`` of one response against a MATH / DeepMath ground truth."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    bound = TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    gold_text = str(ground_truth).strip()
    if not gold_text:
        raise ValueError("math ground_truth is empty")
    gold = parse(
        f"\\boxed{{{gold_text}}}",
        extraction_config=[LatexExtractionConfig()],
        fallback_mode="no_fallback",
        parsing_timeout=bound,
    )
    boxed = last_boxed(solution_str)
    if gold:
        # the last box is the answer (math-verify alone would take the first of several boxes)
        text, configs = (
            (f"\\boxed{{{boxed}}}", [LatexExtractionConfig()])
            if boxed is not None
            else (solution_str[-NO_BOX_TAIL_CHARS:], [LatexExtractionConfig(), ExprExtractionConfig()])
        )
        pred = parse(text, extraction_config=configs, parsing_timeout=bound)
        ok = bool(pred) and verify(gold, pred, timeout_seconds=bound)
    else:
        ok = boxed is not None and _squash(boxed) == _squash(gold_text)
    return {"score": 1.0 if ok else 0.0, "acc": 1.0 if ok else 0.0, "gold_parsed": 1.0 if gold else 0.0}
