"""jetrl.kernels.rope / rope_table: transformers' rotary embedding, bit for bit.

Contracts: `torch_rope` equals transformers' ``apply_rotary_pos_emb`` of the module's cos/sin (Llama with
llama3 scaling, Qwen2, Qwen3) bitwise; `rope_table` rows equal what the rotary module returns for those
positions in any call; the kernel equals `torch_rope` bitwise -- on CPU under the Triton interpreter (the
kernel rounds bf16 with integer arithmetic, so the interpreter's truncating bf16 cast is not involved),
and compiled on the GPU against transformers' eager ops on the GPU.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from kernels_cases import run_interpreted

import jetrl.kernels as K

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _config(model_type: str):
    """A small config of `model_type` with its real rope settings (Llama: 3.1's llama3 scaling)."""
    import transformers

    common = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192)
    if model_type == "llama":
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
        return transformers.LlamaConfig(**common, rope_parameters=rope)
    if model_type == "qwen2":
        return transformers.Qwen2Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    return transformers.Qwen3Config(**common, head_dim=128, rope_parameters={"rope_type": "default", "rope_theta": 1e6})


def _modeling(model_type: str):
    return importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")


def _rotary(model_type: str, cfg):
    m = _modeling(model_type)
    cls = next(getattr(m, n) for n in dir(m) if n.endswith("RotaryEmbedding") and n[0].isupper())
    return cls(config=cfg)


def _head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def _rows(t: int, heads: int, hd: int, dtype, seed: int, extra: int = 0) -> torch.Tensor:
    """``[t, heads * hd]`` rows, a column slice of a wider matrix when `extra` > 0 (vLLM's split qkv)."""
    g = torch.Generator().manual_seed(seed)
    big = (torch.randn(t, heads * hd + extra, generator=g) * 4).to(dtype)
    return big[:, : heads * hd]


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("dt", list(DTYPES))
def test_reference_is_transformers_apply_rotary_pos_emb(model_type, dt):
    dtype, cfg = DTYPES[dt], _config(model_type)
    hd, h, hkv, t = _head_dim(cfg), cfg.num_attention_heads, cfg.num_key_value_heads, 9
    rot = _rotary(model_type, cfg)
    pos = torch.tensor([0, 1, 2, 700, 701, 8191, 5000, 13, 4096])
    q, k = _rows(t, h, hd, dtype, 1, extra=2 * hkv * hd), _rows(t, hkv, hd, dtype, 2)
    # transformers: [batch, heads, tokens, head_dim], cos/sin of these positions in one call
    qh, kh = q.reshape(1, t, h, hd).transpose(1, 2), k.reshape(1, t, hkv, hd).transpose(1, 2)
    cos, sin = rot(qh, pos[None])
    qr, kr = _modeling(model_type).apply_rotary_pos_emb(qh, kh, cos, sin)
    table = K.rope_table(rot, 8192, dtype)
    assert torch.equal(K.rope(q, table, pos, hd), qr.transpose(1, 2).reshape(t, h * hd))
    assert torch.equal(K.rope(k, table, pos, hd), kr.transpose(1, 2).reshape(t, hkv * hd))


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_table_rows_are_the_modules_values_in_any_call(model_type):
    cfg = _config(model_type)
    rot = _rotary(model_type, cfg)
    table = K.rope_table(rot, 4096, torch.bfloat16)
    assert table.shape == (2, 4096, _head_dim(cfg)) and table.dtype == torch.bfloat16
    probe = torch.empty(0, dtype=torch.bfloat16)
    for ids in (torch.tensor([[4095, 0, 17]]), torch.arange(100, 164)[None], torch.tensor([[3]])):
        cos, sin = rot(probe, ids)
        assert torch.equal(table[0, ids[0]], cos[0]) and torch.equal(table[1, ids[0]], sin[0]), ids


def test_table_refuses_length_dependent_rope_types():
    import transformers

    cfg = transformers.LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0},
    )
    with pytest.raises(ValueError, match="layer 3 rotary: rope_type='dynamic'"):
        K.rope_table(_rotary("llama", cfg), 64, torch.bfloat16, name="layer 3 rotary")
    with pytest.raises(ValueError, match=">= 1 position"):
        K.rope_table(_rotary("qwen3", _config("qwen3")), 0, torch.bfloat16)


def test_bad_input_is_named():
    table = torch.zeros(2, 16, 64, dtype=torch.bfloat16)
    x = torch.zeros(3, 128, dtype=torch.bfloat16)
    pos = torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="layer.q .* not whole heads of an even head_dim=48"):
        K.rope(x, table, pos, 48, name="layer.q")
    with pytest.raises(ValueError, match=r"table must be a contiguous \[2, positions, 64\]"):
        K.rope(x, table[:1], pos, 64)
    with pytest.raises(ValueError, match="table torch.float32 .* must match x torch.bfloat16"):
        K.rope(x, table.float(), pos, 64)
    with pytest.raises(ValueError, match=r"positions must be int32/int64 \[3\]"):
        K.rope(x, table, pos[:2], 64)
    with pytest.raises(ValueError, match="positions must be int32/int64"):
        K.rope(x, table, pos.float(), 64)


# (tokens, heads, head_dim, dtype, extra columns): strided rows, heads not a multiple of the head block,
# a head_dim that is not a power of two
_INTERP = [(7, 5, 128, "bf16", 256), (4, 3, 64, "fp16", 0), (3, 2, 80, "fp32", 160), (6, 8, 128, "bf16", 0)]


