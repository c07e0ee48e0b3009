"""Every rollout method is compile-safe: vLLM runs the Linear methods under torch.compile (fullgraph) and
captures CUDA graphs, so nothing in a method's forward may branch on data or synchronise with the host,
and non-finite input must still be reported (raised at once on CPU, a device flag on CUDA that
`check_rollout_nonfinite` raises on with the layer's name after the graph ran).

CPU: the methods' forwards and the vLLM methods' ``apply`` compiled with ``fullgraph=True``, the
deferred (device-flag) path of the naive method run on CPU tensors. GPU (``gpu`` marker): the naive
method inside a captured CUDA graph, and a vLLM engine started with CUDA graphs for each mode.
"""

import pytest
import torch

from jetrl.quant import NonFiniteError, check_finite, defer_finite_checks, quantize, quantize_128x128
from jetrl.recipe import Recipe
from jetrl.rollout.methods import (
    RolloutQuantConfig,
    block_forward,
    check_rollout_nonfinite,
    naive_forward,
    naive_forward_impl,
    naive_quantize_weight,
    nonfinite_flag,
)

NAIVE = Recipe.from_name("naive-fp8-rollout")
ACT = NAIVE.rollout_activation


def _has_sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


sm90 = pytest.mark.skipif(not _has_sm90(), reason="needs an sm_90 CUDA GPU (vLLM 0.26 with CUDA graphs, DeepGEMM)")


def _operands(m=5, k=256, n=384, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16).to(device)
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16).to(device)
    return x, w


def _naive_reference(x, w_q, w_s):
    """The naive product written out: per-token x scale times the tensor scale, fp32 dequantized sum."""
    x_q, x_s = quantize(x, ACT, name="ref")
    xd = x_q.to(torch.float64) * x_s.to(torch.float64)
    wd = w_q.to(torch.float64) * w_s.to(torch.float64)
    return (xd @ wd.t()).to(torch.float32).to(x.dtype)


@pytest.fixture(autouse=True)
def _clean_flags():
    check_rollout_nonfinite(kernels=False)  # start and end every test with cleared flags
    yield
    try:
        check_rollout_nonfinite(kernels=False)
    except NonFiniteError:
        pass


# -- jetrl.quant.defer_finite_checks ----------------------------------------------------------------


def test_check_finite_raises_at_once_outside_a_deferral():
    with pytest.raises(NonFiniteError, match="layer.a"):
        check_finite(torch.tensor([1.0, float("nan")]), "layer.a")
    check_finite(torch.tensor([1.0, 2.0]), "layer.a")


def test_deferral_hands_every_check_to_the_sink_and_ends_with_the_block():
    seen = []
    with defer_finite_checks(lambda t, name: seen.append((name, bool(torch.isfinite(t).all())))):
        check_finite(torch.tensor([float("inf")]), "bad")
        quantize(torch.tensor([[1.0, 2.0]]), ACT, name="good")  # the quantizer's own check goes there too
    assert seen == [("bad", False), ("good", True)]
    with pytest.raises(NonFiniteError, match="after"):
        check_finite(torch.tensor([float("nan")]), "after")


def test_deferral_refuses_no_sink():
    with pytest.raises(TypeError, match="sink"):
        with defer_finite_checks(None):
            pass


# -- the methods' forwards under torch.compile(fullgraph=True) on CPU --------------------------------


def test_naive_forward_compiles_fullgraph_and_matches_eager_and_reference():
    torch._dynamo.reset()
    x, w = _operands()
    w_q, w_s = naive_quantize_weight(w, NAIVE.rollout_weight, name="w")
    fn = torch.compile(lambda a: naive_forward(a, w_q, w_s, None, act_spec=ACT, name="l.qkv:input"), fullgraph=True)
    y = fn(x)
    eager = naive_forward(x, w_q, w_s, None, act_spec=ACT, name="l.qkv:input")
    assert torch.equal(y, eager)
    assert torch.equal(eager, _naive_reference(x, w_q, w_s))
    # a 3-D input with another token count reuses the graph (dynamic M) and keeps its leading dims
    x3 = _operands(m=12, seed=1)[0].reshape(3, 4, 256)
    assert torch.equal(fn(x3), naive_forward(x3, w_q, w_s, None, act_spec=ACT, name="l.qkv:input"))


