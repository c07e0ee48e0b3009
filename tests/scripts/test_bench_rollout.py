"""bench_rollout's pure bookkeeping: the goal ratios it derives and the merge of a separately run mode."""

from __future__ import annotations

import pytest
from scripts_cases import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_rollout")


def _rows(*pairs):
    return [{"batch": b, "input_len": 256, "output_len": 256, "tok_s": t} for b, t in pairs]


def test_summary_ratios_per_batch_and_sync_seconds(bench):
    result = {
        "decode": {"bf16": _rows((64, 100.0), (256, 200.0)), "jetrl_fp8": _rows((64, 125.0), (256, 250.0))},
        "sync": {"jetrl_fp8": {"first": {"seconds": 1.5}, "after_update": {"seconds": 0.5}}},
    }
    s = bench.summarize(result)
    assert s["jetrl_fp8_over_bf16"] == {"64": 1.25, "256": 1.25}
    assert "jetrl_fp8_over_stock_fp8" not in s  # no stock run, no ratio invented
    assert s["sync_jetrl_fp8_first_s"] == 1.5 and s["sync_jetrl_fp8_after_update_s"] == 0.5
    # the trainer-matched engine's cost: its decode over the same recipe on vLLM's own model
    result["decode"]["jetrl_fp8_fused_ops"] = _rows((64, 100.0), (256, 225.0))
    s = bench.summarize(result)
    assert s["jetrl_fp8_fused_ops_over_jetrl_fp8"] == {"64": 0.8, "256": 0.9}
    assert s["jetrl_fp8_fused_ops_over_bf16"] == {"64": 1.0, "256": 1.125}
    assert bench.ENGINE_OPS["jetrl_fp8_fused_ops"] == "fused" and bench.MODES["bf16_hf_ops"] == ("bf16", "jetrl")


def test_merge_takes_only_modes_this_run_lacks(bench):
    mine = {"decode": {"bf16": _rows((64, 1.0))}, "engine_start_s": {"bf16": 3.0}, "sync": {}, "errors": {}}
    earlier = {
        "decode": {"bf16": _rows((64, 9.0)), "stock_fp8": _rows((64, 2.0))},
        "engine_start_s": {"bf16": 9.0, "stock_fp8": 190.0},
        "errors": {"stock_fp8": "boom"},
    }
    assert bench.merge(mine, earlier) == ["stock_fp8"]
    assert mine["decode"]["bf16"][0]["tok_s"] == 1.0  # this run's own numbers win
    assert mine["decode"]["stock_fp8"][0]["tok_s"] == 2.0
    assert mine["engine_start_s"] == {"bf16": 3.0, "stock_fp8": 190.0}
    assert mine["errors"] == {"stock_fp8": "boom"}  # an earlier failure is carried, not hidden
    assert bench.summarize(mine)["stock_fp8_over_bf16"] == {"64": 2.0}


def test_shapes_layers_and_profile_options(bench, monkeypatch, capsys):
    assert bench._shapes("256:16:2048,64:256:256") == [(256, 16, 2048), (64, 256, 256)]
    with pytest.raises(bench.argparse.ArgumentTypeError, match="'256:16' is not batch:input_len:output_len"):
        bench._shapes("256:16")
    assert bench._model_config(bench.argparse.Namespace(layers=8))["num_hidden_layers"] == 8
    assert bench.LLAMA_8B["num_hidden_layers"] == 32  # the published shape is not changed by --layers
    monkeypatch.setattr(bench, "run", lambda args, out: pytest.fail("bad options must fail before any run"))
    for argv, msg in (
        (["--tiny", "--profile"], "not --tiny"),
        (["--layers", "33"], "1 to 32 decoder layers"),
        (["--shapes", "256:16:2048", "--max-model-len", "1024"], "shorter than a --shapes prompt"),
        (["--multiprocess", "--profile"], "--multiprocess and --executor mp run the model in another process"),
        (["--multiprocess", "--sync-modes", "jetrl_fp8"], "no --profile, --host-profile or --sync-modes"),
        (["--executor", "mp", "--host-profile"], "--executor mp run the model in another process"),
        (["--executor", "mp", "--sync-modes", "jetrl_fp8"], "no --profile, --host-profile or --sync-modes"),
    ):
        with pytest.raises(SystemExit):
            bench.main(argv)
        assert msg in capsys.readouterr().err