@pytest.fixture(scope="module")
def interp_results():
    calls = []
    for i, (t, h, hd, dt, extra) in enumerate(_INTERP):
        dtype = DTYPES[dt]
        g = torch.Generator().manual_seed(100 + i)
        table = (torch.randn(2, 40, hd, generator=g) * 2).to(dtype)
        pos = torch.randint(0, 40, (t,), generator=g)
        pos[0] = 39
        calls.append(("rope", "launch_rope", (_rows(t, h, hd, dtype, i, extra), table, pos, hd), {}))
    # launch options (speed only): the first case again with other head blocks and warps
    for opts in ({"block_h": 1, "num_warps": 1}, {"block_h": 8, "num_warps": 8}):
        calls.append(("rope", "launch_rope", calls[0][2], {"name": "x", **opts}))
    # q and k in one launch (a GQA pair: k with fewer heads, each with its own row stride)
    for i in _PAIR:
        q, table, pos, hd = calls[i][2]
        k = _rows(q.shape[0], 2, hd, q.dtype, 50 + i, extra=96)
        calls.append(("rope", "launch_rope_pair", (q, k, table, pos, hd), {"name": "layers.0"}))
    # positions outside the table: NaN rows, nothing read
    table = torch.ones(2, 8, 64, dtype=torch.bfloat16)
    calls.append(
        ("rope", "launch_rope", (_rows(4, 2, 64, torch.bfloat16, 9), table, torch.tensor([0, 8, -1, 7]), 64), {})
    )
    return run_interpreted(calls)


@pytest.mark.parametrize("case", range(len(_INTERP)), ids=[f"T{t}-H{h}-D{d}-{dt}" for t, h, d, dt, _ in _INTERP])
def test_kernel_interpreted_is_the_reference_bitwise(interp_results, case):
    r = interp_results[case]
    x, table, pos, hd = r["args"]
    want = K.torch_rope(x, table, pos, hd)
    got = r["out"]
    assert got.is_contiguous() and got.shape == x.shape
    assert torch.equal(got.view(torch.int16 if got.element_size() == 2 else torch.int32),
                       want.contiguous().view(torch.int16 if want.element_size() == 2 else torch.int32))  # fmt: skip


def test_launch_options_change_no_byte(interp_results):
    first = interp_results[0]["out"]
    for r in interp_results[len(_INTERP) : len(_INTERP) + 2]:
        assert torch.equal(r["out"].view(torch.int16), first.view(torch.int16))


_PAIR = (0, 2)  # cases of _INTERP whose q gets a k (bf16 and fp32)


@pytest.mark.parametrize("i", range(len(_PAIR)))
def test_pair_interpreted_is_the_reference_of_each_bitwise(interp_results, i):
    r = interp_results[len(_INTERP) + 2 + i]
    q, k, table, pos, hd = r["args"]
    (qo, ko), width = r["out"], (torch.int16 if q.element_size() == 2 else torch.int32)
    for got, x in ((qo, q), (ko, k)):
        want = K.torch_rope(x, table, pos, hd).contiguous()
        assert got.is_contiguous() and torch.equal(got.view(width), want.view(width))


def test_pair_errors_name_the_tensor():
    table = torch.zeros(2, 16, 64, dtype=torch.bfloat16)
    q, k = torch.zeros(3, 128, dtype=torch.bfloat16), torch.zeros(3, 96, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"layers.4:k \(3, 96\) is not whole heads of an even head_dim=64"):
        K.rope_pair(q, k, table, torch.tensor([0, 1, 2]), 64, name="layers.4")
    with pytest.raises(
        ValueError, match=r"positions must be int32/int64 \[3\] \(one per row of layers.4:k\), got torch.int64 \(2,\)"
    ):
        K.rope_pair(q[:2], k[:, :64], table, torch.tensor([0, 1]), 64, name="layers.4")


def test_kernel_interpreted_outside_the_table_is_nan(interp_results):
    out = interp_results[-1]["out"]
    assert out.isnan().all(1).tolist() == [False, True, True, False]
    x, table, pos, hd = interp_results[-1]["args"]
    with pytest.raises(IndexError, match="x row 1 has position 8, outside the table's 0..7"):
        K.torch_rope(x, table, pos, hd)
    with pytest.raises(IndexError, match="row 0 has position -1"):
        K.rope(x[2:3], table, pos[2:3], hd)  # a negative position does not wrap around


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the compiled kernel)")
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
@pytest.mark.parametrize("t", [1, 256, 4099])
def test_kernel_on_gpu_is_transformers_eager_bitwise(model_type, t):
    cfg = _config(model_type)
    hd, h, hkv = _head_dim(cfg), cfg.num_attention_heads, cfg.num_key_value_heads
    rot = _rotary(model_type, cfg).cuda()
    table = K.rope_table(rot, 8192, torch.bfloat16)
    pos = torch.randint(0, 8192, (t,), generator=torch.Generator().manual_seed(t)).cuda()
    q = _rows(t, h, hd, torch.bfloat16, 3, extra=2 * hkv * hd).cuda()
    qh = q.reshape(1, t, h, hd).transpose(1, 2)
    cos, sin = rot(qh, pos[None])  # the module per call, on the GPU
    qr, _ = _modeling(model_type).apply_rotary_pos_emb(qh, qh, cos, sin)
    got = K.rope(q, table, pos, hd)
    assert torch.equal(got.view(torch.int16), qr.transpose(1, 2).reshape(t, h * hd).contiguous().view(torch.int16))
    k = _rows(t, hkv, hd, torch.bfloat16, 4, extra=h * hd).cuda()  # q and k in one launch: each as alone
    qp, kp = K.rope_pair(q, k, table, pos, hd)
    assert torch.equal(qp.view(torch.int16), got.view(torch.int16))
    assert torch.equal(kp.view(torch.int16), K.rope(k, table, pos, hd).view(torch.int16))
