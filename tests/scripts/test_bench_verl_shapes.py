"""bench_verl_shapes' CPU parts: the data it feeds each recipe, the command it runs, the recipes' dry runs on
each 8B-class shape's config, and verl's tokenization of the padded chat tokenizer per model type."""

from __future__ import annotations

import json

import pytest
from scripts_cases import load_script

from jetrl.tasks.parquet import read_parquet
from jetrl.tasks.reward import compute_score
from jetrl.tiny import CharTokenizer


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_verl_shapes")


@pytest.mark.parametrize("dataset", ["gsm8k", "math"])
def test_data_goes_through_the_recipe_s_data_script_and_its_reward_grades_it(bench, tmp_path, dataset):
    out = bench.make_data(dataset, tmp_path)
    for split, n in bench.ROWS.items():
        rows = read_parquet(out / f"{split}.parquet")
        assert len(rows) == n and {r["data_source"] for r in rows} == {rows[0]["data_source"]}
        for r in rows[:5]:
            gold = r["reward_model"]["ground_truth"]
            right = f"#### {gold}" if dataset == "gsm8k" else f"\\boxed{{{gold}}}"
            wrong = f"#### {int(gold) + 1}" if dataset == "gsm8k" else f"\\boxed{{{int(gold) + 1}}}"
            score = compute_score(r["data_source"], right, gold)
            assert (score["score"] if isinstance(score, dict) else score) == 1.0, r
            score = compute_score(r["data_source"], wrong, gold)
            assert (score["score"] if isinstance(score, dict) else score) == 0.0, r
    assert bench.make_data(dataset, tmp_path) == out  # made once


def test_command_is_the_model_s_recipe_with_its_gpus_and_short_responses(bench, tmp_path):
    args = bench.parse_args(["--out", str(tmp_path / "s.json"), "--response-len", "128", "--", "trainer.x=1"])
    argv, env, command = bench.shape_command(args, "qwen3-8b-base", tmp_path / "m", tmp_path / "q.jsonl")
    assert argv[1].endswith("recipes/qwen3-8b-base_math.sh")
    assert "algorithm.filter_groups.enable=False" in argv  # a DAPO recipe: all-zero groups would all be filtered
    assert argv[-1] == "trainer.x=1"
    assert (env["NGPUS"], env["ROLLOUT_TP"], env["RESPONSE_LEN"], env["RECIPE"]) == ("1", "1", "128", "jetrl-unified")
    assert "RESPONSE_LEN=128" in command and "qwen3-8b-base_math.sh" in command
    argv, _, _ = bench.shape_command(args, "llama3.1-8b", tmp_path / "m", tmp_path / "l.jsonl")
    assert argv[1].endswith("recipes/llama3.1-8b_gsm8k.sh") and "algorithm.filter_groups.enable=False" not in argv
    args = bench.parse_args(["--out", str(tmp_path / "s.json"), "--ngpus", "2", "--tp", "2"])
    _, env, command = bench.shape_command(args, "llama3.1-8b", tmp_path / "m", tmp_path / "l.jsonl")
    assert (env["NGPUS"], env["ROLLOUT_TP"]) == ("2", "2") and "NGPUS=2 ROLLOUT_TP=2" in command


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--shapes", "gpt2"], "gpt2"),
        (["--layers", "40", "--shapes", "llama3.1-8b"], "has 32"),
        (["--steps", "0"], "--steps"),
        (["--ngpus", "2", "--tp", "4"], "tp divides ngpus"),
        (["--tp", "0"], "both >= 1"),
    ],
)
def test_bad_options(bench, tmp_path, capsys, argv, match):
    with pytest.raises(SystemExit):
        bench.parse_args(["--out", str(tmp_path / "o.json"), *argv])
    assert match in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("gpus", [1, 2])
