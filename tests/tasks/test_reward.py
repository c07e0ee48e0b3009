"""The rewards of `jetrl.tasks`: GSM8K's strict / flexible extraction, MATH / DeepMath through math-verify,
dispatch on data_source, and loading `jetrl/tasks/reward.py` as a standalone file the way verl's
``custom_reward_function.path`` loader does (``importlib.util.spec_from_file_location``)."""

from __future__ import annotations

import importlib.util
import threading
from pathlib import Path

import pytest

import jetrl.tasks
from jetrl.tasks import gsm8k
from jetrl.tasks import math as math_task
from jetrl.tasks.reward import SCORERS, UnknownDataSource, compute_score

REWARD_FILE = Path(jetrl.tasks.__file__).parent / "reward.py"

GSM8K_CASES = [
    # (response, ground truth, strict score, flexible score)
    ("3 + 4 = 7\n#### 7", "7", 1.0, 1.0),
    ("so the total is 1,000 dollars.\n#### 1,000", "1000", 1.0, 1.0),
    ("#### 72.00", "72", 1.0, 1.0),
    ("#### -5", "-5", 1.0, 1.0),
    ("The answer is 72.", "72", 0.0, 1.0),  # no '####': strict refuses the format, flexible takes the last number
    ("#### 71", "72", 0.0, 0.0),
    ("I think 72 then 73", "72", 0.0, 0.0),  # flexible takes the LAST number
    ("#### 72\nwait, it is #### 73", "72", 0.0, 0.0),  # strict takes the LAST '####'
    ("no numbers at all . ,", "72", 0.0, 0.0),
    ("x" * 1000 + "#### 72", "72", 1.0, 1.0),
    ("#### 72" + " filler" * 100, "72", 0.0, 0.0),  # the answer lies before the last CLIP_CHARS characters
]


@pytest.mark.parametrize("response, gold, strict, flexible", GSM8K_CASES, ids=[f"gsm8k{i}" for i in range(11)])
def test_gsm8k_strict_and_flexible(response, gold, strict, flexible):
    s = compute_score("openai/gsm8k", response, gold)
    f = compute_score("openai/gsm8k", response, gold, method="flexible")
    assert (s["score"], s["acc"]) == (strict, strict), f"strict {response[-60:]!r} vs {gold}: {s}"
    assert (f["score"], f["acc"]) == (flexible, flexible), f"flexible {response[-60:]!r} vs {gold}: {f}"


def test_gsm8k_format_score_and_extraction():
    assert compute_score("openai/gsm8k", "#### 71", "72", format_score=0.1) == {"score": 0.1, "acc": 0.0}
    assert compute_score("openai/gsm8k", "no answer", "72", format_score=0.1) == {"score": 0.0, "acc": 0.0}
    assert gsm8k.extract_answer("a 1,234 b") is None
    assert gsm8k.extract_answer("a 1,234 b", "flexible") == "1234"
    with pytest.raises(ValueError, match="'loose'"):
        gsm8k.extract_answer("#### 1", "loose")
    with pytest.raises(ValueError, match="not a number"):
        compute_score("openai/gsm8k", "#### 1", "one")


MATH_CASES = [
    # (response, ground truth, correct)
    ("We get $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}", True),
    ("so $x = \\boxed{0.5}$", "\\dfrac12", True),  # numeric equality of different spellings
    ("\\boxed{\\sqrt{8}}", "2\\sqrt{2}", True),  # symbolic equality
    ("the roots are $\\boxed{3, -2}$", "-2, 3", True),  # sets, any order
    ("\\boxed{(1, 2]}", "(1,2]", True),  # intervals
    ("the answer is $x = 0.5$", "\\frac{1}{2}", True),  # no box: LaTeX / expression extraction
    ("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}", False),
    ("first \\boxed{7}, finally \\boxed{8}", "8", True),  # the last box counts
    ("first \\boxed{8}, finally \\boxed{7}", "8", False),
    ("I cannot solve this.", "8", False),
    ("", "8", False),
]


