"""Rollout pieces that need no engine: the quant config, the naive emulation, digests, sync planning,
stock-vLLM settings."""

import pytest
import torch

from jetrl.quant import quantize_128x128
from jetrl.recipe import Recipe, RecipeError
from jetrl.rollout.adapter import ParamInfo, stock_block_fp8_unavailable_reason, stock_vllm_settings
from jetrl.rollout.methods import RolloutQuantConfig, naive_forward, naive_quantize_weight
from jetrl.rollout.sync import WeightSyncError, plan_sync, tensor_digest

PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


# -- RolloutQuantConfig -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("recipe", "method"),
    [("jetrl-unified", "jetrl_fp8"), ("naive-fp8-rollout", "jetrl_fp8_naive"), ("bf16", "jetrl_bf16")],
)
def test_config_round_trip(recipe, method):
    cfg = RolloutQuantConfig(recipe=recipe, backend="emulated" if recipe != "bf16" else "auto")
    d = cfg.to_hf_dict()
    assert d["quant_method"] == method
    assert RolloutQuantConfig.from_hf_dict(d) == cfg


def test_stock_block_fp8_checkpoint_config_is_accepted():
    cfg = RolloutQuantConfig.from_hf_dict(
        {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
            "ignored_layers": ["a"],
        }
    )
    assert (cfg.method_name, cfg.checkpoint_format, cfg.ignored_layers) == ("jetrl_fp8", "fp8-128x128", ("a",))
    assert cfg.keeps_bf16("a") and cfg.keeps_bf16("lm_head") and not cfg.keeps_bf16("model.layers.0.mlp.gate_proj")


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"scale_fmt": "ue8m0"}, "scale_fmt"),
        ({"weight_block_size": [128, 64]}, "weight_block_size"),
        ({"weight_block_size": None}, "weight_block_size"),
        ({"activation_scheme": "static"}, "activation_scheme"),
    ],
    ids=["pow2-scales", "block-128x64", "per-tensor-ckpt", "static-acts"],
)
def test_incompatible_fp8_checkpoints_are_refused(extra, match):
    base = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    with pytest.raises(ValueError, match=match):
        RolloutQuantConfig.from_hf_dict({**base, **extra})


def test_config_refusals():
    with pytest.raises(ValueError, match="BF16 checkpoint"):
        RolloutQuantConfig(recipe="naive-fp8-rollout", checkpoint_format="fp8-128x128")
    with pytest.raises(ValueError, match="emulated only"):
        RolloutQuantConfig(recipe="naive-fp8-rollout", backend="deepgemm")
    with pytest.raises(RecipeError, match="unknown recipe"):
        RolloutQuantConfig(recipe="nope")
    with pytest.raises(ValueError, match="unknown jetrl fields"):
        RolloutQuantConfig.from_hf_dict({"quant_method": "jetrl_fp8", "bogus": 1})
    with pytest.raises(ValueError, match="not a jetrl method"):
        RolloutQuantConfig.from_hf_dict({"quant_method": "awq"})


# -- naive emulation ----------------------------------------------------------------------------


def test_naive_forward_is_per_token_times_per_tensor():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 256, generator=g).to(torch.bfloat16)
    x[2, 7] = 40.0  # an outlier: its token's scale grows, other tokens are unaffected
    w = (torch.randn(384, 256, generator=g) * 0.05).to(torch.bfloat16)
    recipe = Recipe.from_name("naive-fp8-rollout")
    wq, ws = naive_quantize_weight(w, recipe.rollout_weight, name="w")
    assert ws.shape == () and torch.equal(ws, w.float().abs().max() / torch.tensor(448.0))
    y = naive_forward(x, wq, ws, None, act_spec=recipe.rollout_activation, name="x")
    amax = x.float().abs().amax(dim=1, keepdim=True).clamp_min(1.0 / 512.0)
    xs = amax / 448.0
    xq = torch.clamp(x.float() / xs, -448, 448).to(torch.float8_e4m3fn)
    ref = (xq.double() * xs.double()) @ (wq.double() * float(ws)).t()
    assert y.dtype == torch.bfloat16 and y.shape == (5, 384)
    err = (y.double() - ref).abs().max().item()
    assert err <= 2**-7 * ref.abs().max().item(), f"{err=:.3e}"
    bf16_ref = x.float() @ w.float().t()
    assert not torch.equal(y.float(), bf16_ref.to(torch.bfloat16).float()), "naive must differ from BF16"


