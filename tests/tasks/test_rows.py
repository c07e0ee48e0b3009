"""Source rows -> verl rows: each dataset's row builder, the schema check, and malformed rows (a clear
error naming the row; with skip_malformed, left out and counted, never silently dropped)."""

from __future__ import annotations

import json

import pytest

from jetrl.tasks import arithmetic, gsm8k
from jetrl.tasks import math as math_task
from jetrl.tasks.parquet import DATASETS, build_split, prepare, read_local, read_parquet, split_files, write_parquet
from jetrl.tasks.rows import DataError, check_row

GSM8K_RAW = {"question": "Ann has 3 apples and buys 1,000 more. How many?", "answer": "3 + 1000 = 1003\n#### 1,003"}
MATH_RAW = {
    "problem": "What is $\\frac{1}{2} + \\frac{1}{4}$?",
    "solution": "We add: $\\frac{2}{4} + \\frac{1}{4} = \\boxed{\\frac{3}{4}}$.",
    "level": "Level 1",
    "type": "Prealgebra",
}
DEEPMATH_RAW = {
    "question": "Evaluate $\\lim_{x\\to 0} \\sin(x)/x$.",
    "final_answer": "1",
    "difficulty": 4.0,
    "topic": "Calculus",
    "r1_solution_1": "long trace",
}


def test_gsm8k_row():
    row = gsm8k.make_row(GSM8K_RAW, 7, "train", where="x")
    assert row["data_source"] == "openai/gsm8k" and row["ability"] == "math"
    assert row["prompt"] == [{"role": "user", "content": GSM8K_RAW["question"] + " " + gsm8k.INSTRUCTION}]
    assert row["reward_model"] == {"style": "rule", "ground_truth": "1003"}
    assert row["extra_info"]["split"] == "train" and row["extra_info"]["index"] == 7


def test_math_and_deepmath_rows():
    row = math_task.make_math_row(MATH_RAW, 0, "test", where="x")
    assert row["data_source"] == "math" and row["reward_model"]["ground_truth"] == "\\frac{3}{4}"
    assert row["prompt"][0]["content"].endswith(math_task.INSTRUCTION)
    assert row["extra_info"] == {"split": "test", "index": 0, "level": "Level 1", "type": "Prealgebra"}
    row = math_task.make_deepmath_row(DEEPMATH_RAW, 1, "train", where="x")
    assert row["data_source"] == "deepmath" and row["reward_model"]["ground_truth"] == "1"
    assert "r1_solution_1" not in row["extra_info"] and row["extra_info"]["difficulty"] == "4.0"


MALFORMED = [
    ("gsm8k", {"question": "q?"}, "missing field 'answer'"),
    ("gsm8k", {"question": "   ", "answer": "#### 3"}, "field 'question' is empty"),
    ("gsm8k", {"question": "q?", "answer": "it is three"}, "no '#### <number>' line"),
    ("gsm8k", {"question": "q?", "answer": "so\n#### three"}, "not a number: 'three'"),
    ("math", {"problem": "p", "solution": "the answer is 3"}, "no complete \\\\boxed"),
    ("math", {"problem": "p", "solution": "\\boxed{3"}, "no complete \\\\boxed"),
    ("math", {"problem": "", "solution": "\\boxed{3}"}, "field 'problem' is empty"),
    ("deepmath", {"question": "q", "final_answer": ""}, "field 'final_answer' is empty"),
    ("deepmath", {"question": "q", "final_answer": None}, "missing field 'final_answer'"),
    ("deepmath", {"question": ["q"], "final_answer": "1"}, "field 'question' must be text"),
]


@pytest.mark.parametrize("dataset, raw, match", MALFORMED, ids=[f"{d}-{i}" for i, (d, _, _) in enumerate(MALFORMED)])
def test_malformed_row_names_the_row(dataset, raw, match):
    with pytest.raises(DataError, match=f"^data/train.parquet row 12: .*{match}"):
        DATASETS[dataset].make_row(raw, 0, "train", where="data/train.parquet row 12")


def test_build_split_counts_malformed_rows():
    spec = DATASETS["gsm8k"]
    bad = {"question": "q?", "answer": "none"}
    records = [("f row 0", GSM8K_RAW), ("f row 1", bad), ("f row 2", GSM8K_RAW), ("f row 3", {"answer": "#### 1"})]
    with pytest.raises(DataError, match=r"gsm8k train: 2 malformed row\(s\) of 4") as e:
        build_split(spec, records, "train")
    assert "f row 1: answer has no" in str(e.value) and "f row 3: missing field 'question'" in str(e.value)
    rows, skipped = build_split(spec, records, "train", skip_malformed=True)
    assert [r["extra_info"]["index"] for r in rows] == [0, 1]  # output positions stay dense
    assert [r["extra_info"]["source"] for r in rows] == ["f row 0", "f row 2"]
    assert len(skipped) == 2 and skipped[0].startswith("f row 1")


def test_check_row_rejects_bad_schema():
    row = gsm8k.make_row(GSM8K_RAW, 0, "train", where="x")
    check_row(row, where="ok")
    for mutate, match in [
        (lambda r: r.pop("ability"), "missing column"),
        (lambda r: r.update(prompt=[]), "non-empty list"),
        (lambda r: r.update(prompt=[{"role": "user", "content": " "}]), r"prompt\[0\] \(user\) is empty"),
        (lambda r: r["reward_model"].update(ground_truth=""), "ground_truth"),
        (lambda r: r["extra_info"].pop("index"), "extra_info needs"),
    ]:
        bad = json.loads(json.dumps(row))
        mutate(bad)
        with pytest.raises(DataError, match=match):
            check_row(bad, where="t.parquet row 4")


