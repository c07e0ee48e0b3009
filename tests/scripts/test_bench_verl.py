"""bench_verl's CPU parts: verl's file-logger lines -> per-step records, the summary, merging, the table."""

from __future__ import annotations

import json
import os
import shlex
import signal
from pathlib import Path

import pytest
from scripts_cases import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_verl")


def _step(step: int, score: float, dlogp: float, *, digests_equal: float | None = 1.0) -> dict:
    m = {
        "critic/score/mean": score,
        "mismatch/logp_abs_diff_mean": dlogp,
        "mismatch/logp_abs_diff_max": 10 * dlogp,
        "mismatch/is_ratio_max": 1.0 + dlogp,
        "mismatch/logp_equal_share": 0.25 * step,
        "mismatch/tokens": 100 * step,
        "timing_s/gen": 2.0 + step,
        "timing_s/old_log_prob": 1.0,
        "timing_s/update_actor": 3.0,
        "timing_s/update_weights": 0.5,
        "timing_s/step": 7.0,
        "response_length/mean": 3.0,
        "note": "strings are dropped",
    }
    if digests_equal is not None:
        m |= {"sync/digests_equal": digests_equal, "sync/digests": 30, "sync/arrival_digests": 30}
    return m


def _write(path, rows):
    """What verl 0.9.1's file logger writes (``trainer.logger`` with ``file``), through verl's own class."""
    tracking = pytest.importorskip("verl.utils.tracking", reason="verl writes the lines under test")
    import os

    os.environ["VERL_FILE_LOGGER_PATH"] = str(path)
    try:
        logger = tracking.FileLogger("jetrl", "t")
        for step, data in rows:
            logger.log(data, step)
        logger.finish()
    finally:
        del os.environ["VERL_FILE_LOGGER_PATH"]
    return path


