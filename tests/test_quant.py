"""The reference quantizers against two independent oracles (a scalar table oracle and ml_dtypes),
on hostile inputs, plus the emulated GEMM against float64."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from jetrl.quant import (
    FP8_DTYPE,
    NonFiniteError,
    compute_scale,
    dequantize_1x128,
    dequantize_128x1,
    dequantize_128x128,
    gemm_emulated,
    quantize,
    quantize_1x128,
    quantize_128x1,
    quantize_128x128,
    quantize_per_tensor,
    quantize_per_token,
)
from jetrl.recipe import Division, Granularity, QuantSpec, ScaleFormat
from jetrl.testing import sqnr_db
from jetrl.testing.oracle import e4m3_code, quantize_1x128_oracle, quantize_128x128_oracle

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
KS = [1, 127, 128, 129, 1000]


def _bytes(q: torch.Tensor) -> np.ndarray:
    return q.view(torch.uint8).numpy()


def _hostile_rows(k: int, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """Rows of K values, one hostile pattern per row, representable in `dtype`."""
    big = 1e30 if dtype != torch.float16 else 6e4
    tiny = 1e-30 if dtype != torch.float16 else 6e-8
    rows = [
        torch.zeros(k),  # all-zero groups
        torch.randn(k, generator=gen),  # plain
        torch.randn(k, generator=gen) * big / 10,  # huge
        torch.randn(k, generator=gen) * tiny,  # tiny (amax below eps)
        torch.where(torch.rand(k, generator=gen) < 0.5, torch.full((k,), big / 3), torch.full((k,), tiny)),  # mixed
        torch.randn(k, generator=gen) * torch.logspace(-8, 3, k),  # wide range inside a group
    ]
    # 448 as group max gives s == 1 exactly: values land on e4m3 ties and on the subnormal range
    ties = torch.tensor([448.0, 1.0625, 1.1875, -2.125, 0.001953125 * 1.5, 0.0009765625, 2.0**-10, 17.0, 240.0])
    rows.append(torch.cat([ties, torch.zeros(max(k - ties.numel(), 0))])[:k])
    # inputs equal to 448, 449, 464, 465 with different group maxima
    edge = torch.tensor([449.0, 448.0, 464.0, 465.0, -465.0, -449.0])
    rows.append(torch.cat([edge, torch.randn(max(k - edge.numel(), 0), generator=gen)])[:k])
    return torch.stack(rows).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("k", KS, ids=lambda k: f"K{k}")
def test_quantize_1x128_matches_scalar_oracle(k, dtype):
    gen = torch.Generator().manual_seed(k)
    x = _hostile_rows(k, gen, dtype)
    q, s = quantize_1x128(x)
    assert q.dtype == FP8_DTYPE and s.dtype == torch.float32
    assert q.shape == x.shape and s.shape == (x.shape[0], math.ceil(k / 128))
    q_ref, s_ref = quantize_1x128_oracle(x.to(torch.float32).numpy())
    np.testing.assert_array_equal(s.numpy().view(np.uint32), s_ref.view(np.uint32), err_msg=f"scales {k=} {dtype=}")
    bad = np.argwhere(_bytes(q) != q_ref)
    assert bad.size == 0, f"{k=} {dtype=}: {len(bad)} bytes differ, first at {bad[0].tolist()}"


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_quantize_1x128_matches_ml_dtypes_on_random_data(dtype):
    """A second, vectorized oracle (numpy float32 division + ml_dtypes' RNE cast) on 1M values."""
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(512, 2048, generator=gen) * torch.logspace(-3, 3, 512)[:, None]).to(dtype)
    q, s = quantize_1x128(x)
    xf = x.to(torch.float32).numpy().reshape(512, 16, 128)
    amax = np.abs(xf).max(axis=-1)
    s_ref = (np.maximum(amax, np.float32(1e-10)).astype(np.float64) / 448.0).astype(np.float32)
    qv = (xf.astype(np.float64) / s_ref[..., None].astype(np.float64)).astype(np.float32)
    q_ref = np.clip(qv, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8).reshape(512, 2048)
    np.testing.assert_array_equal(s.numpy(), s_ref)
    assert (_bytes(q) != q_ref).sum() == 0


