"""bench_fidelity's CPU parts: option parsing, the statistics and position bins, the JSON schema, the plot."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from scripts_cases import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_fidelity")


# -- options -----------------------------------------------------------------------------------------


def test_defaults_run_every_mode_to_8k_tokens(bench):
    a = bench.parse_args([])
    assert a.modes == ["bf16", "naive_fp8", "jetrl_fp8", "stock_fp8"]
    assert (a.max_tokens, a.bins, a.enforce_eager, a.model_overrides) == (8192, 16, False, {})
    assert bench.MODES["stock_fp8"] == ("jetrl-unified", "stock")


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--max-tokens", "0"], "positive"),
        (["--bins", "20", "--max-tokens", "10"], "exceeds"),
        (["--model-overrides", "[1]"], "JSON object"),
        (["--model-overrides", "{oops"], "not JSON"),
        (["--temperature", "0"], "temperature"),
        (["--modes", "fp4"], "invalid choice"),
    ],
)
def test_bad_options_are_refused_by_name(bench, argv, match, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert match in capsys.readouterr().err


def test_model_overrides_make_room_for_the_response(bench):
    a = bench.parse_args(["--max-tokens", "8192", "--model-overrides", '{"num_hidden_layers": 4}'])
    over = bench._model_overrides(a)
    assert over == {"num_hidden_layers": 4, "max_position_embeddings": 8192 + 64}
    b = bench.parse_args(["--max-tokens", "100", "--model-overrides", '{"max_position_embeddings": 9000}'])
    assert bench._model_overrides(b)["max_position_embeddings"] == 9000  # a larger value is kept


def test_child_argv_drops_what_the_parent_sets(bench):
    argv = ["--max-tokens", "64", "--modes", "bf16", "naive_fp8", "--out", "x.json", "--plot=p.png", "--isolate",
            "--checkpoint", "/c", "--seed", "3"]  # fmt: skip
    assert bench._child_argv(argv) == ["--max-tokens", "64", "--seed", "3"]


# -- statistics --------------------------------------------------------------------------------------


def test_stats_against_hand_computed_figures(bench):
    rollout = torch.tensor([-1.0, -2.0, -0.5, -0.1])
    trainer = torch.tensor([-1.1, -2.0, -0.3, -0.1])
    ent = torch.tensor([0.5, 1.0, 0.0, 0.5])
    s = bench.stats(rollout, trainer, ent)
    d = [-0.1, 0.0, 0.2, 0.0]  # trainer - rollout (fp32 inputs: compare loosely)
    assert s["tokens"] == 4
    assert s["mean_abs"] == pytest.approx(0.075, abs=1e-6)
    assert s["max_abs"] == pytest.approx(0.2, abs=1e-6)
    assert s["is_ratio_mean"] == pytest.approx(sum(math.exp(v) for v in d) / 4, abs=1e-6)
    assert s["is_ratio_max"] == pytest.approx(math.exp(0.2), abs=1e-6)
    assert s["p99_abs"] == pytest.approx(0.1 + 0.97 * 0.1, abs=1e-6)  # linear interpolation at q=0.99
    assert s["entropy_mean"] == pytest.approx(0.5) and s["nll_mean"] == pytest.approx(0.875, abs=1e-6)
    assert s["frac_equal"] == 0.5 and s["frac_le_1e-6"] == 0.5  # tokens 2 and 4 are the same fp32 number
    s = bench.stats(rollout, rollout + torch.tensor([0.0, 5e-7, 2e-6, 0.0]), ent)
    assert s["frac_equal"] == 0.5 and s["frac_le_1e-6"] == 0.75


def test_stats_refuses_misaligned_tensors_and_reports_empty_as_none(bench):
    with pytest.raises(ValueError, match="equal 1-D shapes"):
        bench.stats(torch.zeros(3), torch.zeros(2), torch.zeros(3))
    empty = bench.stats(torch.zeros(0), torch.zeros(0), torch.zeros(0))
    assert empty["tokens"] == 0 and empty["mean_abs"] is None


def test_bin_edges_cover_every_position_once(bench):
    e = bench.bin_edges(8192, 16)
    assert e[0] == 0 and e[-1] == 8192 and len(e) == 17 and all(b - a == 512 for a, b in zip(e, e[1:], strict=False))
    odd = bench.bin_edges(10, 3)
    assert odd == [0, 3, 7, 10]
    with pytest.raises(ValueError, match="bins"):
        bench.bin_edges(3, 4)


def _sample(n, offset, seed):
    g = torch.Generator().manual_seed(seed)
    r = -torch.rand(n, generator=g)
    return {"rollout": r, "trainer": r + offset * torch.arange(n, dtype=torch.float32), "entropy": torch.ones(n)}


def test_position_bins_split_tokens_by_response_position(bench):
    rows = [_sample(10, 0.01, 0), _sample(6, 0.01, 1)]  # |dlogp| = 0.01 * position
    bins = bench.by_position(rows, [0, 5, 10])
    assert [b["tokens"] for b in bins] == [10, 6]  # positions 0-4 of both, 5-9 of the first and 5 of the second
    assert bins[0]["max_abs"] == pytest.approx(0.04, abs=1e-6)
    assert bins[1]["mean_abs"] == pytest.approx((0.05 + 0.06 + 0.07 + 0.08 + 0.09 + 0.05) / 6, abs=1e-6)


def test_up_to_eos_keeps_the_answer_and_its_eos(bench):
    rows = [_sample(5, 0.0, 0), _sample(4, 0.0, 1)]
    cut = bench.up_to_eos(rows, [[5, 6, 2, 7, 2], [9, 9, 9, 9]], eos_id=2)
    assert [len(r["rollout"]) for r in cut] == [3, 4]
    s = bench.summarize(rows, [[5, 6, 2, 7, 2], [9, 9, 9, 9]], 2, [0, 2, 5])
    assert s["to_first_eos"]["tokens"] == 7 and s["overall"]["tokens"] == 9
    assert s["samples_with_eos"] == 1 and s["response_tokens_max"] == 5


def test_ratios_need_both_sides(bench):
    modes = {m: {"overall": {"mean_abs": v}} for m, v in (("bf16", 0.004), ("jetrl_fp8", 0.016), ("naive_fp8", 0.08))}
    r = bench.ratios(modes)
    assert r["jetrl_fp8_over_bf16"] == pytest.approx(4.0) and r["naive_fp8_over_jetrl_fp8"] == pytest.approx(5.0)
    assert "stock_fp8_over_bf16" not in r
    assert bench.ratios({"jetrl_fp8": modes["jetrl_fp8"]}) == {}


def test_strict_modes_run_the_trainers_ops_and_compare_with_their_own_floor(bench):
    assert set(bench.STRICT) <= set(bench.MODES) and all(bench.ENGINE_OPS[m] == "hf" for m in bench.STRICT)
    vals = (("bf16_strict", 0.0), ("jetrl_fp8_strict", 2e-6), ("bf16", 1e-4), ("naive_fp8", 8e-4))
    r = bench.ratios({m: {"overall": {"mean_abs": v}} for m, v in vals})
    assert r["jetrl_fp8_strict_over_bf16"] == pytest.approx(0.02) and r[
        "naive_fp8_over_jetrl_fp8_strict"
    ] == pytest.approx(400)
    assert "jetrl_fp8_strict_over_bf16_strict" not in r  # a zero floor gives no ratio


# -- the JSON schema and the plot ----------------------------------------------------------------------


def _result(bench):
    class A:
        max_tokens, prompts, samples, seed, temperature, bins = 10, 2, 1, 0, 1.0, 2
        enforce_eager, backend, commit = False, "auto", "abc123"

    res = bench._base_result(A, {"name": "tiny"})
    edges = res["settings"]["bin_edges"]
    for i, mode in enumerate(("bf16", "jetrl_fp8")):
        rows = [_sample(10, 0.001 * (i + 1), 0), _sample(10, 0.001 * (i + 1), 1)]
        res["modes"][mode] = {"recipe": bench.MODES[mode][0], "rollout": bench.MODES[mode][1],
                              **bench.summarize(rows, [[3] * 10, [3] * 9 + [2]], 2, edges)}  # fmt: skip
    res["summary"] = bench.ratios(res["modes"])
    return res


def test_a_built_result_validates_and_names_what_breaks_it(bench):
    res = _result(bench)
    bench.validate(res)
    assert res["commit"] == "abc123" and res["settings"]["bin_edges"] == [0, 5, 10]
    assert res["summary"]["jetrl_fp8_over_bf16"] == pytest.approx(2.0, rel=1e-3)
    broken = copy.deepcopy(res)
    del broken["modes"]["bf16"]["overall"]["p99_abs"]
    with pytest.raises(ValueError, match=r"modes\.bf16\.overall lacks 'p99_abs'"):
        bench.validate(broken)
    broken = copy.deepcopy(res)
    broken["modes"]["jetrl_fp8"]["by_position"].pop()
    with pytest.raises(ValueError, match="1 bins"):
        bench.validate(broken)
    broken = copy.deepcopy(res)
    broken["modes"]["fp4"] = broken["modes"]["bf16"]
    with pytest.raises(ValueError, match="unknown mode 'fp4'"):
        bench.validate(broken)
    with pytest.raises(ValueError, match="benchmark"):
        bench.validate({**res, "benchmark": "rollout"})


def test_plot_writes_a_png(bench, tmp_path):
    pytest.importorskip("matplotlib")
    png = bench.plot(_result(bench), tmp_path / "f.png")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_plot_only_reads_a_json(bench, tmp_path):
    pytest.importorskip("matplotlib")
    import json

    src = tmp_path / "fid.json"
    src.write_text(json.dumps(_result(bench)))
    assert bench.main(["--plot-only", str(src)]) == 0
    assert (tmp_path / "fid.png").read_bytes()[:4] == b"\x89PNG"


def test_merge_joins_the_modes_of_separate_calls_and_refuses_what_differs(bench, tmp_path):
    import json

    a, b = _result(bench), _result(bench)
    del a["modes"]["jetrl_fp8"]
    b["modes"]["jetrl_fp8_hf_ops"] = b["modes"].pop("jetrl_fp8")
    del b["modes"]["bf16"]
    b["commit"], b["errors"] = "def456", {"jetrl_fp8_fused_ops": "Traceback ..."}
    b["model"] = {**b["model"], "warmup": {"loss_end": 1.1, "seconds": 9.3}}  # the duration may differ
    a["model"] = {**a["model"], "warmup": {"loss_end": 1.1, "seconds": 8.1}}
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    out = tmp_path / "m.json"
    assert bench.main(["--merge", str(pa), str(pb), "--out", str(out), "--plot", "none"]) == 0
    m = json.loads(out.read_text())
    bench.validate(m)
    assert sorted(m["modes"]) == ["bf16", "jetrl_fp8_hf_ops"] and list(m["errors"]) == ["jetrl_fp8_fused_ops"]
    assert m["commit"] == "abc123,def456" and [r["commit"] for r in m["merged_from"]] == ["abc123", "def456"]
    assert m["summary"]["jetrl_fp8_hf_ops_over_bf16"] == pytest.approx(2.0, rel=1e-3)
    with pytest.raises(ValueError, match="measures mode 'bf16' again"):
        bench.merge([pa, pa])
    pb.write_text(json.dumps({**b, "model": {**b["model"], "warmup": {"loss_end": 1.2, "seconds": 9.3}}}))
    with pytest.raises(ValueError, match=r"b\.json has another model"):
        bench.merge([pa, pb])