# -- digests ------------------------------------------------------------------------------------


def test_digest_detects_every_single_byte_flip():
    g = torch.Generator().manual_seed(1)
    q, s = quantize_128x128(torch.randn(256, 384, generator=g))
    d0 = tensor_digest(q)
    assert tensor_digest(q.clone()) == d0 and tensor_digest(s) != d0
    raw = q.view(torch.uint8).reshape(-1)
    for pos in torch.randint(0, raw.numel(), (64,), generator=g).tolist() + [0, raw.numel() - 1]:
        bad = raw.clone()
        bad[pos] ^= 1 << (pos % 8)
        assert tensor_digest(bad.view(torch.float8_e4m3fn).reshape(q.shape)) != d0, pos
    assert tensor_digest(q.view(torch.uint8)) != d0, "dtype is part of the digest"
    assert tensor_digest(q.t()) != d0 and tensor_digest(q.t().contiguous()) == tensor_digest(q.t())


# -- sync planning --------------------------------------------------------------------------------


def _info(shape, dtype, mode=None, vocab=False):
    return ParamInfo(tuple(shape), dtype, vocab, mode)


def _fp8(n, k):
    return quantize_128x128(torch.randn(n, k))


def test_plan_places_fused_parts_on_128_row_boundaries():
    pre = "model.layers.0.self_attn"
    payload = {f"{pre}.q_proj.weight": _fp8(256, 256), f"{pre}.k_proj.weight": _fp8(128, 256)}
    payload[f"{pre}.v_proj.weight"] = _fp8(128, 256)
    info = {
        f"{pre}.qkv_proj.weight": _info((512, 256), "float8_e4m3fn", "block"),
        f"{pre}.qkv_proj.weight_scale_inv": _info((4, 2), "float32", "block"),
    }
    plan = {p.hf_name: p for p in plan_sync(payload, info, PACKED)}
    v = plan[f"{pre}.v_proj.weight"]
    assert (v.engine_param, v.row0, v.rows, v.scale_row0, v.scale_rows) == (f"{pre}.qkv_proj.weight", 384, 128, 3, 1)


def test_plan_refuses_parts_off_the_block_grid_naming_them():
    pre = "model.layers.0.self_attn"
    payload = {f"{pre}.q_proj.weight": _fp8(192, 256), f"{pre}.k_proj.weight": _fp8(64, 256)}
    payload[f"{pre}.v_proj.weight"] = _fp8(64, 256)
    info = {
        f"{pre}.qkv_proj.weight": _info((320, 256), "float8_e4m3fn", "block"),
        f"{pre}.qkv_proj.weight_scale_inv": _info((3, 2), "float32", "block"),
    }
    with pytest.raises(WeightSyncError, match=r"q_proj\.weight: part of fused .*qkv_proj\.weight at rows \[0, 192\)"):
        plan_sync(payload, info, PACKED)


