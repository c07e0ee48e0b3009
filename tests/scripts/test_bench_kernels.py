"""bench_kernels' sweep acceptance (`valid_config`), on CPU with the reference ops' outputs."""

from __future__ import annotations

import re

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


def test_sweep_shapes_parse_and_refuse_garbage(bench):
    assert bench._shapes("16384x4096,4096X14336") == [(16384, 4096), (4096, 14336)]
    with pytest.raises(SystemExit, match="--sweep-shapes"):
        bench._shapes("16384,4096")


def test_sweep_names_select_by_name_or_its_head(bench):
    """``--sweep`` names: exact, or the part before ``" ("`` (the RoPE entry's own name holds a comma), or all."""
    assert bench.sweep_names("swiglu_quant,rope") == ["swiglu_quant", "rope (engine RoPE, head_dim 128)"]
    assert bench.sweep_names("all") == list(bench.SWEEPS)
    assert bench.sweep_names("quantize_1x128[row]") == ["quantize_1x128[row]"]
    with pytest.raises(SystemExit, match=re.escape("unknown kernel 'rope (engine RoPE'")):
        bench.sweep_names("rope (engine RoPE, head_dim 128)")


def test_sweep_grids_use_only_launcher_options(bench):
    """Every swept option is one its launcher takes (a typo would fail on the GPU, minutes in)."""
    import inspect

    q1, q128, sq, tq = bench.q1, bench.q128, bench.sq, bench.tq  # the op modules, as the script loads them
    takes = {
        "quantize_1x128[row]": set(inspect.signature(q1.launch_quantize_1x128).parameters),
        "transpose_quantize": set(inspect.signature(tq._launch).parameters),
        "transpose_requantize": set(inspect.signature(tq._launch).parameters),
        "digest (weight sync)": set(inspect.signature(bench.launch_digest).parameters),
        "rmsnorm_quant": {"block_m", "block_k", "num_warps", "rcp"},  # launch_rmsnorm_quant's **config
        "swiglu_quant": set(inspect.signature(sq.launch_swiglu_quant).parameters),
        "quantize_128x128": set(inspect.signature(q128.launch_quantize_128x128).parameters),
        "quantize_128x128[+T]": set(inspect.signature(q128.launch_quantize_128x128).parameters),
        "rope (engine RoPE, head_dim 128)": set(inspect.signature(bench.rp.launch_rope).parameters),
    }
    assert set(bench.SWEEPS) == set(takes)
    x = torch.zeros(256, 256)
    inp = dict(x=x, gate=x, up=x, w=x[0], xq=x, xs=x, rstd=x[0], dy=x, rope_table=x, pos=x[0])
    assert set(bench.SWEEPS) <= {case[0] for case in bench._cases(256, 256, inp)}  # each has a launcher
    for name, configs in bench.SWEEPS.items():
        for c in configs:
            assert set(c) <= takes[name], (name, c)
