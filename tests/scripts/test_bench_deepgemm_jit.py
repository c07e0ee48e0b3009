"""scripts/bench_deepgemm_jit.py: its options, cache counting and summary on CPU; the run itself on an sm_90 GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from scripts_cases import SCRIPTS, load_script

from jetrl.gemm.deepgemm import DeepGemmBackend


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_deepgemm_jit")


def test_options_name_what_is_wrong(bench):
    assert bench._tokens("700,16384") == [700, 16384]
    assert bench._linears("down_proj,qkv") == [("down_proj", 4096, 14336), ("qkv", 6144, 4096)]
    for bad in ("700,x", "0", "700,,8"):
        with pytest.raises(bench.argparse.ArgumentTypeError, match="is not a positive token count"):
            bench._tokens(bad)
    with pytest.raises(bench.argparse.ArgumentTypeError, match=r"\['lm_head'\]: choose from"):
        bench._linears("qkv,lm_head")


def test_cache_counts_kernel_folders_and_files(bench, tmp_path):
    assert bench.cache_counts(tmp_path / "missing") == (0, 0)
    for name in ("kernel.sm90_fp8_gemm_1d2d.aa", "kernel.sm90_fp8_gemm_1d1d.bb"):
        d = tmp_path / "cache" / name
        d.mkdir(parents=True)
        (d / "kernel.cu").write_text("")
        (d / "kernel.cubin").write_text("")
    (tmp_path / "tmp").mkdir()
    assert bench.cache_counts(tmp_path) == (2, 4)


def test_summary_adds_up_per_linear_role_and_dims(bench):
    def row(role, dims, t, kernels, first_s, ms, **kw):
        return {
            "linear": "qkv",
            "role": role,
            "compiled_dims": dims,
            "tokens": t,
            "new_kernels": kernels,
            "first_call_s": first_s,
            "steady_ms": ms,
            **kw,
        }

    rows = [
        row("wgrad", "nk", 700, 1, 3.0, 1.0),
        row("wgrad", "nk", 1500, 1, 2.5, 2.0),
        row("wgrad", "mn", 700, 1, 3.0, 1.0, bits_equal_nk=True),
        row("wgrad", "mn", 1500, 0, 0.001, 2.0, bits_equal_nk=False),
    ]
    nk, mn = bench.summarize(rows)
    assert (nk["compiled_dims"], nk["token_counts"], nk["new_kernels"], nk["steady_ms_sum"]) == ("nk", 2, 2, 3.0)
    assert nk["first_call_excess_s"] == pytest.approx(2.999 + 2.498)
    assert "bits_equal_nk" not in nk
    assert (mn["new_kernels"], mn["bits_equal_nk"]) == (1, False)  # one count's bits differing is reported
    assert mn["first_call_excess_s"] == pytest.approx(2.999)  # a first call faster than steady adds nothing
    assert "NO" in bench._table([nk, mn]).splitlines()[2]
    (failed,) = bench.summarize(
        [row("wgrad", "mn", 700, 1, 3.0, 1.0), {**row("wgrad", "mn", 1500, 0, 0, 0), "error": "E"}]
    )
    assert (failed["token_counts"], failed["error"]) == (1, "at 1500 tokens: E")  # the counts before it still add up
    assert "FAILED: at 1500 tokens: E" in bench._table([failed])


@pytest.mark.skipif(DeepGemmBackend.unavailable_reason() is None, reason="checks the refusal where DeepGEMM is absent")
def test_refuses_without_deepgemm(bench, tmp_path, capsys):
    assert bench.main(["--tokens", "300", "--out", str(tmp_path)]) == 2
    assert "bench_deepgemm_jit: " in capsys.readouterr().err and not list(tmp_path.iterdir())


@pytest.mark.skipif(DeepGemmBackend.unavailable_reason() is not None, reason="needs DeepGEMM on an sm_90 GPU")
def test_runs_every_variant_at_every_count_in_a_fresh_cache(tmp_path):
    """A fresh process (DeepGEMM reads its cache folder when imported), one small Linear, two counts."""
    cmd = [
        sys.executable,
        str(SCRIPTS / "bench_deepgemm_jit.py"),
        "--tokens",
        "300,1000",
        "--linears",
        "o_proj",
        "--repeats",
        "1",
        "--out",
        str(tmp_path),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy(), check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    (path,) = tmp_path.glob("deepgemm-jit-*.json")
    d = json.loads(path.read_text())
    got = [(r["role"], r["compiled_dims"], r["tokens"]) for r in d["rows"]]
    variants = [("fprop", "nk"), ("dgrad", "nk"), ("wgrad", "nk"), ("wgrad", "mn")]
    assert got == [(role, dims, t) for role, dims in variants for t in (300, 1000)]
    assert d["rows"][0]["new_kernels"] > 0, "a fresh cache compiled nothing: is DG_JIT_CACHE_DIR where it writes?"
    assert all(r["steady_ms"] > 0 for r in d["rows"])
    assert all("bits_equal_nk" in r for r in d["rows"] if r["compiled_dims"] == "mn")