def test_plan_refuses_precision_mismatch_and_gaps():
    name = "model.layers.0.mlp.down_proj.weight"
    info_fp8 = {name: _info((256, 512), "float8_e4m3fn", "block"), name + "_scale_inv": _info((2, 4), "float32")}
    with pytest.raises(WeightSyncError, match="down_proj.weight: the trainer sends BF16"):
        plan_sync({name: torch.zeros(256, 512, dtype=torch.bfloat16)}, info_fp8, PACKED)
    with pytest.raises(WeightSyncError, match="down_proj.weight: the trainer sends fp8 bytes"):
        plan_sync({name: _fp8(256, 512)}, {name: _info((256, 512), "bfloat16", "bf16")}, PACKED)
    extra = {**info_fp8, "model.norm.weight": _info((512,), "bfloat16")}
    with pytest.raises(WeightSyncError, match=r"model\.norm\.weight .* receives 0 of 512 rows"):
        plan_sync({name: _fp8(256, 512)}, extra, PACKED)
    with pytest.raises(WeightSyncError, match="foo.weight: no engine parameter"):
        plan_sync({"foo.weight": torch.zeros(3)}, {}, PACKED)
    packed_cpu = {name: _info((0,), "bfloat16", None)}
    with pytest.raises(WeightSyncError, match="repacked"):
        plan_sync({name: torch.zeros(256, 512, dtype=torch.bfloat16)}, packed_cpu, PACKED)


def test_plan_leaves_padded_vocab_rows_alone():
    payload = {"lm_head.weight": torch.zeros(78, 256, dtype=torch.bfloat16)}
    plan = plan_sync(payload, {"lm_head.weight": _info((128, 256), "bfloat16", vocab=True)}, PACKED)
    assert (plan[0].row0, plan[0].rows) == (0, 78)
    with pytest.raises(WeightSyncError, match="receives 78 of 128"):
        plan_sync(payload, {"lm_head.weight": _info((128, 256), "bfloat16", vocab=False)}, PACKED)


# -- stock vLLM settings ----------------------------------------------------------------------------


def test_stock_vllm_settings_for_each_recipe():
    kw, env = stock_vllm_settings("jetrl-unified")
    qc = kw["hf_overrides"]["quantization_config"]
    assert kw["quantization"] == "fp8" and kw["dtype"] == "bfloat16"
    assert qc == {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    assert "scale_fmt" not in qc
    assert env["VLLM_USE_DEEP_GEMM_E8M0"] == "0" and env["VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER"] == "0"
    assert env["VLLM_USE_DEEP_GEMM"] == "1"
    # the settings describe the unified recipe's rollout: the checkpoint config they produce maps back to it
    assert RolloutQuantConfig.from_hf_dict(qc).recipe_obj.rollout_matches_training() == []
    kw, env = stock_vllm_settings("naive-fp8-rollout")
    assert kw["quantization"] in ("fp8_per_tensor", "fp8") and env == {}
    assert stock_vllm_settings("bf16") == ({"dtype": "bfloat16"}, {})


@pytest.mark.skipif(stock_block_fp8_unavailable_reason() is None, reason="this machine can run stock block FP8")
def test_stock_block_fp8_is_refused_here_with_the_reason(tmp_path):
    from jetrl.rollout.adapter import create_engine

    with pytest.raises(RuntimeError, match="AMX"):
        create_engine(tmp_path, "jetrl-unified", seed=0, max_model_len=64, rollout="stock")


def test_rollout_linear_op_is_linear_fp8_and_traces_as_one_node():
    pytest.importorskip("vllm")
    from jetrl.gemm import linear_fp8
    from jetrl.rollout.vllm_plugin import rollout_linear_fp8

    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 256, generator=g).to(torch.bfloat16)
    wq, ws = quantize_128x128(torch.randn(384, 256, generator=g) * 0.05)
    bias = torch.randn(384, generator=g).to(torch.bfloat16)
    want = linear_fp8(x, wq, ws, bias, backend="emulated", name="x")
    got = rollout_linear_fp8(x, wq, ws, bias, "emulated", "x")
    assert torch.equal(got, want) and got.shape == (2, 3, 384)
    compiled = torch.compile(
        lambda a: rollout_linear_fp8(a, wq, ws, None, "emulated", "x"), fullgraph=True, backend="eager"
    )
    assert torch.equal(compiled(x), linear_fp8(x, wq, ws, None, backend="emulated", name="x"))


