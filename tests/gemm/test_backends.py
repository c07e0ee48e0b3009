"""GEMM backends: the emulated backend against float64, backend selection errors, linear_fp8, and on an
H200 DeepGEMM / torch-blockwise against each other and against the emulated reference."""

from __future__ import annotations

import pytest
import torch

from jetrl import quant
from jetrl.gemm import BackendUnavailableError, available_backends, get_backend, linear_fp8
from jetrl.gemm.base import is_scale_layout, pad_k, to_scale_layout
from jetrl.testing.numerics import has_sm90, max_abs_diff, sqnr_db

# (M, N, K): real model dims mixed with hostile ones (M=1, 13; K not a multiple of 128 or 256)
SHAPES = [(1, 256, 128), (13, 384, 256), (64, 128, 200), (130, 256, 384)]
IDS = [f"M{m}-N{n}-K{k}" for m, n, k in SHAPES]


def _data(m, n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    x[0, : min(k, 128)] = 0.0  # an all-zero group
    if m > 2:
        x[2] *= 1e3  # one token with a wildly different range
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    return x, w


@pytest.mark.parametrize("m,n,k", SHAPES, ids=IDS)
def test_emulated_roles_vs_float64(m, n, k):
    be = get_backend("emulated")
    x, w = _data(m, n, k)
    dy = torch.randn(m, n, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    xq, xs = quant.quantize_1x128(x)
    wq, ws = quant.quantize_128x128(w)
    y = be.gemm(xq, xs, wq, ws, role="fprop")
    ref = x.double() @ w.double().t()
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()
    assert sqnr_db(ref, y) >= 25, f"fprop {m=} {n=} {k=} sqnr={sqnr_db(ref, y):.1f}"
    dyq, dys = quant.quantize_1x128(dy)
    wtq, wts = wq.t().contiguous(), ws.t().contiguous()  # 128x128 is transpose invariant
    dx = be.gemm(dyq, dys, wtq, wts, role="dgrad")
    ref = dy.double() @ w.double()
    assert sqnr_db(ref, dx) >= 25, f"dgrad {m=} {n=} {k=} sqnr={sqnr_db(ref, dx):.1f}"
    dytq, dyts = quant.quantize_128x1(dy)
    xtq, xts = quant.quantize_128x1(x)
    acc = torch.randn(n, k, dtype=torch.float32)
    start = acc.clone()
    be.gemm_accumulate_(dytq, dyts, xtq, xts, acc)
    ref = dy.double().t() @ x.double()
    assert sqnr_db(ref, acc - start) >= 25, f"wgrad {m=} {n=} {k=} sqnr={sqnr_db(ref, acc - start):.1f}"
    dw = be.gemm(dytq, dyts, xtq, xts, role="wgrad", out_dtype=torch.float32, c=start)
    assert torch.equal(dw, acc)


def test_scale_layout_helpers():
    s = torch.arange(30, dtype=torch.float32).reshape(10, 3)
    d = to_scale_layout(s, "deepgemm")
    assert d.stride() == (1, 12) and torch.equal(d, s) and is_scale_layout(d, "deepgemm")
    assert not is_scale_layout(s, "deepgemm") and to_scale_layout(d, "row").is_contiguous()
    assert to_scale_layout(d, "deepgemm") is d
    q = torch.ones(3, 130).to(quant.FP8_DTYPE)
    p = pad_k(q)
    assert p.shape == (3, 256) and p[:, 130:].float().abs().sum() == 0
    with pytest.raises(ValueError, match="layout"):
        is_scale_layout(s, "colmajor")


def test_backend_selection_errors():
    with pytest.raises(ValueError, match="unknown GEMM backend 'cutlass'"):
        get_backend("cutlass")
    reasons = available_backends()
    assert reasons["emulated"] is None
    if not torch.cuda.is_available():
        assert get_backend("auto").name == "emulated"
        for name in ("deepgemm", "torch-blockwise"):
            with pytest.raises(BackendUnavailableError, match=f"'{name}' unavailable: no CUDA device"):
                get_backend(name)
    be = get_backend("emulated")
    assert get_backend(be) is be


def test_backend_validates_operands():
    be = get_backend("emulated")
    xq, xs = quant.quantize_1x128(torch.randn(4, 256))
    wq, ws = quant.quantize_128x128(torch.randn(128, 256))
    with pytest.raises(ValueError, match="role 'bprop'"):
        be.gemm(xq, xs, wq, ws, role="bprop")
    with pytest.raises(ValueError, match="K mismatch"):
        be.gemm(xq, xs, wq[:, :128].contiguous(), ws[:, :1].contiguous(), role="fprop")
    with pytest.raises(ValueError, match="B scales"):
        be.gemm(xq, xs, wq, ws.t().contiguous(), role="fprop")
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        be.gemm(xq.float(), xs, wq, ws, role="fprop")
    with pytest.raises(ValueError, match="C must be float32"):
        be.gemm(xq, xs, wq, ws, role="fprop", c=torch.zeros(4, 128, dtype=torch.bfloat16))


def test_linear_fp8_is_quantize_then_fprop():
    x, w = _data(13, 256, 384, seed=3)
    x3 = x.reshape(1, 13, 384)
    wq, ws = quant.quantize_128x128(w)
    b = torch.randn(256).to(torch.bfloat16)
    y = linear_fp8(x3, wq, ws, b, backend="emulated", name="layer:input")
    xq, xs = quant.quantize_1x128(x)
    want = quant.gemm_emulated(xq, xs, wq, ws, role="fprop") + b
    assert y.shape == (1, 13, 256) and y.dtype == torch.bfloat16
    assert torch.equal(y.reshape(13, 256), want)


def test_linear_fp8_errors_name_the_tensor():
    wq, ws = quant.quantize_128x128(torch.randn(128, 256))
    with pytest.raises(ValueError, match="L.q_proj:input: input has K=128"):
        linear_fp8(torch.randn(2, 128), wq, ws, backend="emulated", name="L.q_proj:input")
    with pytest.raises(ValueError, match="weight scales"):
        linear_fp8(torch.randn(2, 256), wq, ws[:, :1], backend="emulated", name="w")
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        linear_fp8(torch.randn(2, 256), wq.float(), ws, backend="emulated")
    bad = torch.randn(2, 256)
    bad[1, 7] = float("nan")
    with pytest.raises(quant.NonFiniteError, match="L.o_proj:input"):
        linear_fp8(bad, wq, ws, backend="emulated", name="L.o_proj:input")


def _fake_scaled_mm(a, b, *, scale_a, scale_b, out_dtype):
    """CPU stand-in for cuBLASLt's block-scaled ``torch._scaled_mm`` that also enforces the layout
    rules `torch_blockwise` documents (M a multiple of 4; 1x128 A scales outer-dim-major; with 128x128
    B scales, ceil(K/128) a multiple of 4), then computes the dequantized product in float64."""
    m, k = a.shape
    n = b.shape[1]
    kb = scale_a.shape[1]

    def strides_are(t, want):  # the stride of a size-1 dim is never read
        return all(size == 1 or st == w for size, st, w in zip(t.shape, t.stride(), want, strict=True))

    assert m % 4 == 0 and k % 128 == 0 and kb == k // 128, (a.shape, scale_a.shape)
    assert scale_a.shape == (m, kb) and strides_are(scale_a, (1, m)), scale_a.stride()
    af = a.double() * scale_a.double().repeat_interleave(128, dim=1)
    if scale_b.shape == (kb, -(-n // 128)):  # 128x128 B: scale_b.t() row-major
        assert kb % 4 == 0, f"cuBLASLt 128x128 path with ceil(K/128) = {kb}: wrong results on the H200"
        assert scale_b.t().is_contiguous()
        sb = scale_b.double().repeat_interleave(128, 0).repeat_interleave(128, 1)[:, :n]
    else:  # 1x128 B (wgrad)
        assert scale_b.shape == (kb, n) and strides_are(scale_b.t(), (1, n)), scale_b.stride()
        sb = scale_b.double().repeat_interleave(128, 0)
    return (af @ (b.double() * sb)).to(out_dtype)


@pytest.mark.parametrize("m,n,k", [(132, 512, 384), (13, 384, 640), (64, 1152, 512), (5, 256, 200)])
@pytest.mark.parametrize("role", ["fprop", "dgrad", "wgrad"])
def test_torch_blockwise_operand_preparation(monkeypatch, m, n, k, role):
    """What `torch-blockwise` hands ``torch._scaled_mm`` (padding of M and K, scale layouts), checked on
    CPU against the emulated backend with a stand-in `_scaled_mm` that enforces cuBLASLt's rules."""
    from jetrl.gemm.torch_blockwise import TorchBlockwiseBackend

    monkeypatch.setattr(torch, "_scaled_mm", _fake_scaled_mm)
    x, w = _data(m, n, k)
    dy = torch.randn(m, n, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    if role == "fprop":
        (a, a_s), (b, b_s) = quant.quantize_1x128(x), quant.quantize_128x128(w)
    elif role == "dgrad":
        (a, a_s), (wq, ws) = quant.quantize_1x128(dy), quant.quantize_128x128(w)
        b, b_s = wq.t().contiguous(), ws.t().contiguous()
    else:
        (a, a_s), (b, b_s) = quant.quantize_128x1(dy), quant.quantize_128x1(x)
    out_dtype = torch.float32 if role == "wgrad" else torch.bfloat16
    got = TorchBlockwiseBackend()._gemm(
        a, to_scale_layout(a_s, "deepgemm"), b, b_s, role=role, out_dtype=out_dtype, c=None
    )  # fmt: skip
    want = get_backend("emulated").gemm(a, a_s, b, b_s, role=role, out_dtype=out_dtype)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert sqnr_db(want, got) >= 40, f"{role} {m=} {n=} {k=}: sqnr={sqnr_db(want, got):.1f} dB"


# --------------------------------------------------------------------------------------------------
# H200 only
# --------------------------------------------------------------------------------------------------
# the last two: K and N with ceil(/128) not a multiple of 4 (cuBLASLt's 128x128 path needs K padded there)
GPU_SHAPES = [
    (1, 4096, 4096),
    (7, 6144, 4096),
    (129, 4096, 14336),
    (4096, 14336, 4096),
    (4095, 4096, 4096),
    (132, 384, 640),
    (33, 1152, 384),
]
GPU_IDS = [f"M{m}-N{n}-K{k}" for m, n, k in GPU_SHAPES]
sm90 = pytest.mark.skipif(not has_sm90(), reason="needs an sm_90 GPU for DeepGEMM and cuBLASLt block scaling")


def _gpu_operands(m, n, k, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    x[0, :128] = 0
    if m > 3:
        x[3] *= 1e4
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    dy = torch.randn(m, n, device="cuda", generator=g).to(torch.bfloat16)
    return x, w, dy


@sm90
@pytest.mark.parametrize("m,n,k", GPU_SHAPES, ids=GPU_IDS)
@pytest.mark.parametrize("role", ["fprop", "dgrad", "wgrad"])
def test_gpu_backends_agree(m, n, k, role):
    x, w, dy = _gpu_operands(m, n, k)
    wq, ws = quant.quantize_128x128(w)
    if role == "fprop":
        a, a_s = quant.quantize_1x128(x)
        b, b_s = wq, ws
    elif role == "dgrad":
        a, a_s = quant.quantize_1x128(dy)
        b, b_s = wq.t().contiguous(), ws.t().contiguous()
    else:
        a, a_s = quant.quantize_128x1(dy)
        b, b_s = quant.quantize_128x1(x)
    out_dtype = torch.float32 if role == "wgrad" else torch.bfloat16
    emu = get_backend("emulated").gemm(a, a_s, b, b_s, role=role, out_dtype=out_dtype)
    outs = {}
    for name in ("deepgemm", "torch-blockwise"):
        be = get_backend(name)
        outs[name] = be.gemm(a, to_scale_layout(a_s, be.scale_layout), b, b_s, role=role, out_dtype=out_dtype)
        assert torch.isfinite(outs[name]).all(), f"{name} {role} {m=} {n=} {k=}: non-finite output"
        s = sqnr_db(emu, outs[name])
        assert s >= 40, f"{name} vs emulated {role} {m=} {n=} {k=}: sqnr={s:.1f} dB"
    s = sqnr_db(outs["deepgemm"], outs["torch-blockwise"])
    assert s >= 40, f"deepgemm vs torch-blockwise {role} {m=} {n=} {k=}: sqnr={s:.1f} dB"


def _raw_scaled_mm_diagnostic(a, a_s, b, b_s, emu, k: int, role: str) -> str:
    """What cuBLASLt's raw 128x128-scaled ``torch._scaled_mm`` (no K padding) gives at this K: a recorded
    diagnostic of a third-party behaviour, not a jetrl guarantee (its SQNR has varied across runs, e.g.
    23.5 dB at K=384 on the H200 where another run measured less). Printed for the test log."""
    try:
        raw = torch._scaled_mm(
            a, b.t(), scale_a=to_scale_layout(a_s, "deepgemm"), scale_b=b_s.contiguous().t(), out_dtype=torch.float32
        )
    except RuntimeError as e:  # a refusal is also a behaviour worth recording
        return f"raw _scaled_mm {role} K={k} (ceil(K/128)={-(-k // 128)}): refused: {str(e).splitlines()[0]}"
    return f"raw _scaled_mm {role} K={k} (ceil(K/128)={-(-k // 128)}): {sqnr_db(emu, raw):.1f} dB vs emulated"


@sm90
@pytest.mark.parametrize("k", [128, 256, 384, 512, 640, 768, 896, 1152, 4096 + 384])
@pytest.mark.parametrize("role", ["fprop", "dgrad"])
def test_gpu_torch_blockwise_padded_k_is_right_at_every_k(k, role):
    """What jetrl guarantees: `torch-blockwise` (which zero-pads K so ceil(K/128) is a multiple of 4, because
    cuBLASLt's raw call returns wrong products without error at other K) matches the emulated reference at
    every K, whether or not ceil(K/128) is a multiple of 4. The raw call's SQNR is printed as a diagnostic."""
    x, w, dy = _gpu_operands(132, 512, k) if role == "fprop" else _gpu_operands(132, k, 512)
    if role == "fprop":  # [132, K] @ [512, K]^T
        a, a_s = quant.quantize_1x128(x)
        b, b_s = quant.quantize_128x128(w)
    else:  # dX = dY @ W: [132, K] @ ([K, 512]^T bytes)^T, the reduction over W's N = K here
        a, a_s = quant.quantize_1x128(dy)
        wq, ws = quant.quantize_128x128(w)
        b, b_s = wq.t().contiguous(), ws.t().contiguous()
    emu = get_backend("emulated").gemm(a, a_s, b, b_s, role=role, out_dtype=torch.float32)
    padded = get_backend("torch-blockwise").gemm(a, to_scale_layout(a_s, "deepgemm"), b, b_s, role=role,
                                                 out_dtype=torch.float32)  # fmt: skip
    print(_raw_scaled_mm_diagnostic(a, a_s, b, b_s, emu, k, role))
    s = sqnr_db(emu, padded)
    assert torch.isfinite(padded).all() and s >= 40, f"torch-blockwise {role} K={k}: {s:.1f} dB vs emulated"


@sm90
def test_gpu_wgrad_accumulates_in_place():
    x, _, dy = _gpu_operands(256, 4096, 4096)
    a, a_s = quant.quantize_128x1(dy)
    b, b_s = quant.quantize_128x1(x)
    for name in ("deepgemm", "torch-blockwise"):
        acc = torch.randn(4096, 4096, device="cuda")
        start = acc.clone()
        out = get_backend(name).gemm_accumulate_(a, a_s, b, b_s, acc)
        assert out.data_ptr() == acc.data_ptr()
        ref = get_backend("emulated").gemm(a, a_s, b, b_s, role="wgrad", out_dtype=torch.float32)
        assert sqnr_db(ref, acc - start) >= 40, name


@sm90
def test_gpu_fprop_rows_batch_invariant_and_hostile():
    _, w, _ = _gpu_operands(1, 4096, 4096)
    wq, ws = quant.quantize_128x128(w)
    x = torch.randn(1000, 4096, device="cuda").to(torch.bfloat16)
    x[5] = 0
    x[6] *= 3e4
    x[7, :128] = 1e-30
    for name in ("deepgemm", "torch-blockwise"):
        full = linear_fp8(x, wq, ws, backend=name)
        assert torch.isfinite(full).all(), name
        rows = torch.cat([linear_fp8(x[i : i + 7], wq, ws, backend=name) for i in range(0, 14, 7)])
        assert max_abs_diff(full[:14], rows) == 0.0, f"{name}: rows depend on the batch"


@pytest.mark.parametrize("cls_name", ["DeepGemmBackend", "TorchBlockwiseBackend"])
def test_gpu_backends_state_their_shape_policy_without_a_gpu(cls_name):
    """The shape policy convert_model relies on is plain Python: checked here even where the backend
    cannot run (the instance is made without the availability check)."""
    import jetrl.gemm.deepgemm as dg
    import jetrl.gemm.torch_blockwise as tb

    cls = getattr(dg if cls_name == "DeepGemmBackend" else tb, cls_name)
    be = object.__new__(cls)
    assert be.check_linear_shape(512, 256) is None
    why = be.check_linear_shape(512, 200)
    assert why is not None and be.name in why and "in_features=200" in why
    assert be.check_linear_shape(100, 256) is not None