def test_dry_run_validates_a_dapo_recipe_on_the_shape_s_config(bench, tmp_path, monkeypatch, gpus):
    pytest.importorskip("verl", reason="the recipes' dry run is python -m jetrl.verl")
    # the recipes run in plain processes: without the verl tests' CPU platform (registered in this process only)
    monkeypatch.delenv("VERL_PLATFORM", raising=False)
    out = tmp_path / "s.json"
    rc = bench.main(
        ["--dry-run", "--shapes", "qwen3-8b-base", "--layers", "2", "--out", str(out), "--work", str(tmp_path / "w"),
         "--ngpus", str(gpus), "--tp", str(gpus)]
    )  # fmt: skip
    (run,) = json.loads(out.read_text())["runs"]
    assert rc == 0, run.get("log_tail")
    assert run["dry_run"] and (run["layers"], run["layers_of_the_model"]) == (2, 36)
    log = (tmp_path / "s-logs" / "qwen3-8b-base.log").read_text()
    assert log.strip().splitlines()[-1].startswith("jetrl.verl dry run: configuration valid")
    assert f"n_gpus_per_node: {gpus}" in log and "max_response_length: 256" in log
    assert f"tensor_model_parallel_size: {gpus}" in log


@pytest.mark.parametrize(("shape", "builder"), [("llama3.1-8b", "ContinuousTokenBuilder"), ("qwen2.5-7b", "Qwen")])
def test_verl_renders_a_row_of_each_shape_like_encode_chat(tmp_path, shape, builder):
    pytest.importorskip("verl", reason="verl's token builder and dataset are under test")
    from transformers import AutoTokenizer
    from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder

    sm = load_script("shape_model")
    small = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 2, "num_key_value_heads": 1}
    path = sm.write_shape_model(tmp_path / shape, shape, 1, chat=True, device="cpu", vocab_size=2048, **small)
    hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model_type = json.loads((path / "config.json").read_text())["model_type"]
    b = create_continuous_token_builder(hf, hf_model_type=model_type)
    assert builder in type(b).__name__
    messages = [{"role": "user", "content": "What is 3 + 4?"}]
    assert b.build_initial_tokens(messages) == CharTokenizer(chat=True, size=2048).encode_chat(messages)


def _shape_result(shape: str, commit: str, error: str | None = None) -> dict:
    summary = {
        "steps": 0 if error else 1,
        "median_time_s": {"step": None if error else 54.1},
        "mismatch/logp_abs_diff_mean (mean over steps)": None if error else 0.13,
        "syncs_digest_checked": 0 if error else 1,
    }
    run = {"shape": shape, "layers": 8, "layers_of_the_model": 32, "wall_s": 300.0, "summary": summary}
    meta = {"device": "GPU", "versions": {}, "date": "d", "commit": commit, "command": f"bench --shapes {shape}"}
    return {**meta, "what": "w", "runs": [run | ({"error": error} if error else {})]}


def test_merge_orders_shapes_keeps_each_call_s_provenance_and_later_files_win(bench, tmp_path, capsys, monkeypatch):
    paths = []
    for i, (shape, commit, error) in enumerate(
        [("qwen3-8b-base", "a", "stopped by SIGTERM"), ("llama3.1-8b", "b", None), ("qwen3-8b-base", "c", None)]
    ):
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps(_shape_result(shape, commit, error)))
    out = tmp_path / "m.json"
    argv = ["--out", str(out), "--merge", *map(str, paths), "--note", "qwen2.5-7b: not run"]
    monkeypatch.setattr("sys.argv", ["bench_verl_shapes.py", *argv])  # what benchmeta records, as from a shell
    assert bench.main(argv) == 0
    m = json.loads(out.read_text())
    assert [(r["shape"], r["meta"]["commit"]) for r in m["runs"]] == [("llama3.1-8b", "b"), ("qwen3-8b-base", "c")]
    assert m["runs"][1]["meta"]["command"] == "bench --shapes qwen3-8b-base" and m["note"] == "qwen2.5-7b: not run"
    assert "--merge" in m["command"] and m["merged_from"] == [str(p) for p in paths]  # the merge's own command
    assert "qwen3-8b-base" in capsys.readouterr().out
    assert bench.main(["--out", str(out), "--merge", str(paths[2]), str(paths[0])]) == 1  # the failed run wins
    assert "FAILED: stopped by SIGTERM" in capsys.readouterr().out
