"""``jetrl warmup``: the warmed-up tiny checkpoint for other trainers (verl), plain or ChatML."""

from __future__ import annotations

import json

import pytest
import torch

from jetrl.cli import main as jetrl
from jetrl.tasks.arithmetic import ArithmeticTask, Stream, chat_messages
from jetrl.tiny import CharTokenizer
from jetrl.train.warmup import _sft_batch


def test_chat_warmup_writes_a_chatml_checkpoint_that_learned(tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "ckpt"
    assert jetrl(["warmup", "--out", str(out), "--steps", "6", "--batch-size", "8", "--max-operand", "9"]) == 0
    meta = json.loads((out / "warmup.json").read_text())
    assert meta["format"] == "chat" and meta["steps"] == 6 and meta["loss_end"] < meta["loss_start"]
    assert "jetrl warmup: loss" in capsys.readouterr().out
    hf = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert hf.eos_token == "<|im_end|>" and hf.chat_template
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert model.config.vocab_size == len(CharTokenizer(chat=True))
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_chat_warmup_trains_on_the_prompts_verl_renders():
    """The warm-up's prompt ids are the parquet row's messages through the chat template (as verl renders them),
    the target the answer then ``<|im_end|>``."""
    tok, task = CharTokenizer(chat=True), ArithmeticTask(0, 0, 9, ("+",))
    ids, attn, mask = _sft_batch(tok, task, 0, 2)
    p = task.problems(Stream.WARMUP, 0, 2)[0]
    prompt, answer = tok.encode_chat(chat_messages(p)), tok.encode(p.answer, add_bos=False, add_eos=True)
    n = len(prompt) + len(answer)
    assert ids[0, :n].tolist() == prompt + answer and attn[0, :n].all()
    assert mask[0].nonzero().flatten().tolist() == list(range(len(prompt) - 1, n - 1))


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--steps", "0"], "--steps must be > 0"),
        (["--ops", "/"], "/"),
        (["--device", "nodevice"], "nodevice"),
        pytest.param(
            ["--device", "cuda"],
            "no CUDA device",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA"),
        ),
    ],
)
def test_bad_options_are_named(tmp_path, capsys, argv, match):
    assert jetrl(["warmup", "--out", str(tmp_path / "x"), *argv]) == 2
    assert match in capsys.readouterr().err


def test_refuses_a_non_empty_out_dir(tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    assert jetrl(["warmup", "--out", str(tmp_path)]) == 2
    assert "not an empty folder" in capsys.readouterr().err