def test_file_logger_lines_become_step_records(bench, tmp_path):
    path = _write(
        tmp_path / "r.jsonl",
        [(0, {"val-core/jetrl/arithmetic/reward/mean@1": 0.5}), (1, _step(1, 0.5, 1e-3)), (2, _step(2, 0.7, 2e-3))],
    )
    rows = bench.read_steps(path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert "note" not in rows[1]["metrics"] and rows[1]["metrics"]["response_length/mean"] == 3.0
    rec = bench.step_record(rows[2])
    assert rec["critic/score/mean"] == 0.7 and rec["sync/digests_equal"] == 1.0
    assert rec["time_s"] == {"rollout": 4.0, "old_logp": 1.0, "update": 3.0, "sync": 0.5, "step": 7.0}
    tp = bench.step_record({**rows[2], "metrics": {**rows[2]["metrics"], "sync/tp1/bytes": 7, "sync/tp1/x": 1}})
    assert tp["sync/tp1/bytes"] == 7 and "sync/tp1/x" not in tp  # the per-rank sync metrics under TP, no others
    s = bench.summarize([bench.step_record(r) for r in rows])
    assert (s["steps"], s["reward_first"], s["reward_last"]) == (2, 0.5, 0.7)
    assert s["mismatch/logp_abs_diff_mean (mean over steps)"] == pytest.approx(1.5e-3)
    assert s["mismatch/logp_abs_diff_max (max over steps)"] == pytest.approx(2e-2)
    assert s[bench.EQUAL_KEY] == pytest.approx((0.25 * 100 + 0.5 * 200) / 300)  # token-weighted over the steps
    assert s["median_time_s"]["rollout"] == 3.5
    assert s["digests_equal_every_sync"] and s["syncs_digest_checked"] == 2 and s["digests_compared_total"] == 120
    assert s["val_reward"] == [0.5]


def test_a_sync_without_equal_digests_is_not_hidden(bench, tmp_path):
    path = _write(tmp_path / "r.jsonl", [(1, _step(1, 0.5, 1e-3)), (2, _step(2, 0.5, 1e-3, digests_equal=0.0))])
    s = bench.summarize([bench.step_record(r) for r in bench.read_steps(path)])
    assert not s["digests_equal_every_sync"]
    path = _write(tmp_path / "b.jsonl", [(1, _step(1, 0.5, 1e-3, digests_equal=None))])  # a bf16 run: no digests
    s = bench.summarize([bench.step_record(r) for r in bench.read_steps(path)])
    assert s["syncs_digest_checked"] == 0 and not s["digests_equal_every_sync"]


def test_a_line_that_is_not_verl_s_is_named(bench, tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"step": 1, "data": {}}\n{"oops": 1}\n')
    with pytest.raises(ValueError, match=r"x.jsonl:2"):
        bench.read_steps(path)


def _result(runs, commit):
    return {
        "device": "GPU",
        "versions": {},
        "date": "d",
        "commit": commit,
        "command": "c",
        "what": "w",
        "steps_per_recipe": 5,
        "runs": runs,
    }


def _run(recipe, dlogp, error=None):
    s = {"steps": 5, "reward_first": 0.5, "reward_last": 0.7, "median_time_s": {}, "syncs_digest_checked": 0}
    s |= {
        "mismatch/logp_abs_diff_mean (mean over steps)": dlogp,
        "mismatch/logp_abs_diff_max (max over steps)": dlogp,
        "mismatch/is_ratio_max (max over steps)": 1.0,
    }
    return {"recipe": recipe, "summary": s, **({"error": error} if error else {})}


def test_merge_keeps_each_run_s_provenance_and_later_files_win(bench, tmp_path, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_result([_run("bf16", 4e-3), _run("jetrl-unified", 0.0, "exit code 1")], "aaa")))
    b.write_text(json.dumps(_result([_run("jetrl-unified", 5e-3), _run("naive-fp8-rollout", 5e-2)], "bbb")))
    out = tmp_path / "m.json"
    assert bench.main(["--out", str(out), "--merge", str(a), str(b), "--note", "naive: cut"]) == 0
    m = json.loads(out.read_text())
    assert [r["recipe"] for r in m["runs"]] == ["jetrl-unified", "naive-fp8-rollout", "bf16"]
    assert [r["meta"]["commit"] for r in m["runs"]] == ["bbb", "bbb", "aaa"]
    assert m["unified_over_naive_mean_dlogp"] == pytest.approx(0.1)
    assert m["unified_over_bf16_mean_dlogp"] == pytest.approx(1.25) and m["note"] == "naive: cut"
    printed = capsys.readouterr().out
    assert "unified / naive mean |dlogp|: 0.1" in printed and "unified / bf16 mean |dlogp|: 1.25" in printed
    assert bench.main(["--out", str(out), "--merge", str(a)]) == 1  # a failed run keeps the exit code at 1
    assert "FAILED: exit code 1" in capsys.readouterr().out
    c = tmp_path / "c.json"
    c.write_text(json.dumps(_result([_run("jetrl-unified-hf-ops", 2e-3)], "ccc")))
    assert bench.main(["--out", str(out), "--merge", str(b), str(a), str(c)]) == 1  # a's unified run failed
    m = json.loads(out.read_text())
    assert [r["recipe"] for r in m["runs"]] == ["jetrl-unified", "jetrl-unified-hf-ops", "naive-fp8-rollout", "bf16"]
    assert m["unified_hf_ops_over_naive_mean_dlogp"] == pytest.approx(0.04)
    assert m["unified_hf_ops_over_bf16_mean_dlogp"] == pytest.approx(0.5)
    assert "unified-hf-ops / bf16 mean |dlogp|: 0.5" in capsys.readouterr().out
    assert m["steps_per_recipe"] == 5  # every call asked for 5
    d = tmp_path / "d.json"
    d.write_text(json.dumps(_result([_run("jetrl-unified-strict", 0.0)], "ddd") | {"steps_per_recipe": 3}))
    assert bench.main(["--out", str(out), "--merge", str(c), str(d)]) == 0
    m = json.loads(out.read_text())
    assert "steps_per_recipe" not in m and m["what"] == "w"  # 5 and 3 asked: each run's summary says