def test_e4m3_cast_saturation_and_ties_pinned():
    """The clamp-before-cast rule and RNE ties, at scale 1 (group max 448)."""
    vals = [448.0, 449.0, 464.0, 465.0, 1e6, 1.0625, 1.1875, 2.0**-9, 2.0**-10, 3 * 2.0**-11]
    x = torch.tensor([vals + [0.0] * (128 - len(vals))])
    x[0, -1] = 448.0
    q, s = quantize_1x128(x)
    assert s.item() == pytest.approx(1e6 / 448.0)  # 1e6 is the max: everything is rescaled
    x2 = torch.tensor([[448.0, 1.0625, 1.1875, 2.0**-9, 2.0**-10, 3 * 2.0**-11, 2.0**-11, 0.0]])
    q2, s2 = quantize_1x128(x2)
    assert s2.item() == 1.0
    got = _bytes(q2)[0].tolist()
    want = [e4m3_code(v) for v in [448.0, 1.0, 1.25, 2.0**-9, 2.0**-10, 2.0**-9, 0.0, 0.0]]
    assert got == want
    # 3*2^-11 is exactly between the subnormals 2^-10 and 2^-9 (codes 1 and 2): ties to even -> 2^-9


def test_quantize_1x128_non_contiguous_and_batched():
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(300, 64, generator=gen, dtype=torch.float32).to(torch.bfloat16)
    x = base.t()  # [64, 300], last dim strided
    assert not x.is_contiguous()
    q, s = quantize_1x128(x)
    q2, s2 = quantize_1x128(x.contiguous())
    assert torch.equal(_t(q), _t(q2)) and torch.equal(s, s2)
    x3 = torch.randn(2, 3, 5, 260, generator=gen)[:, :, ::2]  # leading dims, strided
    q3, s3 = quantize_1x128(x3)
    q4, s4 = quantize_1x128(x3.reshape(-1, 260))
    assert q3.shape == x3.shape and s3.shape == (2, 3, 3, 3)
    assert torch.equal(_t(q3).reshape(-1, 260), _t(q4)) and torch.equal(s3.reshape(-1, 3), s4)


