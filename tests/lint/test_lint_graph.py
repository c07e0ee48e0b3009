"""IR, normalization rules and the check on hand-built graphs (no model, no engine: milliseconds)."""

from __future__ import annotations

import pytest

from jetrl.lint.check import check
from jetrl.lint.ir import BF16, FP8, Graph, GraphError, OpKind, Precision, linear_site, node_id
from jetrl.lint.normalize import normalize
from jetrl.recipe import Division, Granularity, QuantSpec, Recipe, ScaleFormat

ACT = Precision(FP8, QuantSpec(Granularity.G1x128), "jetrl::quantize_1x128")
WGT = Precision(FP8, QuantSpec(Granularity.G128x128), "checkpoint")
PREFIX = "model.layers.0.self_attn"


def _training(parts=(("q_proj", 256), ("k_proj", 128), ("v_proj", 128)), w=WGT) -> Graph:
    g = Graph("training", "hand-built")
    ln = g.add_node(OpKind.NORM, "model.layers.0.input_layernorm")
    g.add_edge("input", ln.id, "x", BF16)
    for name, n in parts:
        linear_site(g, f"{PREFIX}.{name}", x=ACT, w=w, x_src=ln.id, n=n, k=256)
    return g


def _fused_rollout(parts=(("q_proj", 256), ("k_proj", 128), ("v_proj", 128)), x=ACT, w=WGT, **attrs) -> Graph:
    g = Graph("rollout", "hand-built", meta={"engine": "stock-vllm"})
    ln = g.add_node(OpKind.NORM, "model.layers.0.input_layernorm")
    g.add_edge("input", ln.id, "x", BF16)
    n = sum(p[1] for p in parts)
    linear_site(g, f"{PREFIX}.qkv_proj", x=x, w=w, x_src=ln.id, n=n, k=256, parts=tuple(parts), **attrs)
    return g


def test_precision_labels_validate_themselves():
    with pytest.raises(GraphError, match="needs the QuantSpec"):
        Precision(FP8)
    assert Precision("torch.bfloat16").dtype == "bfloat16"
    assert ACT.same_values(Precision(FP8, QuantSpec(Granularity.G1x128), "vllm:per_token_group_quant_fp8"))
    assert not ACT.same_values(Precision(FP8, QuantSpec(Granularity.G1x128, scale_format=ScaleFormat.POW2)))
    assert "when M<32" in Precision(FP8, ACT.spec, when="M<32").label()


def test_graph_rejects_duplicates_and_dangling_edges():
    g = Graph("training", "t")
    g.add_node(OpKind.NORM, "a")
    with pytest.raises(GraphError, match="duplicate"):
        g.add_node(OpKind.NORM, "a")
    with pytest.raises(GraphError, match="unknown node"):
        g.add_edge("nowhere", "a:norm", "x", BF16)
    with pytest.raises(GraphError, match="role"):
        node_id("m", OpKind.GEMM)
    with pytest.raises(GraphError, match="side"):
        Graph("inference", "t")


def test_fused_qkv_splits_onto_the_hf_projections_and_passes():
    t = _training()
    r, findings, rules = normalize(_fused_rollout())
    assert findings == []
    assert any("qkv_proj" in rule for rule in rules)
    for name in ("q_proj", "k_proj", "v_proj"):
        assert node_id(f"{PREFIX}.{name}", OpKind.GEMM, "fprop") in r.nodes
        assert node_id(f"{PREFIX}.{name}", OpKind.QUANTIZE) in r.nodes
    assert node_id(f"{PREFIX}.qkv_proj", OpKind.GEMM, "fprop") not in r.nodes
    assert check(normalize(t)[0], r) == []


def test_fused_split_is_refused_when_a_part_is_off_the_128_grid():
    parts = (("q_proj", 256), ("k_proj", 64), ("v_proj", 64))
    _, findings, _ = normalize(_fused_rollout(parts))
    assert [f.code for f in findings] == ["fused-split"]
    assert "k_proj N=64" in findings[0].message and findings[0].rollout_module == f"{PREFIX}.qkv_proj"
    # BF16 weights have no blocks: the same split is exact
    _, findings, _ = normalize(_fused_rollout(parts, x=BF16, w=BF16))
    assert findings == []