def test_naive_forward_compiled_on_cpu_raises_naming_the_layer():
    torch._dynamo.reset()
    x, w = _operands()
    w_q, w_s = naive_quantize_weight(w, NAIVE.rollout_weight, name="w")
    fn = torch.compile(
        lambda a: naive_forward(a, w_q, w_s, None, act_spec=ACT, name="model.layers.1.mlp.down_proj:input"),
        fullgraph=True,
    )
    fn(x)
    x[3, 7] = float("nan")
    with pytest.raises(NonFiniteError, match=r"model\.layers\.1\.mlp\.down_proj:input"):
        fn(x)


def test_block_forward_compiles_fullgraph():
    pytest.importorskip("vllm", reason="the jetrl_fp8 op is registered by jetrl.rollout.vllm_plugin")
    from jetrl.rollout.vllm_plugin import rollout_linear_fp8

    torch._dynamo.reset()
    x, w = _operands()
    w_q, w_s = quantize_128x128(w, name="w")
    fn = torch.compile(lambda a: rollout_linear_fp8(a, w_q, w_s, None, "emulated", "l:input"), fullgraph=True)
    assert torch.equal(fn(x), block_forward(x, w_q, w_s, None, backend="emulated", name="l:input"))


class _Layer(torch.nn.Module):
    pass


@pytest.mark.parametrize("recipe", ["jetrl-unified", "naive-fp8-rollout", "bf16"])
def test_vllm_methods_apply_compiles_fullgraph(recipe):
    """Each vLLM method's ``apply`` (what vLLM's compiled model calls) traces into one graph on CPU."""
    pytest.importorskip("vllm", reason="the vLLM quantization methods need vLLM")
    from jetrl.rollout.vllm_plugin import JetBF16LinearMethod, JetFP8LinearMethod, JetFP8NaiveLinearMethod

    torch._dynamo.reset()
    x, w = _operands()
    cfg = RolloutQuantConfig(recipe=recipe, backend="emulated" if recipe == "jetrl-unified" else "auto")
    layer = _Layer()
    prefix = "model.layers.0.mlp.gate_up_proj"
    if recipe == "bf16":
        method = JetBF16LinearMethod(prefix)
        layer.weight = torch.nn.Parameter(w, requires_grad=False)
        method.process_weights_after_loading(layer)  # what vLLM does after loading (on CPU: no repacking)
    elif recipe == "jetrl-unified":
        method = JetFP8LinearMethod(cfg, prefix)
        q, s = quantize_128x128(w, name="w")
        layer.weight, layer.weight_scale_inv = (torch.nn.Parameter(t, requires_grad=False) for t in (q, s))
    else:
        method = JetFP8NaiveLinearMethod(cfg, prefix)
        q, s = naive_quantize_weight(w, NAIVE.rollout_weight, name="w")
        layer.weight, layer.weight_scale = (torch.nn.Parameter(t, requires_grad=False) for t in (q, s))
    eager = method.apply(layer, x)
    compiled = torch.compile(lambda a: method.apply(layer, a), fullgraph=True)(x)
    assert torch.equal(compiled, eager)


def test_old_naive_path_is_what_dynamo_refuses():
    """The regression this file guards: the naive product traced op by op (its quantizer's host-side
    finite check) does not fit one graph; through the custom op it does."""
    torch._dynamo.reset()
    x, w = _operands()
    w_q, w_s = naive_quantize_weight(w, NAIVE.rollout_weight, name="w")
    traced = torch.compile(lambda a: naive_forward_impl(a, w_q, w_s, None, ACT, "l:input", defer=False), fullgraph=True)
    with pytest.raises(Exception, match="(?i)data-dependent|graph break|Unsupported"):
        traced(x)


# -- the device-flag (CUDA) path, run on CPU tensors -------------------------------------------------


def test_deferred_naive_forward_sets_the_layer_flag_and_check_raises_with_its_name():
    x, w = _operands()
    w_q, w_s = naive_quantize_weight(w, NAIVE.rollout_weight, name="w")
    good = naive_forward_impl(x, w_q, w_s, None, ACT, "model.layers.0.self_attn.o_proj:input", defer=True)
    assert torch.equal(good, _naive_reference(x, w_q, w_s))
    check_rollout_nonfinite(kernels=False)  # finite: nothing raised
    bad = x.clone()
    bad[0, 0] = float("inf")
    naive_forward_impl(bad, w_q, w_s, None, ACT, "model.layers.0.self_attn.o_proj:input", defer=True)
    naive_forward_impl(x, w_q, w_s, None, ACT, "model.layers.1.self_attn.o_proj:input", defer=True)
    assert int(nonfinite_flag("model.layers.0.self_attn.o_proj:input", "cpu")) == 1
    with pytest.raises(NonFiniteError, match=r"layers\.0\.self_attn\.o_proj:input") as e:
        check_rollout_nonfinite(kernels=False)
    assert "layers.1" not in str(e.value)
    check_rollout_nonfinite(kernels=False)  # reset by the raise


