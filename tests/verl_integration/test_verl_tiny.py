"""The tiny ChatML model through verl: import order in Ray workers, verl's tokenization, the tiny recipe's dry run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

verl = pytest.importorskip(
    "verl", reason="verl 0.9.1 is installed by `make venv` (third_party/verl-cpu-requirements.txt)"
)

from jetrl.testing.subprocess_guard import HANG_GUARD_S  # noqa: E402
from jetrl.tiny import CharTokenizer, save_tiny_checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

REGISTERED = """
from jetrl.verl.adapter import registered_engine, rollout_class_of
from jetrl.verl.engine import JetrlFSDPEngine
from jetrl.verl.worker import ROLLOUT_NAME
assert registered_engine("language_model", "fsdp2", "cuda", "jetrl") is JetrlFSDPEngine
assert rollout_class_of(ROLLOUT_NAME) is not None
print("registered")
"""


@pytest.mark.parametrize(
    "first", ["jetrl.verl.trainer", "jetrl.verl.worker", "jetrl.verl.adapter", "jetrl.verl.engine", "verl"]
)
def test_plugin_registers_whichever_module_a_worker_imports_first(first):
    """In jetrl's Ray workers ``VERL_USE_EXTERNAL_MODULES=jetrl.verl.plugin`` makes verl's ``__init__`` import
    the plugin. On the H200 the task-runner actor (Ray unpickling `jetrl.verl.trainer`, whose first verl import
    is the adapter's) failed there with a circular import; every first import must end registered."""
    env = {k: v for k, v in os.environ.items() if k != "VERL_PLATFORM"}  # the test platform is this process's
    env["VERL_USE_EXTERNAL_MODULES"] = "jetrl.verl.plugin"
    proc = subprocess.run(
        [sys.executable, "-c", f"import {first}\n{REGISTERED}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("registered"), proc.stderr[-3000:]


def test_verl_tokenizes_the_tiny_chat_model_like_encode_chat(tmp_path):
    """verl picks its rollout token handling by ``model_type`` (qwen3 -> ChatML, which needs ``<|im_end|>`` and a
    one-token newline): the tiny chat tokenizer passes, and verl's dataset renders a parquet row's prompt to
    the ids the warm-up trained on."""
    from transformers import AutoTokenizer
    from verl.utils.dataset.rl_dataset import RLHFDataset
    from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder

    from jetrl.tasks.arithmetic import ArithmeticTask, verl_rows
    from jetrl.tasks.parquet import write_parquet
    from jetrl.verl.launch import compose

    save_tiny_checkpoint(tmp_path / "m", chat=True)
    hf = AutoTokenizer.from_pretrained(tmp_path / "m", local_files_only=True)
    builder = create_continuous_token_builder(hf, hf_model_type="qwen3")
    assert type(builder).__name__ == "QwenContinuousTokenBuilder"
    save_tiny_checkpoint(tmp_path / "plain")
    plain = AutoTokenizer.from_pretrained(tmp_path / "plain", local_files_only=True)
    with pytest.raises(Exception, match="UNK|im_end"):  # the plain tiny tokenizer is what verl refused on the H200
        create_continuous_token_builder(plain, hf_model_type="qwen3")
    rows = verl_rows(ArithmeticTask(0, 0, 9, ("+",)), "train", 4)
    data = write_parquet(rows, tmp_path / "train.parquet")
    cfg = compose([f"data.train_files={data}", "data.max_prompt_length=128"])
    ds = RLHFDataset(data_files=str(data), tokenizer=hf, config=cfg.data, processor=None)
    tok = CharTokenizer(chat=True)
    for i in range(len(rows)):
        messages = ds[i]["raw_prompt"]
        assert builder.build_initial_tokens(messages) == tok.encode_chat(rows[i]["prompt"])


@pytest.mark.slow
def test_tiny_recipe_dry_run_makes_data_and_checkpoint(tmp_path):
    """``DRY_RUN=1 bash recipes/tiny-arith-verl.sh``: writes the parquet and the warmed-up ChatML checkpoint
    (a 2-step warm-up here), then the real ``python -m jetrl.verl`` validates the one-GPU layout and exits 0."""
    env = {
        **{k: v for k, v in os.environ.items() if k != "VERL_PLATFORM"},
        "DRY_RUN": "1",
        "PYTHON": sys.executable,
        "DATA_DIR": str(tmp_path / "data"),
        "WARMUP_STEPS": "2",
        "WARMUP_DEVICE": "cpu",
    }
    proc = subprocess.run(
        ["bash", str(ROOT / "recipes" / "tiny-arith-verl.sh")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("jetrl.verl dry run: configuration valid")
    assert (tmp_path / "data" / "arithmetic" / "train.parquet").is_file()
    assert (tmp_path / "data" / "tiny-arith-chat" / "warmup.json").is_file()
    for key in ("n_gpus_per_node: 1", "attn_implementation: sdpa", "total_training_steps: 5", "num_workers: 2"):
        assert key in proc.stdout
