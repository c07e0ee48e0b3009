"""scripts/data/*.py end to end on fixture files the test writes (no download): verl parquet out, a
malformed row fails the script naming the row, --skip-malformed leaves it out and says how many."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from jetrl.tasks.parquet import read_parquet
from jetrl.testing.subprocess_guard import HANG_GUARD_S

ROOT = Path(__file__).resolve().parents[2]

GSM8K = {"question": "Tom has 2 cats and 3 dogs. How many pets?", "answer": "2 + 3 = 5\n#### 5"}
MATH = {"problem": "Compute $2^3$.", "solution": "$2^3 = \\boxed{8}$", "level": "Level 1", "type": "Algebra"}
DEEPMATH = {"question": "Is 7 prime?", "final_answer": "Yes", "difficulty": 1.0, "topic": "Number Theory"}


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "data" / script), *args],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
        cwd=ROOT,
    )


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.parametrize(
    "script, raw, splits, extra",
    [
        ("gsm8k.py", GSM8K, ("train", "test"), []),
        ("math.py", MATH, ("train", "test"), []),
        ("deepmath.py", DEEPMATH, ("train",), ["--test-size", "2"]),
    ],
)
def test_script_writes_verl_parquet(tmp_path, script, raw, splits, extra):
    for split in splits:
        write_jsonl(tmp_path / "src" / f"{split}.jsonl", [raw] * 6)
    out = tmp_path / "out"
    res = run(script, "--local-dir", str(tmp_path / "src"), "--out-dir", str(out), *extra)
    assert res.returncode == 0, res.stderr
    for split in ("train", "test"):
        rows = read_parquet(out / f"{split}.parquet")
        want = (4 if split == "train" else 2) if script == "deepmath.py" else 6
        assert len(rows) == want, f"{script} {split}: {len(rows)} rows"
        assert all(r["extra_info"]["split"] == split for r in rows)
        assert f"{split}: {want} rows" in res.stdout


def test_malformed_row_fails_then_is_counted(tmp_path):
    bad = {"question": "How many?", "answer": "#### five"}
    write_jsonl(tmp_path / "src" / "train.jsonl", [GSM8K, bad, GSM8K])
    write_jsonl(tmp_path / "src" / "test.jsonl", [GSM8K])
    args = ("--local-dir", str(tmp_path / "src"), "--out-dir", str(tmp_path / "out"))
    res = run("gsm8k.py", *args)
    assert res.returncode == 1
    assert "train.jsonl row 1: answer after '####' is not a number: 'five'" in res.stderr, res.stderr
    assert not (tmp_path / "out" / "train.parquet").exists()
    res = run("gsm8k.py", *args, "--skip-malformed")
    assert res.returncode == 0, res.stderr
    assert "gsm8k train: 2 rows" in res.stdout and "(1 malformed rows left out)" in res.stdout
    assert "skipped: train.jsonl row 1" in res.stderr
    assert len(read_parquet(tmp_path / "out" / "train.parquet")) == 2


def test_missing_split_is_named(tmp_path):
    write_jsonl(tmp_path / "src" / "train.jsonl", [MATH])
    res = run("math.py", "--local-dir", str(tmp_path / "src"), "--out-dir", str(tmp_path / "out"))
    assert res.returncode == 1 and "no .parquet/.jsonl/.json file for split 'test'" in res.stderr, res.stderr


def test_arithmetic_script(tmp_path):
    res = run("arithmetic.py", "--out-dir", str(tmp_path), "--train-rows", "40", "--test-rows", "8", "--ops", "+-")
    assert res.returncode == 0, res.stderr
    rows = read_parquet(tmp_path / "train.parquet")
    assert len(rows) == 40 and len(read_parquet(tmp_path / "test.parquet")) == 8
    assert {r["data_source"] for r in rows} == {"jetrl/arithmetic"}
    res = run("arithmetic.py", "--out-dir", str(tmp_path), "--ops", "/")
    assert res.returncode == 1 and "task.ops" in res.stderr