def test_deferred_check_skips_cuda_graph_padding_rows():
    """vLLM pads a CUDA-graph batch and leaves the padding rows unwritten: only real rows are inputs."""
    from jetrl.rollout.methods import set_live_rows_provider

    x, w = _operands(m=4)
    w_q, w_s = naive_quantize_weight(w, NAIVE.rollout_weight, name="w")
    real = torch.tensor([7, 12, 0, -1])  # vLLM's slot mapping: 3 tokens padded to a captured size of 4
    seen = []

    def provider(n_rows):
        seen.append(n_rows)
        return real

    set_live_rows_provider(provider)
    try:
        stale = x.clone()
        stale[3] = float("nan")  # the padding row's stale memory
        naive_forward_impl(stale, w_q, w_s, None, ACT, "l.down:input", defer=True)
        check_rollout_nonfinite()
        bad = x.clone()
        bad[1, 9] = float("-inf")  # a real token
        naive_forward_impl(bad.reshape(2, 2, 256), w_q, w_s, None, ACT, "l.down:input", defer=True)
        with pytest.raises(NonFiniteError, match=r"l\.down:input"):
            check_rollout_nonfinite()
        assert seen == [4, 4]
    finally:
        set_live_rows_provider(None)
    with pytest.raises(TypeError, match="callable"):
        set_live_rows_provider(3)


def test_block_forward_hands_the_step_rows_to_the_quantizer_launcher(monkeypatch):
    """The jetrl_fp8 Linear passes the step's rows (`live_rows`: vLLM's slot mapping) to the Triton quantizer on
    the eager fast path, whose flag then skips the padding rows (`tests/kernels/test_launch_options.py`)."""
    from jetrl.gemm import quantize as gq
    from jetrl.kernels.quantize_1x128 import torch_quantize_1x128
    from jetrl.rollout.methods import block_forward, block_quantize_weight, set_live_rows_provider

    seen = []

    def launcher(x, scale_layout, name, live=None):
        seen.append((tuple(x.shape), name, live))
        return torch_quantize_1x128(x, scale_layout=scale_layout, name=name)

    x, w = _operands(m=4)
    w_q, w_s = block_quantize_weight(w, name="w")
    monkeypatch.setattr(gq, "FAST_PATH_DEVICE_TYPES", ("cpu", "cuda"))  # the activations' quantizer: the fake below
    monkeypatch.setitem(gq._LAUNCHERS, "quantize_1x128.launch_quantize_1x128", launcher)
    slots = torch.tensor([7, 12, 0, -1])
    set_live_rows_provider(lambda n_rows: slots if n_rows == 4 else None)
    try:
        block_forward(x.reshape(2, 2, 256), w_q, w_s, None, backend="emulated", name="l.o_proj:input")
        block_forward(x[:3], w_q, w_s, None, backend="emulated", name="l.o_proj:input")  # not the step's rows
    finally:
        set_live_rows_provider(None)
    block_forward(x, w_q, w_s, None, backend="emulated", name="l.o_proj:input")  # no provider
    assert [s[:2] for s in seen] == [
        ((4, 256), "l.o_proj:input"),
        ((3, 256), "l.o_proj:input"),
        ((4, 256), "l.o_proj:input"),
    ]
    assert seen[0][2] is slots and seen[1][2] is None and seen[2][2] is None


class _FakeLLM:
    """What `Engine` needs of ``vllm.LLM`` for the flag bookkeeping: ``apply_model`` on an in-process model."""

    def apply_model(self, fn):
        return [fn(None)]