def test_tp_shards_must_be_multiples_of_128_when_quantized():
    shards = (("q_proj", 128), ("k_proj", 64), ("v_proj", 64))
    g = _fused_rollout(tp_size=2, tp_split="N", tp_shards=shards)
    _, findings, _ = normalize(g)
    assert [f.code for f in findings] == ["tp-shard"]
    assert "k_proj shard 64" in findings[0].found and "TP=2" in findings[0].message
    ok = _fused_rollout(tp_size=2, tp_split="N", tp_shards=(("q_proj", 128), ("k_proj", 128), ("v_proj", 128)))
    norm, findings, _ = normalize(ok)
    assert findings == [] and all(n.attr("tp_size") is None for n in norm.nodes.values())


def test_fused_norm_quant_unfuses_into_norm_then_a_quantize_per_consumer():
    g = Graph("training", "t")
    nq = g.add_node(OpKind.NORM_QUANT, "model.layers.0.input_layernorm", quant_input="bfloat16")
    g.add_edge("input", nq.id, "x", BF16)
    for name in ("q_proj", "k_proj"):
        gemm = g.add_node(OpKind.GEMM, f"{PREFIX}.{name}", "fprop")
        g.add_edge(nq.id, gemm.id, "x", ACT)
        g.add_edge(f"param:{PREFIX}.{name}.weight", gemm.id, "w", WGT)
    norm, findings, rules = normalize(g)
    assert findings == [] and any("norm" in r for r in rules)
    assert node_id("model.layers.0.input_layernorm", OpKind.NORM) in norm.nodes
    for name in ("q_proj", "k_proj"):
        q = node_id(f"{PREFIX}.{name}", OpKind.QUANTIZE)
        assert norm.inputs(node_id(f"{PREFIX}.{name}", OpKind.GEMM, "fprop"))["x"].src == q
    # a fused kernel that quantizes the fp32 value before rounding is not the separate quantizer
    bad = Graph("training", "t")
    nq = bad.add_node(OpKind.NORM_QUANT, "n", quant_input="float32")
    bad.add_edge("input", nq.id, "x", BF16)
    assert [f.code for f in normalize(bad)[1]] == ["norm-quant-fusion"]


@pytest.mark.parametrize(
    "variant, field",
    [
        (QuantSpec(Granularity.G1x128, scale_format=ScaleFormat.POW2), "scale_format"),
        (QuantSpec(Granularity.G1x128, division=Division.RECIPROCAL), "division"),
        (QuantSpec(Granularity.G1x128, eps=1e-4), "eps"),
        (QuantSpec(Granularity.PER_TOKEN, eps=1 / 512), "granularity"),
    ],
    ids=["pow2", "reciprocal", "eps", "per-token"],
)
def test_check_names_the_differing_spec_field_and_the_recipe_fix(variant, field):
    r = _fused_rollout(x=Precision(FP8, variant, "test"))
    for e in list(r.edges):
        if e.port == "x" and e.precision.quantized:
            r.edges[r.edges.index(e)] = type(e)(e.src, e.dst, e.port, e.precision, "recipe:rollout_activation")
    findings = check(normalize(_training())[0], normalize(r)[0])
    assert len(findings) == 1, findings
    f = findings[0]
    assert f.code == "precision-mismatch" and f.tensor == "x" and field in f.message
    assert f.expected == ACT.label() and f.found == Precision(FP8, variant).label()
    assert "Recipe.rollout_activation" in f.fix
    assert len(f.also) == 2  # q, k, v grouped into one finding