@pytest.mark.parametrize("source", ["math", "deepmath"])
@pytest.mark.parametrize("response, gold, correct", MATH_CASES, ids=[f"math{i}" for i in range(11)])
def test_math_verify(source, response, gold, correct):
    out = compute_score(source, response, gold)
    want = 1.0 if correct else 0.0
    assert out["score"] == want and out["acc"] == want, f"{source}: {response!r} vs {gold!r}: {out}"


def test_math_word_answers_and_threads():
    assert compute_score("deepmath", "so \\boxed{Yes}", "Yes")["acc"] == 1.0
    assert compute_score("deepmath", "so \\boxed{No}", "Yes")["acc"] == 0.0
    # verl runs the scorer in an executor thread: math-verify's signal-based timeouts must be off there
    result = {}
    t = threading.Thread(target=lambda: result.update(compute_score("math", "\\boxed{\\frac{2}{4}}", "\\frac12")))
    t.start()
    t.join()
    assert result["acc"] == 1.0
    with pytest.raises(ValueError, match="empty"):
        compute_score("math", "\\boxed{1}", "  ")


def test_last_boxed():
    assert math_task.last_boxed("a \\boxed{\\frac{1}{2}} b") == "\\frac{1}{2}"
    assert math_task.last_boxed("\\boxed{1} then \\fbox{ {2} }") == "{2}"
    assert math_task.last_boxed("\\boxed{\\{1, 2\\}}") == "\\{1, 2\\}"
    assert math_task.last_boxed("\\boxed{unclosed") is None
    assert math_task.last_boxed("no box") is None


def test_dispatch_and_aliases():
    assert compute_score("jetrl/arithmetic", " 82\n", "82") == {"score": 1.0, "acc": 1.0}
    assert compute_score("jetrl/arithmetic", "820", "82") == {"score": 0.0, "acc": 0.0}
    assert compute_score("lighteval/MATH", "\\boxed{2}", "2")["acc"] == 1.0
    assert compute_score("zwhe99/DeepMath-103K", "\\boxed{2}", "2")["acc"] == 1.0
    assert set(SCORERS) == {"openai/gsm8k", "math", "deepmath", "jetrl/arithmetic"}
    with pytest.raises(UnknownDataSource, match="'gsm8k_typo'.*known: \\[") as e:
        compute_score("gsm8k_typo", "#### 1", "1")
    assert "openai/gsm8k" in str(e.value)


def _load_as_verl_does(path: Path, name: str = "custom_module_test"):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reward_file_loads_standalone():
    """verl imports custom_reward_function.path as a file, not as a package member."""
    module = _load_as_verl_does(REWARD_FILE)
    assert module.__name__ == "custom_module_test"
    fn = module.compute_score
    # verl calls it with keywords only
    out = fn(data_source="openai/gsm8k", solution_str="#### 5", ground_truth="5", extra_info={"index": 0})
    assert out == {"score": 1.0, "acc": 1.0}
    assert fn(data_source="math", solution_str="\\boxed{x^2}", ground_truth="x^2", extra_info=None)["acc"] == 1.0


def test_reward_files_use_absolute_imports():
    for path in sorted(REWARD_FILE.parent.glob("*.py")):
        text = path.read_text()
        assert "from ." not in text and "import ." not in text, f"{path.name}: relative import"


def test_unboxed_answer_is_read_from_the_tail_only():
    filler = " and so on" * (math_task.NO_BOX_TAIL_CHARS // 10 + 10)
    assert compute_score("math", "we get $x = 3.5$" + filler, "\\frac72")["acc"] == 0.0
    assert compute_score("math", filler + " we get $x = 3.5$", "\\frac72")["acc"] == 1.0
    assert compute_score("math", "\\boxed{3.5}" + filler, "\\frac72")["acc"] == 1.0  # a box is found anywhere