def test_layer_mode_treats_stock_block_fp8_like_jetrl_fp8():
    from jetrl.rollout.adapter import layer_mode

    class Fp8LinearMethod:  # stand-in named like vLLM's; layer_mode dispatches on the class name
        def __init__(self, block_quant):
            self.block_quant = block_quant

    class Fp8PerTensorOnlineLinearMethod:
        pass

    def layer(method, **attrs):
        mod = torch.nn.Module()
        mod.quant_method = method
        for k, v in attrs.items():
            setattr(mod, k, v)
        return mod

    assert layer_mode(layer(Fp8LinearMethod(True), weight_block_size=[128, 128])) == "block"
    assert layer_mode(layer(Fp8LinearMethod(True), weight_block_size=[128, 64])) is None
    assert layer_mode(layer(Fp8PerTensorOnlineLinearMethod())) == "stock-online-fp8"
    assert layer_mode(layer(None, jetrl_mode="naive")) == "naive"
    assert layer_mode(torch.nn.LayerNorm(4)) is None
    name = "model.layers.0.mlp.down_proj.weight"
    with pytest.raises(WeightSyncError, match="online per-tensor FP8"):
        plan_sync({name: torch.zeros(256, 512)}, {name: _info((512, 256), "float8_e4m3fn", "stock-online-fp8")}, PACKED)


# -- the sampled tokens' log-probs out of vLLM's FlatLogprobs -----------------------------------


def test_sampled_logprobs_read_the_flat_lists_and_refuse_anything_else():
    pytest.importorskip("vllm", reason="vLLM's FlatLogprobs")
    from vllm.logprobs import FlatLogprobs, Logprob

    from jetrl.rollout.adapter import _sampled_logprobs

    flat = FlatLogprobs()
    for t, lp in ((5, -0.25), (9, -1.5), (5, -3.0)):
        flat.append({t: Logprob(logprob=lp, rank=1)})
    assert _sampled_logprobs(flat, [5, 9, 5]) == [-0.25, -1.5, -3.0]
    with pytest.raises(RuntimeError, match="3 entries over 3 positions for a completion of 3 tokens"):
        _sampled_logprobs(flat, [5, 9, 6])  # another token than the one sampled
    with pytest.raises(RuntimeError, match="for a completion of 2 tokens"):
        _sampled_logprobs(flat, [5, 9])
    two = FlatLogprobs()
    two.append({5: Logprob(logprob=-0.25), 7: Logprob(logprob=-2.0)})  # a top-k entry beside the sampled one
    two.append(None)
    with pytest.raises(RuntimeError, match="2 entries over 2 positions"):
        _sampled_logprobs(two, [5, 7])
    with pytest.raises(RuntimeError, match="returned list log-probs.*not FlatLogprobs"):
        _sampled_logprobs([{5: Logprob(logprob=-0.25)}], [5])
    with pytest.raises(RuntimeError, match="returned NoneType"):
        _sampled_logprobs(None, [5])


@pytest.mark.parametrize(("has_amx", "granted"), [(True, True), (True, False), (False, False)])
def test_the_plugin_asks_for_amx_permission_where_the_cpu_has_amx(monkeypatch, has_amx, granted):
    pytest.importorskip("vllm")
    from jetrl.rollout import vllm_plugin

    asked = []
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: has_amx)
    monkeypatch.setattr(torch.cpu, "_init_amx", lambda: asked.append(1) or granted)
    if has_amx and not granted:
        with pytest.raises(RuntimeError, match=r"refused .* AMX tiles \(arch_prctl ARCH_REQ_XCOMP_PERM\)"):
            vllm_plugin.register()
    else:
        vllm_plugin.register()
    assert asked == ([1] if has_amx else [])


