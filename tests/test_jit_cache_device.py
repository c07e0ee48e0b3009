"""third_party/jit_cache_device.sh: the device's JIT caches packed into parts a call brings back and unpacked
from a carried folder (the device runs it; here with a stand-in cache folder)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "third_party" / "jit_cache_device.sh"


def _run(*args, **env):
    return subprocess.run(["bash", str(SCRIPT), *args], env={**os.environ, **env}, capture_output=True, text=True)


def test_caches_round_trip_through_parts(tmp_path):
    cache, out = tmp_path / "cache", tmp_path / "out" / "jit-cache"
    files = {"deep_gemm/kernel/a.cubin": os.urandom(300_000), "triton/x/k.json": b"{}", "vllm/c.py": b"x = 1\n"}
    for rel, data in files.items():
        (cache / rel).parent.mkdir(parents=True, exist_ok=True)
        (cache / rel).write_bytes(data)
    saved = _run("save", str(out), JETRL_JIT_CACHE=str(cache), JETRL_JIT_CACHE_PART_KB="100")
    assert saved.returncode == 0, saved.stderr
    parts = sorted(p.name for p in out.iterdir())
    assert len(parts) == 3 and all(p.startswith("jit-cache.part.") for p in parts)  # 300 kB of noise
    again = tmp_path / "again"
    loaded = _run("load", str(out), JETRL_JIT_CACHE=str(again))
    assert loaded.returncode == 0, loaded.stderr
    assert {str(p.relative_to(again)): p.read_bytes() for p in again.rglob("*") if p.is_file()} == files


def test_a_cache_over_what_a_call_brings_back_is_refused_naming_its_size(tmp_path):
    cache, out = tmp_path / "cache", tmp_path / "out"
    (cache / "deep_gemm").mkdir(parents=True)
    (cache / "deep_gemm" / "big.cubin").write_bytes(os.urandom(300_000))
    r = _run("save", str(out), JETRL_JIT_CACHE=str(cache), JETRL_JIT_CACHE_PART_KB="100", JETRL_JIT_CACHE_MAX_PARTS="2")
    assert r.returncode == 1 and "pack into 3 parts of 100 KiB, more than 2" in r.stdout
    assert "deep_gemm/big.cubin" in r.stdout and not out.exists()
    missing = _run("save", str(out), JETRL_JIT_CACHE=str(tmp_path / "none"))
    assert missing.returncode == 1 and "no " in missing.stdout