def _t(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


@pytest.mark.parametrize("shape", [(0, 256), (4, 0), (0, 0)], ids=str)
def test_empty_inputs(shape):
    x = torch.empty(shape, dtype=torch.bfloat16)
    q, s = quantize_1x128(x)
    assert q.shape == shape and s.shape == (shape[0], math.ceil(shape[1] / 128))
    qw, sw = quantize_128x128(x)
    assert qw.shape == shape and sw.shape == (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_non_finite_raises_with_name(bad):
    x = torch.randn(4, 256)
    x[2, 17] = bad
    name = "model.layers.3.mlp.down_proj:input"
    with pytest.raises(NonFiniteError, match=r"model\.layers\.3\.mlp\.down_proj:input"):
        quantize_1x128(x, name=name)
    with pytest.raises(ValueError, match="w_bad"):  # NonFiniteError is a ValueError
        quantize_128x128(x, name="w_bad")


@pytest.mark.parametrize("shape", [(128, 128), (256, 384), (300, 129), (1, 1000), (129, 1)], ids=str)
def test_quantize_128x128_matches_oracle(shape):
    gen = torch.Generator().manual_seed(shape[0] * 7 + shape[1])
    w = torch.randn(*shape, generator=gen) * 0.02
    if shape[0] >= 256:
        w[128:256, :128] = 0.0  # an all-zero block
        w[:128, :128] *= 1e28  # a huge block beside normal ones
    q, s = quantize_128x128(w)
    q_ref, s_ref = quantize_128x128_oracle(w.numpy())
    np.testing.assert_array_equal(s.numpy(), s_ref)
    assert (_bytes(q) != q_ref).sum() == 0


@pytest.mark.parametrize("shape", [(256, 512), (300, 129), (129, 1000), (1, 7)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_quantize_128x128_transpose_invariance(shape, dtype):
    gen = torch.Generator().manual_seed(11)
    w = (torch.randn(*shape, generator=gen) * torch.logspace(-2, 2, shape[1])).to(dtype)
    q, s = quantize_128x128(w)
    qt, st = quantize_128x128(w.t())
    assert torch.equal(_t(qt), _t(q).t()), f"{shape=} bytes of W^T != transposed bytes of W"
    assert torch.equal(st, s.t())


def test_dequantize_round_trip_error_bounded():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(64, 1000, generator=gen)
    q, s = quantize_1x128(x)
    xd = dequantize_1x128(q, s)
    # relative error of e4m3 RNE is at most 2^-4 of the group amax-scaled grid spacing
    assert sqnr_db(x, xd) > 28
    w = torch.randn(300, 260, generator=gen)
    wq, ws = quantize_128x128(w)
    assert sqnr_db(w, dequantize_128x128(wq, ws)) > 28
    qt, st = quantize_128x1(x)
    assert qt.shape == (1000, 64) and st.shape == (1000, 1)
    assert sqnr_db(x, dequantize_128x1(qt, st)) > 28
    with pytest.raises(ValueError, match="scale shape"):
        dequantize_1x128(q, s[:, :3])


def test_pow2_scales():
    amax = torch.tensor([448.0, 449.0, 896.0, 1.0, 0.0, 3e-8, 1e30])
    s = compute_scale(amax, scale_format="pow2")
    s_fp32 = compute_scale(amax)
    mant, _ = torch.frexp(s)
    assert bool((mant == 0.5).all()), "pow2 scales must be powers of two"
    assert bool((s >= s_fp32).all()), "pow2 scales round up (no value may exceed 448 after division)"
    assert s[0] == 1.0 and s[2] == 2.0, "exact powers of two are kept"
    assert s[1] == 2.0
    x = torch.randn(8, 256) * 3
    q, sp = quantize_1x128(x, scale_format=ScaleFormat.POW2)
    assert bool((torch.frexp(sp)[0] == 0.5).all())
    q_fp32, _ = quantize_1x128(x)
    assert not torch.equal(_t(q), _t(q_fp32)), "pow2 and fp32 scales must give different bytes on random data"


def test_variant_specs_dispatch_and_differ():
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(64, 512, generator=gen).to(torch.bfloat16)
    truth = quantize(x, QuantSpec(Granularity.G1x128))
    assert torch.equal(_t(truth[0]), _t(quantize_1x128(x)[0]))
    zeros = torch.zeros(2, 128)
    _, s_eps = quantize(zeros, QuantSpec(Granularity.G1x128))
    _, s_eps0 = quantize(zeros, QuantSpec(Granularity.G1x128, eps=0.0))
    assert float(s_eps[0, 0]) == pytest.approx(1e-10 / 448) and float(s_eps0[0, 0]) == 0.0
    q_tok, s_tok = quantize_per_token(x)
    assert s_tok.shape == (64, 1)
    q_ten, s_ten = quantize_per_tensor(x)
    assert s_ten.shape == () and float(s_ten) == pytest.approx(float(x.float().abs().max()) / 448)
    # the reciprocal variant is a different formula; on a crafted value it rounds differently
    recip = QuantSpec(Granularity.G1x128, division=Division.RECIPROCAL)
    xs = _find_reciprocal_disagreement()
    assert not torch.equal(_t(quantize(xs, recip)[0]), _t(quantize_1x128(xs)[0]))


def _find_reciprocal_disagreement() -> torch.Tensor:
    """A group where x*(1/s) and x/s land on different e4m3 values (searched, then asserted)."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        x = torch.randn(4096, 128, generator=gen)
        s = compute_scale(x.abs().amax(-1, keepdim=True))
        a = torch.clamp(x / s, -448, 448).to(FP8_DTYPE).view(torch.uint8)
        b = torch.clamp(x * (1 / s), -448, 448).to(FP8_DTYPE).view(torch.uint8)
        rows = (a != b).any(-1).nonzero()
        if rows.numel():
            return x[rows[0]]
    raise AssertionError("no disagreement found between x/s and x*(1/s) in 800k groups")


# ---------------------------------------------------------------------------------------------
# Emulated GEMM
# ---------------------------------------------------------------------------------------------

GEMM_SHAPES = [(64, 256, 384), (13, 129, 200), (1, 512, 128), (200, 1000, 260)]


@pytest.mark.parametrize("m,k,n", GEMM_SHAPES, ids=lambda v: str(v))
def test_gemm_emulated_fprop_dgrad_wgrad_sqnr(m, k, n):
    gen = torch.Generator().manual_seed(m + k + n)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16)
    dy = torch.randn(m, n, generator=gen).to(torch.bfloat16)
    x64, w64, dy64 = x.double(), w.double(), dy.double()

    # fprop: Y = X W^T.  Shapes: [M, K] @ [N, K]^T -> [M, N]
    xq, xs = quantize_1x128(x)
    wq, ws = quantize_128x128(w)
    y = gemm_emulated(xq, xs, wq, ws, role="fprop", out_dtype=torch.float32)
    assert sqnr_db(x64 @ w64.t(), y) >= 25

    # dgrad: dX = dY W.  Shapes: [M, N] @ [K, N]^T -> [M, K]  (W^T bytes, transposed scale grid)
    dyq, dys = quantize_1x128(dy)
    dx = gemm_emulated(dyq, dys, wq.t().contiguous(), ws.t().contiguous(), role="dgrad", out_dtype=torch.float32)
    assert sqnr_db(dy64 @ w64, dx) >= 25

    # wgrad: dW = dY^T X.  Shapes: [N, M] @ [K, M]^T -> [N, K], 1x128 along the token axis, fp32 accumulate
    dytq, dyts = quantize_128x1(dy)
    xtq, xts = quantize_128x1(x)
    c = torch.full((n, k), 0.5)
    dw = gemm_emulated(dytq, dyts, xtq, xts, role="wgrad", out_dtype=torch.float32, c=c)
    assert sqnr_db(dy64.t() @ x64 + 0.5, dw) >= 25


def test_gemm_emulated_is_batch_invariant_and_exact_per_block():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(257, 512, generator=gen)
    w = torch.randn(384, 512, generator=gen)
    xq, xs = quantize_1x128(x)
    wq, ws = quantize_128x128(w)
    full = gemm_emulated(xq, xs, wq, ws, role="fprop", out_dtype=torch.float32)
    for rows in (slice(0, 1), slice(5, 12), slice(100, 257)):
        part = gemm_emulated(xq[rows], xs[rows], wq, ws, role="fprop", out_dtype=torch.float32)
        assert torch.equal(part, full[rows]), f"rows {rows} differ between M=257 and M={rows.stop - rows.start}"
    ref = dequantize_1x128(xq, xs, torch.float64) @ dequantize_128x128(wq, ws, torch.float64).t()
    assert torch.equal(full, ref.to(torch.float32)) or sqnr_db(ref, full) > 120


def test_gemm_emulated_rejects_bad_operands():
    xq, xs = quantize_1x128(torch.randn(4, 256))
    wq, ws = quantize_128x128(torch.randn(128, 256))
    with pytest.raises(ValueError, match="role"):
        gemm_emulated(xq, xs, wq, ws, role="fwd")
    with pytest.raises(ValueError, match="K mismatch"):
        gemm_emulated(xq, xs, wq[:, :128], ws[:, :1], role="fprop")
    with pytest.raises(ValueError, match=r"gemm_emulated\[wgrad\]\.B"):
        gemm_emulated(xq, xs, wq, ws, role="wgrad")
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        gemm_emulated(xq.float(), xs, wq, ws, role="fprop")


def test_cast_clamps_before_rounding():
    """Quotients above 448 saturate to +-448 (a bare .to(float8_e4m3fn) gives NaN above 464)."""
    from jetrl.quant import _to_e4m3

    y = torch.tensor([448.0, 449.0, 464.0, 465.0, 1e9, -465.0, -449.0])
    q = _to_e4m3(y, torch.ones(()), Division.TRUE).view(torch.uint8).tolist()
    assert q == [e4m3_code(448.0)] * 5 + [e4m3_code(-448.0)] * 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CPU/CUDA agreement of the reference)")
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_reference_identical_on_cuda_and_cpu(dtype):
    """The CUDA scalar-division pitfall (NUMERICS.md section 3): the reference must give the same
    bits on both devices."""
    gen = torch.Generator().manual_seed(2)
    span = 4 if dtype == torch.float16 else 20  # stay finite in each dtype
    x = (torch.randn(4096, 1000, generator=gen) * torch.logspace(-span, span, 4096)[:, None]).to(dtype)
    for fn in (quantize_1x128, quantize_128x128):
        q_c, s_c = fn(x)
        q_g, s_g = fn(x.cuda())
        assert torch.equal(s_g.cpu(), s_c), f"{fn.__name__}: scales differ between CUDA and CPU"
        assert torch.equal(_t(q_g.cpu()), _t(q_c)), f"{fn.__name__}: bytes differ between CUDA and CPU"


def test_sqnr_db_exact_known_and_non_finite():
    ref = torch.tensor([3.0, 4.0], dtype=torch.float64)
    assert sqnr_db(ref, ref.clone()) == math.inf
    assert abs(sqnr_db(ref, ref * 1.1) - 20.0) < 1e-9  # noise = 1% of the signal power
    # a GEMM returning garbage can hold Inf/NaN: that is the worst match, not a math domain error
    for bad in (float("inf"), float("nan")):
        assert sqnr_db(ref, torch.tensor([bad, 4.0], dtype=torch.float64)) == -math.inf
