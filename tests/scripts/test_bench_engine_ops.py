"""bench_engine_ops' byte check and arguments, on CPU (the ops' torch references; the timing needs a GPU)."""

from __future__ import annotations

import pytest
import torch
from scripts_cases import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_engine_ops")


def test_both_ways_give_the_same_bytes_on_cpu(bench):
    for layout in ("row", "deepgemm"):
        t = bench.layer_inputs(8, "cpu", seed=1)
        assert bench.differing(bench.separate(t, layout), bench.fused(t, layout)) == []


def test_a_changed_byte_is_named(bench):
    t = bench.layer_inputs(8, "cpu", seed=2)
    a = bench.separate(t, "row")
    b = list(bench.fused(t, "row"))
    q = b[1].view(torch.uint8).clone()
    q[0, 0] ^= 1
    b[1] = q.view(torch.float8_e4m3fn)
    b[5] = b[5][:, :-1]  # a shape change counts too
    assert bench.differing(a, tuple(b)) == ["q", "rope k"]


def test_producers_without_their_value_give_the_same_bytes_on_cpu(bench):
    t = {**bench.layer_inputs(8, "cpu", seed=4), "gate_up": bench._gate_up(8, "cpu", seed=4)}
    kept, bare = bench.producers(t, "deepgemm", True), bench.producers(t, "deepgemm", False)
    assert [tuple(v.shape) for v in kept[:3]] == [(8, bench.HIDDEN)] * 2 + [(8, bench.INTERMEDIATE)]
    assert [v.numel() for v in bare[:3]] == [0, 0, 0]
    assert bench.differing(kept[3:], bare[3:], range(8)) == []
    bench.check_producers(8, "cpu", "row")


def test_q_and_k_are_strided_slices_of_one_qkv(bench):
    t = bench.layer_inputs(4, "cpu", seed=3)
    assert t["q"].stride(0) == t["k"].stride(0) == (bench.Q_HEADS + 2 * bench.KV_HEADS) * bench.HEAD_DIM
    assert t["q"].untyped_storage().data_ptr() == t["k"].untyped_storage().data_ptr()


def test_cpu_run_checks_and_writes_nothing(bench, tmp_path, capsys):
    result = bench.main(["--batches", "2,16", "--layers", "1", "--out", str(tmp_path)])
    assert result["rows"] == [] and list(tmp_path.iterdir()) == []
    assert "bytes equal" in capsys.readouterr().out


@pytest.mark.parametrize("args", [["--batches", "0"], ["--batches", "a,2"], ["--layers", "0"]])
def test_bad_arguments_are_named(bench, args):
    with pytest.raises(SystemExit, match=args[0]):
        bench.main(args)