def test_the_plugin_warms_a_compiling_gemm_backend_up_once_per_linear_shape(monkeypatch):
    """`_warm_up_gemm` (called by jetrl_fp8's process_weights_after_loading): a backend that compiles per shape
    is warmed up to vLLM's max_num_batched_tokens once per (n, k) in the process; VLLM_DEEP_GEMM_WARMUP=skip
    skips it; without vLLM's current config it refuses with the layer's name; other backends need nothing."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    import vllm.config

    from jetrl.gemm.base import GemmBackend
    from jetrl.rollout import vllm_plugin

    class Compiling(GemmBackend):
        name = "jit-test"
        compiles_per_shape = True

        def __init__(self):
            self.calls = []

        def warm_up(self, n, k, max_rows, device):
            self.calls.append((n, k, max_rows, str(device)))
            return 1

    be, cfg = Compiling(), None
    monkeypatch.setattr(vllm_plugin, "_WARMED", set())
    monkeypatch.setattr(vllm.config, "get_current_vllm_config_or_none", lambda: cfg)
    monkeypatch.delenv("VLLM_DEEP_GEMM_WARMUP", raising=False)
    w, w2 = torch.empty(256, 128), torch.empty(384, 128)
    vllm_plugin._warm_up_gemm("emulated", w, "layers.0.qkv_proj")  # compiles nothing: no config needed
    with pytest.raises(RuntimeError, match=r"layers\.0\.qkv_proj was processed outside vLLM's model loading"):
        vllm_plugin._warm_up_gemm(be, w, "layers.0.qkv_proj")
    cfg = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_batched_tokens=512))
    for prefix, weight in (("layers.0.qkv_proj", w), ("layers.1.qkv_proj", w), ("layers.0.o_proj", w2)):
        vllm_plugin._warm_up_gemm(be, weight, prefix)
    assert be.calls == [(256, 128, 512, "cpu"), (384, 128, 512, "cpu")]
    monkeypatch.setenv("VLLM_DEEP_GEMM_WARMUP", "skip")
    vllm_plugin._warm_up_gemm(be, torch.empty(512, 128), "layers.0.gate_up_proj")
    assert len(be.calls) == 2


# -- the caller's garbage collector during vLLM's front-end ---------------------------------------


def test_generate_runs_vllms_front_end_with_the_cyclic_collector_off_and_restores_it():
    """`Engine.generate` pauses the collector only around vLLM's generate (whose per-step output handling set off
    full collections over a trainer's whole heap), restores what the caller had, also when vLLM raises."""
    pytest.importorskip("vllm", reason="vLLM's SamplingParams and FlatLogprobs")
    import gc
    from types import SimpleNamespace

    from vllm.logprobs import FlatLogprobs, Logprob

    from jetrl.rollout.adapter import Engine

    seen = []

    class FakeLLM:
        fail = False

        def apply_model(self, fn):
            return [fn(None)]

        def generate(self, prompts, params, use_tqdm):
            seen.append(gc.isenabled())
            if self.fail:
                raise RuntimeError("engine died")
            flat = FlatLogprobs()
            flat.append({7: Logprob(logprob=-0.5, rank=1)})
            return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[7], logprobs=flat, finish_reason="length")])]

    llm = FakeLLM()
    engine = Engine(llm, Recipe.from_name("bf16"), rollout="jetrl", in_process=True, start_seconds=0.0)
    was = gc.isenabled()
    try:
        gc.enable()
        (sample,) = engine.generate([[1, 2]], max_tokens=1)
        assert (seen, gc.isenabled(), sample.response_ids, sample.response_logprobs) == ([False], True, [7], [-0.5])
        llm.fail = True
        with pytest.raises(RuntimeError, match="engine died"):
            engine.generate([[1, 2]], max_tokens=1)
        assert seen[-1] is False and gc.isenabled()
        gc.disable()  # a caller that runs with the collector off keeps it off
        llm.fail = False
        engine.generate([[1, 2]], max_tokens=1)
        assert seen[-1] is False and not gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()