def test_engine_clears_start_up_flags_and_checks_them_after_generate():
    from jetrl.rollout.adapter import Engine

    x, w = _operands()
    w_q, w_s = naive_quantize_weight(w, NAIVE.rollout_weight, name="w")
    bad = x.clone()
    bad[0, 0] = float("nan")
    naive_forward_impl(bad, w_q, w_s, None, ACT, "warmup.layer:input", defer=True)  # a start-up dummy run
    engine = Engine(_FakeLLM(), NAIVE, rollout="jetrl", in_process=True, start_seconds=0.0)
    engine.check_nonfinite()  # cleared at creation
    naive_forward_impl(bad, w_q, w_s, None, ACT, "model.layers.1.mlp.up:input", defer=True)
    with pytest.raises(NonFiniteError, match=r"model\.layers\.1\.mlp\.up:input"):
        engine.check_nonfinite()
    # an engine in other processes (the fake runs `fn` here): each worker reads its own flags, kernels' too, and
    # the error names the worker
    naive_forward_impl(bad, w_q, w_s, None, ACT, "warmup.layer:input", defer=True)
    remote = Engine(_FakeLLM(), NAIVE, rollout="jetrl", in_process=False, start_seconds=0.0)
    remote.check_nonfinite()  # cleared at creation
    naive_forward_impl(bad, w_q, w_s, None, ACT, "model.layers.0.self_attn.o:input", defer=True)
    with pytest.raises(NonFiniteError, match=r"worker 0: .*model\.layers\.0\.self_attn\.o:input"):
        remote.check_nonfinite()
    remote.check_nonfinite()  # the check cleared them


# -- GPU: CUDA graphs -------------------------------------------------------------------------------


@pytest.mark.gpu
@sm90
def test_gpu_naive_forward_in_a_captured_cuda_graph_flags_non_finite_input():
    x, w = _operands(m=8, device="cuda")
    w_q, w_s = naive_quantize_weight(w, NAIVE.rollout_weight, name="w")
    name = "model.layers.3.mlp.down_proj:input"
    static_x = x.clone()
    naive_forward(static_x, w_q, w_s, None, act_spec=ACT, name=name)  # eager first call: the flag exists
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # a host sync here would fail the capture
        static_y = naive_forward(static_x, w_q, w_s, None, act_spec=ACT, name=name)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_y, _naive_reference(x, w_q, w_s))
    check_rollout_nonfinite()
    static_x[2, 5] = float("nan")
    graph.replay()
    with pytest.raises(NonFiniteError, match=r"layers\.3\.mlp\.down_proj:input"):
        check_rollout_nonfinite()
    static_x.copy_(x)
    graph.replay()
    check_rollout_nonfinite()


GPU_MODES = [("bf16", "jetrl"), ("naive-fp8-rollout", "jetrl"), ("jetrl-unified", "jetrl"), ("jetrl-unified", "stock")]


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize(("recipe", "rollout"), GPU_MODES, ids=[f"{r}-{m}" for r, m in GPU_MODES])
def test_gpu_engine_starts_with_cuda_graphs(tmp_path, recipe, rollout):
    """vLLM with torch.compile + CUDA graphs (the settings a user runs) starts for each mode, generates
    finite log-probs, and the run ends with the non-finite flags checked (Engine.generate does it)."""
    pytest.importorskip("vllm", reason="needs vLLM (0.26 on the H200)")
    from jetrl.rollout.adapter import create_engine
    from jetrl.rollout.sync import sync_weights
    from jetrl.tiny import CharTokenizer, build_tiny_model, save_tiny_checkpoint

    path = save_tiny_checkpoint(tmp_path / "tiny", seed=0)
    kw = {"load_format": "dummy"} if rollout == "stock" else {}
    engine = create_engine(
        path,
        recipe,
        seed=0,
        max_model_len=128,
        enforce_eager=False,
        rollout=rollout,
        gpu_memory_utilization=0.05,
        compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8]},
        **kw,
    )
    try:
        cc = engine.llm.llm_engine.vllm_config.compilation_config
        assert engine.llm.llm_engine.vllm_config.model_config.enforce_eager is False
        assert cc.cudagraph_capture_sizes, f"{recipe}/{rollout}: no CUDA graphs captured ({cc})"
        r = Recipe.from_name(recipe)
        trainer = build_tiny_model(0).cuda()
        if r.train_fp8:
            from jetrl.convert import convert_model

            convert_model(trainer, r)
        sync_weights(trainer, engine, r)  # the stock engine's dummy weights become the trainer's
        tok = CharTokenizer()
        samples = engine.generate([tok.encode(p) for p in ("12+7=", "3*4=", "9+9=")], max_tokens=16, seed=1)
        lps = torch.tensor([lp for s in samples for lp in s.response_logprobs])
        assert lps.numel() and bool(torch.isfinite(lps).all()), (recipe, rollout, lps)
        sizes = cc.cudagraph_capture_sizes
        print(f"\n[{recipe}/{rollout}] engine start {engine.start_seconds:.1f} s, CUDA-graph sizes {sizes}")
    finally:
        engine.close()