def test_the_hf_ops_run_is_jetrl_unified_with_the_trainer_s_ops_in_the_engine(bench):
    args = bench.parse_args(["--out", "x.json", "--recipes", "jetrl-unified-hf-ops"])
    assert args.recipes == ["jetrl-unified-hf-ops"]
    argv, env, shown = bench.recipe_command(args, "jetrl-unified-hf-ops", Path("l"))
    assert (env["RECIPE"], env["ENGINE_OPS"]) == ("jetrl-unified", "hf") and "ENGINE_OPS=hf" in shown
    _, env, shown = bench.recipe_command(args, "jetrl-unified", Path("l"))
    assert (env["RECIPE"], env["ENGINE_OPS"]) == ("jetrl-unified", "vllm") and "ENGINE_OPS" not in shown
    _, env, shown = bench.recipe_command(args, "jetrl-unified-fused-ops", Path("l"))
    assert (env["RECIPE"], env["ENGINE_OPS"]) == ("jetrl-unified", "fused") and "ENGINE_OPS=fused" in shown
    assert env["NUMERICS"] == "hf" and "NUMERICS" not in shown


def test_the_strict_run_is_jetrl_unified_with_hf_ops_and_strict_numerics(bench, monkeypatch):
    monkeypatch.setenv("NUMERICS", "strict")  # the caller's environment does not leak into the other runs
    args = bench.parse_args(["--out", "x.json", "--recipes", "jetrl-unified-strict,bf16"])
    _, env, shown = bench.recipe_command(args, "jetrl-unified-strict", Path("l"))
    assert (env["RECIPE"], env["ENGINE_OPS"], env["NUMERICS"]) == ("jetrl-unified", "hf", "strict")
    assert "NUMERICS=strict" in shown and "ENGINE_OPS=hf" in shown
    _, env, _ = bench.recipe_command(args, "bf16", Path("l"))
    assert (env["RECIPE"], env["NUMERICS"]) == ("bf16", "hf")


@pytest.mark.parametrize(("argv", "match"), [(["--recipes", "fp4"], "fp4"), (["--steps", "0"], "--steps")])
def test_bad_options(bench, tmp_path, capsys, argv, match):
    with pytest.raises(SystemExit):
        bench.parse_args(["--out", str(tmp_path / "o.json"), *argv])
    assert match in capsys.readouterr().err


def _fake_recipe(tmp_path, body: str):
    script = tmp_path / "fake-recipe.sh"
    script.write_text("#!/usr/bin/env bash\n" + body)
    return script


def test_sigterm_stops_the_run_keeps_its_steps_and_writes(bench, tmp_path, monkeypatch, capsys):
    # the recipe logs one step, then the benchmark gets SIGTERM (the device call's time limit) mid-run
    line = json.dumps({"step": 1, "data": _step(1, 0.5, 1e-3)})
    body = f"echo '{line}' > \"$VERL_FILE_LOGGER_PATH\"\necho $$ > {tmp_path}/pid\nkill -TERM $PPID\nexec sleep 300\n"
    monkeypatch.setattr(bench, "RECIPE_SCRIPT", _fake_recipe(tmp_path, body))
    out, before = tmp_path / "r.json", signal.getsignal(signal.SIGTERM)
    assert bench.main(["--out", str(out), "--recipes", "jetrl-unified,bf16"]) == 1
    res = json.loads(out.read_text())
    assert [r["recipe"] for r in res["runs"]] == ["jetrl-unified"]  # the benchmark ends after the stopped run
    run = res["runs"][0]
    assert run["error"] == "stopped by SIGTERM, 1 of 5 steps logged" and run["returncode"] is None
    assert run["summary"]["reward_first"] == 0.5 and run["summary"]["digests_equal_every_sync"]
    pid = int((tmp_path / "pid").read_text())
    with pytest.raises(ProcessLookupError):  # the recipe's process group is gone
        os.kill(pid, 0)
    assert signal.getsignal(signal.SIGTERM) is before  # the benchmark's handler is gone again
    assert "FAILED: stopped by SIGTERM" in capsys.readouterr().out


