from __future__ import annotations

import pytest

from jetrl.train.task import ArithmeticTask, Stream, compute_score, score


def test_problems_are_correct_and_deterministic():
    t = ArithmeticTask(seed=3, min_operand=0, max_operand=99, ops=("+", "-", "*"))
    ps = t.problems(Stream.RL, 5, 64)
    assert ps == t.problems(Stream.RL, 5, 64)
    assert ps != t.problems(Stream.RL, 6, 64)
    assert ps != ArithmeticTask(seed=4, max_operand=99, ops=("+", "-", "*")).problems(Stream.RL, 5, 64)
    for p in ps:
        assert p.prompt.endswith("=")
        assert str(eval(p.prompt[:-1])) == p.answer  # the prompt is a Python expression of two ints
        assert set(p.prompt + p.answer) <= t.charset
        assert len(p.prompt) <= t.max_prompt_chars and len(p.answer) <= t.max_answer_chars


def test_streams_differ():
    t = ArithmeticTask(seed=0)
    assert t.problems(Stream.WARMUP, 0, 32) != t.problems(Stream.RL, 0, 32)


def test_score():
    assert score("82", "82") == 1.0
    assert score(" 82\n", "82") == 1.0
    assert score("820", "82") == 0.0
    assert score("", "82") == 0.0
    assert compute_score("arith", "7", "7") == 1.0


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"ops": ("/",)}, "task.ops"),
        ({"min_operand": -1}, "task.min_operand"),
        ({"max_operand": -5}, "task.max_operand"),
    ],
)
def test_bad_task_names_field(kw, field):
    with pytest.raises(ValueError, match=field):
        ArithmeticTask(**kw)