def test_missing_node_and_one_sided_quantization():
    t = _training(parts=(("q_proj", 256),))
    r = _fused_rollout()
    codes = {f.code for f in check(normalize(t)[0], normalize(r)[0])}
    assert "missing-in-training" in codes  # k_proj / v_proj do not exist in that training graph
    t_bf16 = Graph("training", "hand-built")
    for name, n in (("q_proj", 256), ("k_proj", 128), ("v_proj", 128)):
        linear_site(t_bf16, f"{PREFIX}.{name}", x=BF16, w=BF16, n=n, k=256, x_origin="convert:kept BF16")
    ln = t_bf16.add_node(OpKind.NORM, "model.layers.0.input_layernorm")
    t_bf16.add_edge("input", ln.id, "x", BF16)
    findings = check(normalize(t_bf16)[0], normalize(r)[0])
    assert {(f.code, f.tensor) for f in findings} == {("quantized-one-side", "x"), ("quantized-one-side", "w")}
    assert all("ignored_layers" in f.fix and "quantized in rollout only" in f.message for f in findings)


def test_capture_refuses_engine_modules_it_does_not_model():
    import torch

    from jetrl.lint.capture import Recorder, trace_model

    class FusedMoE(torch.nn.Module):  # stands for any quantizable engine module the lint has no rule for
        def __init__(self) -> None:
            super().__init__()
            self.quant_method = object()

        def forward(self, x):
            return x

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), FusedMoE())
    with Recorder(model) as rec:
        model(torch.zeros(1, 4))
    with pytest.raises(ValueError, match="1: FusedMoE with quant method object is not modelled"):
        trace_model(model, rec, side="rollout", source="test")


def test_recorder_has_the_engines_fused_producers_write_their_values():
    """The engine's fused producers write the BF16 value their FP8 bytes quantize only while a `Recorder` is
    open (`jetrl.rollout.methods.producer_values`): the capture records it; a value left unwritten (a forward
    vLLM compiled before the Recorder) is refused by name, not recorded as missing."""
    import torch

    from jetrl.lint.capture import Recorder
    from jetrl.rollout.methods import PreQuantized, keep_producer_values

    class Producer(torch.nn.Module):
        def forward(self, x):
            y = x if keep_producer_values() else None
            q = x.to(torch.float8_e4m3fn)
            return PreQuantized(q, torch.ones(1, 1), "jetrl::rmsnorm_quant", x.shape, x.dtype, y)

    class Consumer(torch.nn.Module):
        def forward(self, p):
            return p.q.float()

    model = torch.nn.Sequential(Producer(), Consumer())
    x = torch.arange(4.0).reshape(1, 4)
    assert Producer()(x).y is None  # outside a Recorder nothing is written
    with Recorder(model, keep_tensors=True) as rec:
        assert keep_producer_values()
        model(x)
    assert not keep_producer_values()
    assert torch.equal(rec.module_calls["1"].x, x)
    assert rec.prequantized["1"][0] == "jetrl::rmsnorm_quant"
    unwritten = Producer()(x)
    with Recorder(model) as rec, pytest.raises(RuntimeError, match="jetrl::rmsnorm_quant did not write the value"):
        model[1](unwritten)
    assert not keep_producer_values()


def test_lint_engine_gets_a_small_kv_cache_unless_sized(monkeypatch, tmp_path):
    """The lint's own engine must not take vLLM's default 90% of a GPU: ``python -m jetrl.verl`` lints in the
    driver right before verl starts its engines on the same GPU (on the H200 verl's vLLM then found 8.8 of
    139.8 GiB free and refused to start)."""
    import jetrl.rollout.adapter as adapter
    from jetrl.lint import api

    seen = []
    monkeypatch.setattr(adapter, "create_engine", lambda path, recipe, **kw: seen.append(kw) or "engine")
    recipe = Recipe.from_name("jetrl-unified")
    assert api._start_engine(tmp_path, recipe, "auto", 64, {}) == "engine"
    assert seen[-1]["kv_cache_memory_bytes"] == api.LINT_KV_CACHE_BYTES
    assert "gpu_memory_utilization" not in seen[-1]
    api._start_engine(tmp_path, recipe, "auto", 64, {"gpu_memory_utilization": 0.5})
    assert seen[-1]["gpu_memory_utilization"] == 0.5 and "kv_cache_memory_bytes" not in seen[-1]
