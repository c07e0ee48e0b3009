"""bench_kernels' sweep acceptance (`valid_config`), on CPU with the reference ops' outputs."""

from __future__ import annotations

import pytest
import torch
from scripts_cases import load_script

import jetrl.kernels as K


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_kernels")


def test_byte_kernels_need_every_byte(bench):
    x = torch.randn(8, 256, dtype=torch.bfloat16)
    ref = K.quantize_1x128(x)
    assert bench.valid_config("quantize_1x128[row]", K.quantize_1x128(x.clone()), ref)
    q = ref[0].view(torch.uint8).clone()
    q[3, 5] ^= 1
    assert not bench.valid_config("quantize_1x128[row]", (q.view(torch.float8_e4m3fn), ref[1]), ref)


def test_rmsnorm_may_move_y_but_must_quantize_its_own_y(bench):
    x = torch.randn(8, 256, dtype=torch.bfloat16)
    w = torch.ones(256, dtype=torch.bfloat16)
    ref = K.rmsnorm_quant(x, w, 1e-6)
    y2 = ref[0].clone()
    y2[0, :128] *= 2  # as if another reduction order moved y: here a whole group, so its scale moves too
    moved = (y2, *K.quantize_1x128(y2), ref[3])
    assert not bench.valid_config("quantize_1x128[row]", moved, ref)  # a byte kernel would be refused
    assert bench.valid_config("rmsnorm_quant", moved, ref)
    assert not bench.valid_config("rmsnorm_quant", (y2, ref[1], ref[2], ref[3]), ref)  # stale (q, s)