def test_local_layouts_and_roundtrip(tmp_path):
    """An HF parquet snapshot, jsonl files and the Hendrycks json tree are all found per split."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    snap = tmp_path / "gsm8k"
    (snap / "main").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist([GSM8K_RAW] * 3), snap / "main" / "train-00000-of-00001.parquet")
    (snap / "main" / "test.jsonl").write_text(json.dumps(GSM8K_RAW) + "\n\n" + json.dumps(GSM8K_RAW) + "\n")
    assert [p.name for p in split_files(snap, "train")] == ["train-00000-of-00001.parquet"]
    assert [w for w, _ in read_local(snap, "test")] == ["main/test.jsonl row 0", "main/test.jsonl row 1"]
    summary = prepare(DATASETS["gsm8k"], tmp_path / "out", local_dir=snap)
    assert {k: v["rows"] for k, v in summary["splits"].items()} == {"train": 3, "test": 2}
    rows = read_parquet(tmp_path / "out" / "train.parquet")
    assert rows[2]["reward_model"]["ground_truth"] == "1003" and rows[2]["extra_info"]["index"] == 2

    tree = tmp_path / "MATH"
    for split in ("train", "test"):
        for subject in ("algebra", "geometry"):
            (tree / split / subject).mkdir(parents=True)
            (tree / split / subject / "1.json").write_text(json.dumps(MATH_RAW))
    assert len(read_local(tree, "test")) == 2
    with pytest.raises(DataError, match="no .* file for split 'validation'.*seen: \\['test/algebra/1.json'"):
        split_files(tree, "validation")


def test_deepmath_holds_out_a_seeded_test_split(tmp_path):
    records = [(f"r {i}", dict(DEEPMATH_RAW, final_answer=str(i))) for i in range(20)]
    spec = DATASETS["deepmath"]
    one = prepare(spec, tmp_path / "a", test_size=5, seed=3, reader=lambda s, split: records)
    prepare(spec, tmp_path / "b", test_size=5, seed=3, reader=lambda s, split: records)
    assert one["splits"]["train"]["rows"] == 15 and one["splits"]["test"]["rows"] == 5
    test_a = [r["reward_model"]["ground_truth"] for r in read_parquet(tmp_path / "a" / "test.parquet")]
    test_b = [r["reward_model"]["ground_truth"] for r in read_parquet(tmp_path / "b" / "test.parquet")]
    train_a = [r["reward_model"]["ground_truth"] for r in read_parquet(tmp_path / "a" / "train.parquet")]
    assert test_a == test_b and not set(test_a) & set(train_a) and len(set(test_a + train_a)) == 20
    with pytest.raises(DataError, match="--test-size 20 must be in"):
        prepare(spec, tmp_path / "c", test_size=20, reader=lambda s, split: records)


def test_arithmetic_rows_score_with_the_reward(tmp_path):
    from jetrl.tasks.reward import compute_score

    task = arithmetic.ArithmeticTask(seed=1, ops=("+", "*"))
    rows = arithmetic.verl_rows(task, "train", 300, batch=128)
    assert len(rows) == 300 and rows[0]["data_source"] == "jetrl/arithmetic"
    assert rows[:128] == arithmetic.verl_rows(task, "train", 128)  # deterministic, batch by batch
    assert rows[0]["prompt"] != arithmetic.verl_rows(task, "test", 1)[0]["prompt"]
    write_parquet(rows, tmp_path / "train.parquet")
    for r in read_parquet(tmp_path / "train.parquet")[:20]:
        gt = r["reward_model"]["ground_truth"]
        assert str(eval(r["extra_info"]["problem"][:-1])) == gt
        assert compute_score(r["data_source"], gt, gt)["score"] == 1.0
    with pytest.raises(DataError, match="no rows"):
        write_parquet([], tmp_path / "empty.parquet")


def test_read_hub_asks_datasets_for_the_split(monkeypatch, tmp_path):
    """The online path (no network here): `read_hub` calls datasets.load_dataset(path, name, split=...)."""
    datasets = pytest.importorskip("datasets")
    from jetrl.tasks.parquet import read_hub

    calls = []

    def fake_load_dataset(path, name=None, split=None):
        calls.append((path, name, split))
        return datasets.Dataset.from_list([GSM8K_RAW, GSM8K_RAW])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    records = read_hub(DATASETS["gsm8k"], "test")
    assert calls == [("openai/gsm8k", "main", "test")]
    assert [w for w, _ in records] == ["openai/gsm8k test row 0", "openai/gsm8k test row 1"]
    summary = prepare(DATASETS["gsm8k"], tmp_path)  # no local_dir: the hub reader
    assert summary["splits"]["train"]["rows"] == 2 and calls[-1] == ("openai/gsm8k", "main", "test")


def test_read_hub_offline_says_use_local_dir(monkeypatch):
    datasets = pytest.importorskip("datasets")
    from jetrl.tasks.parquet import read_hub

    def offline(*a, **k):
        raise ConnectionError("Couldn't reach 'zwhe99/DeepMath-103K' on the Hub")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError, match="zwhe99/DeepMath-103K: cannot read split 'train' .*pass --local-dir"):
        read_hub(DATASETS["deepmath"], "train")