@pytest.mark.parametrize("where", ["Popen", "record"])
def test_a_sigterm_outside_the_wait_is_not_lost_either(bench, tmp_path, monkeypatch, where):
    # the device's limit can come while Popen is still starting the recipe (CI caught that race: the exception
    # the old handler raised escaped from inside Popen) or while a finished run is recorded
    body = "exec sleep 300\n" if where == "Popen" else "exit 0\n"
    monkeypatch.setattr(bench, "RECIPE_SCRIPT", _fake_recipe(tmp_path, body))
    target = bench.subprocess if where == "Popen" else bench
    real, started = getattr(target, where), []

    def then_sigterm(*args, **kwargs):
        out = real(*args, **kwargs)
        if where == "record" or args[0][:2] == ["bash", str(bench.RECIPE_SCRIPT)]:  # not benchmeta's git calls
            started.append(out)
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    monkeypatch.setattr(target, where, then_sigterm)
    out = tmp_path / "r.json"
    assert bench.main(["--out", str(out), "--recipes", "jetrl-unified,bf16"]) == 1
    runs = json.loads(out.read_text())["runs"]
    want = "stopped by SIGTERM" if where == "Popen" else "exit code 0"
    assert [r["error"] for r in runs] == [f"{want}, 0 of 5 steps logged"]  # written, and no next recipe
    if where == "Popen":
        assert started[0].returncode is not None  # stopped and reaped
        with pytest.raises(ProcessLookupError):  # its process group is gone
            os.killpg(started[0].pid, 0)


def test_recipe_timeout_stops_one_run_and_the_next_runs(bench, tmp_path, monkeypatch):
    body = "if [[ $RECIPE == jetrl-unified ]]; then exec sleep 300; fi\nexit 3\n"
    monkeypatch.setattr(bench, "RECIPE_SCRIPT", _fake_recipe(tmp_path, body))
    out = tmp_path / "r.json"
    assert bench.main(["--out", str(out), "--recipes", "jetrl-unified,bf16", "--recipe-timeout", "1"]) == 1
    runs = json.loads(out.read_text())["runs"]
    assert [r["error"] for r in runs] == [
        "stopped by --recipe-timeout 1 s, 0 of 5 steps logged",
        "exit code 3, 0 of 5 steps logged",
    ]


def test_a_sigterm_while_a_timed_out_run_is_stopped_still_writes_and_ends(bench, tmp_path, monkeypatch):
    # the recipe answers the benchmark's SIGTERM (its --recipe-timeout) by sending SIGTERM back, as the device's
    # limit can while the run is being stopped: the clean-up finishes, the JSON is written, no next recipe runs
    body = "trap 'kill -TERM $PPID' TERM\nsleep 300 &\nwait\n"
    monkeypatch.setattr(bench, "RECIPE_SCRIPT", _fake_recipe(tmp_path, body))
    out, before = tmp_path / "r.json", signal.getsignal(signal.SIGTERM)
    assert bench.main(["--out", str(out), "--recipes", "jetrl-unified,bf16", "--recipe-timeout", "1"]) == 1
    runs = json.loads(out.read_text())["runs"]
    assert [r["error"] for r in runs] == ["stopped by --recipe-timeout 1 s, 0 of 5 steps logged"]
    assert signal.getsignal(signal.SIGTERM) is before


def test_the_naive_baseline_s_overrides_compose_against_verl_and_reach_the_workers(bench):
    pytest.importorskip("verl", reason="needs verl (the verl test environment installs verl==0.9.1)")
    from jetrl.testing.recipes import compose_verl

    cfg = compose_verl([o for o in bench.NAIVE_OVERRIDES if not o.startswith("jetrl.")])
    assert cfg.ray_kwargs.ray_init.runtime_env.env_vars.VLLM_USE_DEEP_GEMM == "0"  # Ray: strings only
    argv, _, shown = bench.recipe_command(bench.parse_args(["--out", "x.json"]), "naive-fp8-rollout", Path("l"))
    assert all(o in argv and o in shlex.split(shown) for o in bench.NAIVE_OVERRIDES)  # run and recorded
    argv, _, _ = bench.recipe_command(bench.parse_args(["--out", "x.json"]), "jetrl-unified", Path("l"))
    assert not any(o in argv for o in bench.NAIVE_OVERRIDES)