def test_multiprocess_engines_and_merges(bench, monkeypatch, tmp_path, capsys):
    """--multiprocess starts every engine out of process and syncs none; a merge must match its setting."""
    seen = {}

    def fake_run(args, out):
        seen.update(multiprocess=args.multiprocess, sync_modes=args.sync_modes)
        return {"decode": {}, "sync": {}, "errors": {}, "engine_start_s": {}, "multiprocess": args.multiprocess}

    monkeypatch.setattr(bench, "run", fake_run)
    monkeypatch.setattr(bench, "_table", lambda result: "")
    assert bench.main(["--multiprocess", "--out", str(tmp_path / "r.json")]) == 0
    assert seen == {"multiprocess": True, "sync_modes": []}
    in_process = tmp_path / "old.json"
    in_process.write_text('{"decode": {"bf16": []}}')
    with pytest.raises(SystemExit):
        bench.main(["--multiprocess", "--merge", str(in_process)])
    assert "multiprocess=False, this run with True" in capsys.readouterr().err
    # the engine gets in_process=False
    kw = {}

    class Started(Exception):
        pass

    def fake_create_engine(*a, **k):
        kw.update(k)
        raise Started

    monkeypatch.setattr("jetrl.rollout.adapter.create_engine", fake_create_engine)
    args = bench.argparse.Namespace(tiny=False, gpu_memory_utilization=0.4, enforce_eager=True, capture_sizes=[],
                                    max_model_len=64, backend="auto", multiprocess=True, executor="uni")  # fmt: skip
    with pytest.raises(Started):
        bench._run_mode(args, "bf16", None, "jetrl", tmp_path, 0, [], {})
    assert kw["in_process"] is False
    assert "distributed_executor_backend" not in kw  # vLLM's default executor for one device


def test_mp_executor_engines_and_merges(bench, monkeypatch, tmp_path, capsys):
    """--executor mp asks vLLM for a worker process (verl's setting), syncs nothing, and is recorded; a merge
    with a result of the other executor (or from before the option, which ran 'uni') is refused."""
    seen = {}

    def fake_run(args, out):
        seen.update(executor=args.executor, sync_modes=args.sync_modes)
        return {"decode": {}, "sync": {}, "errors": {}, "engine_start_s": {}, "executor": args.executor}

    monkeypatch.setattr(bench, "run", fake_run)
    monkeypatch.setattr(bench, "_table", lambda result: "")
    assert bench.main(["--executor", "mp", "--out", str(tmp_path / "r.json")]) == 0
    assert seen == {"executor": "mp", "sync_modes": []}
    before_option = tmp_path / "old.json"
    before_option.write_text('{"decode": {"bf16": []}}')
    with pytest.raises(SystemExit):
        bench.main(["--executor", "mp", "--merge", str(before_option)])
    assert "executor=uni, this run with mp" in capsys.readouterr().err
    assert bench.main(["--executor", "mp", "--merge", str(tmp_path / "r.json"), "--out", str(tmp_path / "s.json")]) == 0
    kw = {}

    class Started(Exception):
        pass

    def fake_create_engine(*a, **k):
        kw.update(k)
        raise Started

    monkeypatch.setattr("jetrl.rollout.adapter.create_engine", fake_create_engine)
    args = bench.argparse.Namespace(tiny=False, gpu_memory_utilization=0.4, enforce_eager=True, capture_sizes=[],
                                    max_model_len=64, backend="auto", multiprocess=False, executor="mp")  # fmt: skip
    with pytest.raises(Started):
        bench._run_mode(args, "bf16", None, "jetrl", tmp_path, 0, [], {})
    assert kw["distributed_executor_backend"] == "mp" and kw["in_process"] is True
