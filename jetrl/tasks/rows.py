"""verl's RL parquet row schema, built and checked in one place.

A row of ``$DATA_DIR/<dataset>/{train,test}.parquet`` (what verl's ``RLHFDataset`` reads, and what
``jetrl train`` with ``task.kind=parquet`` reads)::

    data_source   str                       which scorer grades it (`jetrl.tasks.reward` dispatches on it)
    prompt        list[{role, content}]     chat messages; the dataset's instruction is in the user turn
    ability       str                       "math" (verl logs it; no scorer reads it)
    reward_model  {style: "rule", ground_truth: str}
    extra_info    {split: str, index: int, ...dataset fields kept for inspection}

`DataError` is raised for a malformed source row, its message starting with the row's location
(file or dataset, split, row number), so a bad row is found, not silently dropped.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DataError", "chat_prompt", "require_text", "verl_row", "check_row", "ROW_KEYS"]

ROW_KEYS = ("data_source", "prompt", "ability", "reward_model", "extra_info")
"""Top-level columns of a verl RL row, in order."""


class DataError(ValueError):
    """A source row cannot become a verl row (missing / empty field, answer not of the expected form)."""


def chat_prompt(user_text: str) -> list[dict[str, str]]:
    """One user message (verl's recipes put the instruction in the user turn, no system prompt)."""
    return [{"role": "user", "content": user_text}]


def require_text(raw: dict[str, Any], key: str, where: str) -> str:
    """``raw[key]`` as a non-empty string, else `DataError` naming `where` and `key`."""
    if key not in raw or raw[key] is None:
        raise DataError(f"{where}: missing field {key!r} (fields present: {sorted(raw)})")
    value = raw[key]
    if not isinstance(value, str):
        if isinstance(value, int | float) and not isinstance(value, bool):
            value = str(value)
        else:
            raise DataError(f"{where}: field {key!r} must be text, got {type(value).__name__}")
    if not value.strip():
        raise DataError(f"{where}: field {key!r} is empty")
    return value


def verl_row(
    *,
    data_source: str,
    prompt: list[dict[str, str]],
    ability: str,
    ground_truth: str,
    index: int,
    split: str,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A verl RL row; `extra` entries join ``extra_info`` (after ``split`` and ``index``)."""
    extra_info: dict[str, Any] = {"split": split, "index": int(index)}
    extra_info.update(extra or {})
    row = {
        "data_source": data_source,
        "prompt": prompt,
        "ability": ability,
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": extra_info,
    }
    check_row(row, where=f"{data_source} {split} row {index}")
    return row


def check_row(row: dict[str, Any], *, where: str) -> None:
    """Raise `DataError` naming `where` unless `row` has verl's schema with a non-empty prompt and answer."""
    missing = [k for k in ROW_KEYS if k not in row]
    if missing:
        raise DataError(f"{where}: missing column(s) {missing}")
    if not isinstance(row["data_source"], str) or not row["data_source"]:
        raise DataError(f"{where}: data_source must be a non-empty string")
    prompt = row["prompt"]
    if not isinstance(prompt, list | tuple) or not prompt:
        raise DataError(f"{where}: prompt must be a non-empty list of chat messages")
    for i, msg in enumerate(prompt):
        if not isinstance(msg, dict) or set(msg) != {"role", "content"}:
            raise DataError(f"{where}: prompt[{i}] must be {{role, content}}, got {msg!r:.120}")
        if not str(msg["content"]).strip():
            raise DataError(f"{where}: prompt[{i}] ({msg['role']}) is empty")
    gt = (row["reward_model"] or {}).get("ground_truth")
    if not isinstance(gt, str) or not gt.strip():
        raise DataError(f"{where}: reward_model.ground_truth must be a non-empty string, got {gt!r}")
    info = row["extra_info"] or {}
    if "split" not in info or "index" not in info:
        raise DataError(f"{where}: extra_info needs 'split' and 'index'")
