"""bench_e2e's CPU parts: its options (the model shapes are scripts/shape_model.py's: test_shape_model.py)."""

from __future__ import annotations

import json

import pytest
from scripts_cases import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_e2e")


def test_tiny_takes_no_shape(bench, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--tiny", "--layers", "2"])
    assert "--tiny is its own model" in capsys.readouterr().err


def test_recipes_must_be_known(bench, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--tiny", "--recipes", "jetrl-unified,fp16"])
    assert "--recipes jetrl-unified,fp16: choose from jetrl-unified,bf16" in capsys.readouterr().err


def _part(bench, recipe: str, step_s: list[float], **config) -> dict:
    """A one-recipe result as a run writes it (times per step; the first is the warm-up)."""
    times = dict.fromkeys(bench.TIMES, 1.0)
    steps = [{**times, "time/step_s": t, "sync/bytes": 2**20, "response/length_mean": 16.0} for t in step_s]
    held = {"prompts": 32, "steps": len(step_s) - 1, "rollout_engines": 1}
    cfg = {k: None for k in bench.CONFIG_KEYS} | held | config
    return {
        "bench": "e2e",
        "device": "NVIDIA H200",
        "model": "qwen3-0.6b-shape, 28 layers (untied embeddings, random weights)",
        "shape": {"name": "qwen3-0.6b", "layers": 28},
        "gemm_backend": "deepgemm",
        "config": cfg,
        "runs": {recipe: {"recipe": recipe, "meta": {"commit": recipe}, "steps": steps}},
    }


def test_merge_of_separate_calls_gives_the_comparison(bench, tmp_path, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(bench.summarize(_part(bench, "jetrl-unified", [99.0, 12.0, 10.0, 11.0]))))
    b.write_text(json.dumps(bench.summarize(_part(bench, "bf16", [50.0, 8.0, 9.0, 10.0]))))
    assert "unified_over_bf16" not in json.loads(a.read_text())  # one recipe: medians, no ratio
    assert bench.main(["--merge", str(a), str(b), "--out", str(tmp_path / "out"), "--note", "two calls"]) == 0
    out = json.loads((tmp_path / "out" / "e2e-nvidia-h200.json").read_text())
    assert out["median"]["jetrl-unified"]["time/step_s"] == 11.0  # the warm-up step is not a timed one
    assert out["median"]["bf16"]["time/step_s"] == 9.0
    assert out["unified_over_bf16"]["time/step_s"] == pytest.approx(11.0 / 9.0)
    assert [r["meta"]["commit"] for r in out["runs"].values()] == ["jetrl-unified", "bf16"]
    assert out["note"] == "two calls" and out["merged_from"] == [str(a), str(b)]
    assert "unified/bf16" in capsys.readouterr().out


def test_merge_refuses_results_of_other_options(bench, tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_part(bench, "jetrl-unified", [1.0, 2.0], max_tokens=512)))
    b.write_text(json.dumps(_part(bench, "bf16", [1.0, 2.0], max_tokens=256)))
    with pytest.raises(SystemExit, match=r"b.json: config max_tokens=256, not 512"):
        bench.merge([a, b])


def test_merge_refuses_two_runs_of_a_recipe_and_keeps_old_files_provenance(bench, tmp_path):
    a, b, c = (tmp_path / f"{n}.json" for n in "abc")
    old = _part(bench, "bf16", [1.0, 2.0])
    del old["runs"]["bf16"]["meta"]  # as results written before runs carried their meta
    old.update(date="2026-11-29", code="commit fbc5fa7")
    a.write_text(json.dumps(_part(bench, "jetrl-unified", [1.0, 2.0])))
    b.write_text(json.dumps(old))
    c.write_text(json.dumps(_part(bench, "bf16", [1.0, 3.0])))
    with pytest.raises(SystemExit, match=r"c.json: a second bf16 run"):
        bench.merge([a, b, c])
    meta = bench.merge([a, b])["runs"]["bf16"]["meta"]
    assert meta["date"] == "2026-11-29" and meta["code"] == "commit fbc5fa7"


def test_result_names(bench, tmp_path):
    part = _part(bench, "bf16", [1.0, 2.0])
    assert bench.result_path(part, tmp_path).name == "e2e-nvidia-h200.json"
    part["shape"] = {"name": "llama3.1-8b", "layers": 8}
    assert bench.result_path(part, tmp_path).name == "e2e-llama3.1-8b-l8-nvidia-h200.json"
    part["config"]["rollout_executor"] = "mp"  # the engine in vLLM's worker: its own file beside the uni one
    assert bench.result_path(part, tmp_path).name == "e2e-llama3.1-8b-l8-mp-nvidia-h200.json"
    part["config"]["rollout_engines"] = 2  # two engines shared the rollout: a file of its own
    assert bench.result_path(part, tmp_path).name == "e2e-llama3.1-8b-l8-mp-x2-nvidia-h200.json"
    del part["config"]["rollout_engines"]  # results from before the option ran one engine
    part["runs"]["bf16"]["rollout_probe"] = {}  # a diagnosis (--profile-rollout) does not replace the comparison
    assert bench.result_path(part, tmp_path).name == "e2e-llama3.1-8b-l8-mp-probe-nvidia-h200.json"
    del part["runs"]["bf16"]["rollout_probe"]
    part["config"]["rollout_executor"] = "uni"
    part.update(device="CPU x86_64 x2", shape=None)
    assert bench.result_path(part, tmp_path).name == "e2e-cpu.json"


def test_engine_ops_follow_the_trainers_producers(bench, capsys):
    for argv in (["--engine-ops", "fused"], ["--engine-ops", "hf", "--fuse"]):
        with pytest.raises(SystemExit):
            bench.parse_args(argv)
        assert "--engine-ops" in capsys.readouterr().err
    args = bench.parse_args(["--engine-ops", "fused", "--fuse"])
    unified = bench._config(args, "jetrl-unified", "/m", "/r")
    bf16 = bench._config(args, "bf16", "/m", "/r")
    assert (unified["rollout"]["engine_ops"], unified["model"]["fuse_producers"]) == ("fused", True)
    assert (bf16["rollout"]["engine_ops"], bf16["model"]["fuse_producers"]) == ("hf", False)  # no bf16 producers
    assert "engine_ops" in bench.CONFIG_KEYS and bench.ADDED_KEYS["engine_ops"] == "vllm"  # older results: 'vllm'


def test_engine_ops_auto_is_each_recipes_default(bench):
    """The default, 'auto', leaves the choice to `jetrl train`'s config: on CUDA jetrl-unified rolls out with the
    trainer's ops (fused with --fuse), bf16 with vLLM's own model; on CPU both with vLLM's."""
    from jetrl.train.config import config_from_dict

    def resolved(argv, recipe, device):
        cfg = bench._config(bench.parse_args(argv), recipe, "/m", "/r")
        cfg["run"]["device"] = device
        cfg["model"]["path"] = None  # not loaded: the resolution reads only the recipe, device and numerics
        return config_from_dict(cfg).rollout.engine_ops

    assert bench.parse_args([]).engine_ops == "auto"
    assert resolved(["--fuse"], "jetrl-unified", "cuda") == "fused"
    assert resolved([], "jetrl-unified", "cuda") == "hf"
    assert resolved(["--fuse"], "bf16", "cuda") == "vllm"
    assert resolved(["--fuse"], "jetrl-unified", "cpu") == "vllm"
    with pytest.raises(SystemExit):  # strict must name the ops of both recipes
        bench.parse_args(["--numerics", "strict"])


def test_strict_numerics_are_a_compared_option(bench, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--numerics", "strict"])
    assert "--engine-ops hf" in capsys.readouterr().err
    args = bench.parse_args(["--numerics", "strict", "--engine-ops", "hf"])
    assert bench._config(args, "jetrl-unified", "/m", "/r")["model"]["numerics"] == "strict"
    assert bench._config(bench.parse_args([]), "bf16", "/m", "/r")["model"]["numerics"] == "hf"
    assert "numerics" in bench.CONFIG_KEYS
    for bad in ("strict,strict", "hf,bf16", ""):
        with pytest.raises(SystemExit):
            bench.parse_args(["--numerics", bad, "--engine-ops", "hf"])
        assert f"--numerics {bad}: one or more of hf,strict" in capsys.readouterr().err


def test_strict_and_hf_runs_of_a_recipe_give_the_strict_cost(bench, tmp_path, capsys):
    """``--numerics hf,strict``: both runs of a recipe in one result, keyed apart, with their ratio."""
    out = _part(bench, "jetrl-unified", [30.0, 10.0, 12.0], engine_ops="hf", numerics="hf,strict")
    strict = _part(bench, "jetrl-unified", [40.0, 13.0, 15.0])["runs"]["jetrl-unified"]
    out["runs"][bench.run_key("jetrl-unified", "strict")] = strict
    bench.summarize(out)
    assert list(out["median"]) == ["jetrl-unified", "jetrl-unified-strict"]
    assert out["strict_over_hf"]["jetrl-unified"]["time/step_s"] == pytest.approx(14.0 / 11.0)
    assert "unified_over_bf16" not in out
    assert bench.result_path(out, tmp_path).name == "e2e-strict-nvidia-h200.json"
    bench.print_table(out)
    assert "jetrl-unified strict/hf" in capsys.readouterr().out
    assert bench.run_key("bf16", "hf") == "bf16"


def test_rollout_executor_is_the_configs_and_held_fixed(bench, capsys):
    """--rollout-executor sets rollout.executor for both recipes (a held-fixed option; older results ran 'uni')."""
    from jetrl.train.config import config_from_dict

    args = bench.parse_args(["--rollout-executor", "mp"])
    for recipe in ("bf16", "jetrl-unified"):
        cfg = bench._config(args, recipe, "/m", "/r")
        cfg["model"]["path"] = None
        assert config_from_dict(cfg).rollout.executor == "mp"
    assert bench.parse_args([]).rollout_executor == "uni"
    assert "rollout_executor" in bench.CONFIG_KEYS and bench.ADDED_KEYS["rollout_executor"] == "uni"
    bench.parse_args(["--numerics", "strict", "--engine-ops", "hf"])  # fine with the in-process engine
    with pytest.raises(SystemExit):
        bench.parse_args(["--rollout-executor", "mp", "--numerics", "strict", "--engine-ops", "hf"])
    assert "--rollout-executor mp" in capsys.readouterr().err


def test_rollout_engines_are_the_configs_and_held_fixed(bench, capsys):
    """--rollout-engines sets rollout.engines for both recipes (held fixed; older results ran one engine) and
    needs the engines in their own processes."""
    from jetrl.train.config import config_from_dict

    args = bench.parse_args(["--rollout-executor", "mp", "--rollout-engines", "2"])
    for recipe in ("bf16", "jetrl-unified"):
        cfg = bench._config(args, recipe, "/m", "/r")
        cfg["model"]["path"] = None
        assert config_from_dict(cfg).rollout.engines == 2
    assert "rollout_engines" in bench.CONFIG_KEYS and bench.ADDED_KEYS["rollout_engines"] == 1
    for argv, msg in (
        (["--rollout-engines", "0"], "--rollout-engines 0 must be >= 1"),
        (["--rollout-engines", "2"], "--rollout-engines > 1 needs --rollout-executor mp"),
        (["--rollout-engines", "2", "--rollout-executor", "mp", "--profile-rollout"], "not with --rollout-engines"),
    ):
        with pytest.raises(SystemExit):
            bench.parse_args(argv)
        assert msg in capsys.readouterr().err


def test_merge_reads_older_results_without_the_later_options(bench, tmp_path):
    """A result written before an option existed ran with the value `ADDED_KEYS` gives it: it merges with a
    new run of that value and is refused beside one of another (strict numerics, varied response lengths)."""

    def older(recipe, **config):
        part = _part(bench, recipe, [1.0, 2.0])
        part["config"] = {k: v for k, v in part["config"].items() if k not in bench.ADDED_KEYS} | config
        return part

    paths = {n: tmp_path / f"{n}.json" for n in ("old", "same", "strict", "varied")}
    paths["old"].write_text(json.dumps(older("bf16")))
    paths["same"].write_text(json.dumps(older("jetrl-unified", engine_ops="vllm", numerics="hf", min_tokens=None)))
    paths["strict"].write_text(json.dumps(older("jetrl-unified", engine_ops="hf", numerics="strict")))
    paths["varied"].write_text(json.dumps(older("jetrl-unified", min_tokens=256)))
    assert set(bench.merge([paths["old"], paths["same"]])["runs"]) == {"bf16", "jetrl-unified"}
    with pytest.raises(SystemExit, match="config engine_ops='hf', not 'vllm'"):
        bench.merge([paths["old"], paths["strict"]])
    with pytest.raises(SystemExit, match="config min_tokens=256, not None"):
        bench.merge([paths["old"], paths["varied"]])


def test_min_tokens_draws_each_prompts_budget_the_same_in_every_run(bench, capsys):
    """--min-tokens: each generate gives every prompt its own budget in [min, max_tokens], the same draws in each
    recipe's run (one seeded stream per run)."""
    with pytest.raises(SystemExit):
        bench.parse_args(["--max-tokens", "64", "--min-tokens", "65"])
    assert "--min-tokens 65 must be in [1, --max-tokens 64]" in capsys.readouterr().err

    class Engine:
        def __init__(self):
            self.budgets = []

        def generate(self, prompts, *, max_tokens, n=1):
            assert len(max_tokens) == len(prompts)
            self.budgets.append(max_tokens)

    runs = []
    for _ in range(2):
        engine = Engine()
        bench.vary_response_lengths(engine, 16, seed=0)
        engine.generate([[1]] * 8, max_tokens=64, n=2)
        engine.generate([[1]] * 8, max_tokens=64)
        runs.append(engine.budgets)
    assert runs[0] == runs[1] and runs[0][0] != runs[0][1]
    drawn = runs[0][0] + runs[0][1]
    assert all(16 <= b <= 64 for b in drawn) and len(set(drawn)) > 4


def test_a_run_records_its_set_up_split(bench, monkeypatch, tmp_path):
    """run_one keeps what the trainer measured: set-up, the engine's start and the training graphs' capture
    (parts of it), every step's phases; a stand-in Trainer here, the real one on the GPU."""
    import jetrl.train.trainer as trainer

    row = dict.fromkeys((*bench.TIMES, "time/step_s", "sync/bytes", "response/length_mean"), 1.0)

    class FakeTrainer:
        def __init__(self, cfg, overwrite, log):
            self.steps = cfg.run.steps

        def setup(self):
            self.engine = type("E", (), {"quantization": "jetrl_fp8", "start_seconds": 12.5})()
            self.setup_s, self.graph_capture_s = 30.0, 7.5
            self.conversion = type("C", (), {"converted_names": lambda self: ["a", "b"]})()

        def _rollout(self, s):
            return [[i] for i in range(100_000)]  # a step's samples: objects the GC tracks, so collections run

        def step(self, s):
            self._rollout(s)
            return {**row, "time/step_s": float(s)}

        def close(self):
            self.engine = None

    monkeypatch.setattr(trainer, "Trainer", FakeTrainer)
    args = bench.parse_args(["--tiny", "--steps", "2"])
    args.one, args.model_path, args.run_dir = "jetrl-unified", str(tmp_path / "m"), str(tmp_path / "r")
    out = bench.run_one(args)
    assert (out["setup_s"], out["engine_start_s"], out["graph_capture_s"]) == (30.0, 12.5, 7.5)
    assert out["engine_quantization"] == "jetrl_fp8" and out["converted_linears"] == 2
    assert [r["time/step_s"] for r in out["steps"]] == [1.0, 2.0, 3.0]  # the warm-up step too
    for r in out["steps"]:  # each step's rollout phase metered in this process: its CPU, the GC's pauses
        assert set(bench.ROLLOUT_HOST) <= set(r) and r["rollout/cpu_s"] > 0 and r["rollout/thread_cpu_s"] > 0
        assert r["rollout/gc_s"] > 0 and r["rollout/gc_full"] >= 0
    assert out["gpu_memory"] is None  # no CUDA here
    assert "rollout_probe" not in out and "train_profile" not in out  # only with --profile-rollout / -train


def test_rollout_probe_times_a_steps_shape_then_profiles_a_short_one(bench, monkeypatch):
    """--profile-rollout: the engine alone in the trainer's process, one generate of the step's prompts x samples x
    max_tokens timed, then a profiled one of --profile-tokens tokens (profile_cuda stood in: it needs CUDA)."""
    from types import SimpleNamespace

    from jetrl.train.config import config_from_dict

    calls = []

    class Engine:
        def generate(self, prompts, **kw):
            calls.append({"prompts": len(prompts), **kw})
            ids = [7] * kw["max_tokens"]
            return [SimpleNamespace(response_ids=ids) for _ in range(len(prompts) * kw["n"])]

    args = bench.parse_args(["--prompts", "4", "--samples", "3", "--max-tokens", "40", "--profile-rollout"])
    cfg = config_from_dict(bench._config(args, "bf16", "/m", "/r"))
    tr = SimpleNamespace(
        cfg=cfg,
        engine=Engine(),
        tokens=SimpleNamespace(encode_problem=lambda p: [1, 2]),
        task=SimpleNamespace(problems=lambda stream, step, n: [f"p{i}" for i in range(n)]),
    )
    monkeypatch.setattr(bench, "profile_cuda", lambda fn, steps: (fn(), {"steps": steps})[1])
    probe = bench.rollout_probe(tr, 16)
    # the step's shape, then its 12 sequences as 12 prompts of one sample each, then the profiled one
    assert [(c["prompts"], c["n"], c["max_tokens"]) for c in calls] == [(4, 3, 40), (12, 1, 40), (4, 3, 16)]
    assert all(c["ignore_eos"] and c["temperature"] == 1.0 for c in calls)
    assert probe["tokens"] == 4 * 3 * 40 and probe["tok_s"] == probe["tokens"] / probe["generate_s"]
    assert probe["profile"] == {"steps": 16}
    host = probe["host"]  # this process during the timed generate (vLLM's front-end with the engine elsewhere)
    assert "wall_s" not in host and host["thread_cpu_s"] >= 0 and host["gc_tracked_objects"] > 1000
    one = probe["one_sample_each"]
    assert one["generate_s"] > 0 and set(one["host"]) == {"cpu_s", "thread_cpu_s", "gc_s", "gc_collections"}


def test_rollout_probe_of_a_worker_uses_vllms_profiler(bench, monkeypatch, tmp_path):
    """--profile-rollout --rollout-executor mp: the engine is created with vLLM's profiler writing into the run's
    folder, and the probe's short generate is profiled there by `profiling.profile_worker` (the model's process
    records itself), not by torch.profiler in this process, which would see no kernel of it."""
    from types import SimpleNamespace

    from jetrl.train.config import config_from_dict

    calls = []

    class Engine:
        def generate(self, prompts, **kw):
            calls.append(kw["max_tokens"])
            return [SimpleNamespace(response_ids=[7] * kw["max_tokens"]) for _ in range(len(prompts) * kw["n"])]

    args = bench.parse_args(["--rollout-executor", "mp", "--max-tokens", "40", "--profile-rollout", "--cuda-graphs"])
    cfg = bench._config(args, "jetrl-unified", "/m", str(tmp_path / "run"))
    kw = cfg["rollout"]["engine_kwargs"]
    assert kw["profiler_config"] == bench.worker_profiler_config(tmp_path / "run" / "traces")
    assert kw["compilation_config"] == {"cudagraph_capture_sizes": bench.CAPTURE_SIZES}  # graphs kept beside it
    cfg["model"]["path"] = None
    cfg = config_from_dict(cfg)
    tr = SimpleNamespace(
        cfg=cfg,
        engine=Engine(),
        tokens=SimpleNamespace(encode_problem=lambda p: [1, 2]),
        task=SimpleNamespace(problems=lambda stream, step, n: [f"p{i}" for i in range(n)]),
    )
    seen = []

    def profile_worker(engine, generate, tokens, trace_dir):
        generate()
        seen.append((engine, tokens, trace_dir, trace_dir.is_dir()))
        return {"steps": tokens, "profiled_in": "worker"}

    monkeypatch.setattr(bench, "profile_worker", profile_worker)
    monkeypatch.setattr(bench, "profile_cuda", lambda fn, steps: pytest.fail("profiled this process"))
    probe = bench.rollout_probe(tr, 16)
    assert calls == [40, 40, 16] and seen == [(tr.engine, 16, tmp_path / "run" / "traces", True)]
    assert probe["profile"] == {"steps": 16, "profiled_in": "worker"}
    without = bench._config(bench.parse_args(["--rollout-executor", "mp"]), "bf16", "/m", "/r")
    assert "profiler_config" not in without["rollout"]["engine_kwargs"]  # no profiler unless asked


def test_train_profile_profiles_one_more_training_phase(bench, monkeypatch):
    """--profile-train: a fresh rollout, then its training phase (old log-probs + update) profiled as one step."""
    from types import SimpleNamespace

    seen = []
    tr = SimpleNamespace(
        _rollout=lambda step: (("rollout", step), {}, 3),
        _train=lambda step, ro, n: seen.append((step, ro, n)),
    )
    monkeypatch.setattr(bench, "profile_cuda", lambda fn, steps, top: (fn(), {"steps": steps, "top": top})[1])
    assert bench.train_profile(tr, 5) == {"steps": 1, "top": 25}
    assert seen == [(5, ("rollout", 5), 3)]


def test_profiling_needs_a_gpu_run(bench, capsys):
    for argv, msg in (
        (["--tiny", "--profile-rollout"], "--profile-rollout profiles CUDA kernels: not with --tiny"),
        (["--tiny", "--profile-train"], "--profile-train profiles CUDA kernels: not with --tiny"),
        (["--profile-tokens", "0"], ">= 1"),
    ):
        with pytest.raises(SystemExit):
            bench.parse_args(argv)
        assert msg in capsys.readouterr().err


def test_rollouts_carry_the_engine_cores_steps_where_it_records_them(bench, monkeypatch, tmp_path):
    """With JETRL_ENGINE_CORE_TIMING set (main sets it for each run) each rollout phase's row carries the engine
    core's steps inside that phase, per step (`jetrl.rollout.engine_timing`); unset, the row has none."""
    import time
    from types import SimpleNamespace

    from jetrl.rollout.engine_timing import ENV, FIELDS

    folder = tmp_path / "core"
    folder.mkdir()

    def rollout(step):
        time.sleep(0.02)
        with (folder / "engine-core-77.jsonl").open("a") as f:
            for tokens, ms in ((0, 3.0), (256, 4.0), (256, 6.0)):  # an idle turn, then two steps of 256 tokens
                row = {"t": time.time() - 0.01, **dict.fromkeys(FIELDS, ms), "tokens": tokens, "requests": 1}
                f.write(json.dumps({**row, "wall_ms": 5.0}) + "\n")
        return step

    monkeypatch.delenv(ENV, raising=False)
    tr = SimpleNamespace(_rollout=rollout)
    done = bench.meter_rollouts(tr)
    assert tr._rollout(1) == 1 and not set(bench.ROLLOUT_CORE) & set(done[-1])
    monkeypatch.setenv(ENV, str(folder))
    assert tr._rollout(2) == 2
    row = done[-1]
    assert row["rollout/core_steps"] == 2 and row["rollout/core_wall_ms"] == 15.0 / 2  # three turns, two steps
    for k in ("schedule", "update", "handoff"):
        assert row[f"rollout/core_{k}_ms"] == (3.0 + 4.0 + 6.0) / 2
