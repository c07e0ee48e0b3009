"""scripts/vllm_log_figures.py on a log written as vLLM 0.26 and bench_rollout.py write theirs (lines copied from a
device run's log, progress bars redrawn with carriage returns)."""

from __future__ import annotations

import json

import pytest
from scripts_cases import load_script

LOG = (
    "(Worker pid=746) INFO 12-05 17:36:40 [model_runner.py:305] Model loading took 8.87 GiB and 286.771961 seconds\n"
    "(Worker pid=746) \rCapturing CUDA graphs (PIECEWISE):   0%|          | 0/9 [00:00<?, ?it/s]"
    "\rCapturing CUDA graphs (PIECEWISE): 100%|##########| 9/9 [01:08<00:00,  1.00it/s]"
    "\rCapturing CUDA graphs (PIECEWISE): 100%|##########| 9/9 [01:08<00:00,  1.88it/s]\n"
    "(Worker pid=746) \rCapturing CUDA graphs (FULL): 100%|##########| 9/9 [01:08<00:00,  7.71it/s]"
    "\rCapturing CUDA graphs (FULL): 100%|##########| 9/9 [01:08<00:00,  7.66it/s]\n"
    "(Worker pid=746) INFO 12-05 17:37:31 [model_runner.py:747] Graph capturing finished in 9 secs, took 0.29 GiB\n"
    "(EngineCore pid=683) INFO 12-05 17:37:52 [core.py:340] init engine (profile, create kv cache, warmup model) "
    "took 72.31 s (compilation: 34.41 s)\n"
    "[jetrl_fp8_fused_ops] engine start 434.8 s (jetrl_fp8), KV 201664 tokens\n"
    "(Worker pid=746) WARNING 12-05 17:37:56 [jit_monitor.py:135] Triton kernel JIT compilation during inference: "
    "_rmsnorm_quant_kernel. This causes a latency spike; consider extending warmup to cover this shape/config.\n"
    "[jetrl_fp8_fused_ops] batch 256 x (256 + 512): run 1/3 19512.5 tok/s in 6.72 s\n"
    "(Worker pid=746) INFO 12-05 17:38:21 [wrapper.py:174] Torch profiling enabled. Traces will be saved to: /tmp/x\n"
    "INFO 12-05 17:38:22 [loader.py:1] something else\n"
)


@pytest.fixture(scope="module")
def figs():
    return load_script("vllm_log_figures")


def test_figures_of_a_vllm_engine_log(figs):
    f = figs.figures(LOG)
    assert f["engine_start_s"] == {"jetrl_fp8_fused_ops": [434.8]}
    assert f["model_loading_s"] == [286.771961]
    assert f["graph_capture_s"] == [9]
    # each kind's 100% bar once, though drawn twice, and FULL kept though its time equals PIECEWISE's
    assert f["capture_bars"] == [
        {"kind": "PIECEWISE", "sizes": 9, "elapsed": "01:08", "elapsed_s": 68},
        {"kind": "FULL", "sizes": 9, "elapsed": "01:08", "elapsed_s": 68},
    ]
    assert f["init_engine"] == [{"s": 72.31, "compilation_s": 34.41}]
    assert f["jit_during_inference"] == [{"kernel": "_rmsnorm_quant_kernel", "time": "17:37:56"}]
    assert f["decode_runs"] == [
        {"mode": "jetrl_fp8_fused_ops", "batch": 256, "input_len": 256, "output_len": 512, "run": 1, "tok_s": 19512.5}
    ]
    times = [ln["time"] for ln in f["lines"]]
    assert times == ["17:36:40", None, None, "17:37:31", "17:37:52", None, "17:37:56", None, "17:38:21"]
    assert "something else" not in json.dumps(f)


def test_the_decode_line_it_reads_is_the_one_bench_rollout_prints(figs, capsys):
    from types import SimpleNamespace

    class Engine:
        def generate(self, prompts, max_tokens, **kw):
            return [SimpleNamespace(response_ids=[1] * max_tokens) for _ in prompts]

    row = load_script("bench_rollout")._decode(Engine(), (4, 3, 5), vocab=50, seed=0, repeats=2, mode="bf16")
    runs = figs.figures(capsys.readouterr().out)["decode_runs"]
    assert [(r["mode"], r["batch"], r["run"]) for r in runs] == [("bf16", 4, 1), ("bf16", 4, 2)]
    assert [r["tok_s"] for r in runs] == pytest.approx(row["tok_s_runs"], rel=1e-3)


def test_main_writes_the_json_and_refuses_a_log_without_vllm_lines(figs, tmp_path, capsys):
    log = tmp_path / "run.log"
    log.write_text(LOG)
    out = tmp_path / "r" / "figs.json"
    argv = ["--device", "NVIDIA H100 80GB HBM3", "--commit", "abc", "--date", "2026-12-05", "--note", "a run"]
    assert figs.main([str(log), *argv, "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    assert (d["device"], d["commit"], d["date"], d["note"]) == ("NVIDIA H100 80GB HBM3", "abc", "2026-12-05", "a run")
    assert d["logs"]["run.log"]["model_loading_s"] == [286.771961]
    other = tmp_path / "other.log"
    other.write_text("nothing vLLM wrote\n")
    with pytest.raises(SystemExit):
        figs.main([str(other), *argv, "--out", str(tmp_path / "x.json")])
    assert "no vLLM start-up or decode line in other.log" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        figs.main([str(tmp_path / "missing.log"), *argv, "--out", str(tmp_path / "x.json")])
    assert "no such log" in capsys.readouterr().err
