"""`jetrl.rollout.tp`: each tensor-parallel rank's slice of the trainer's FP8 bytes and 128x128 scales is
exact (``dequant(slice) == slice(dequant)``, and equal to quantizing the sliced BF16 weight), cut by heads /
kv heads / intermediate rows as vLLM's rank holds them, and refused -- naming the layer and the dims --
where a model's shapes do not allow the split."""

import pytest
import torch

from jetrl.convert import convert_model
from jetrl.quant import dequantize_128x128, quantize_128x128
from jetrl.recipe import Recipe
from jetrl.rollout.sync import tensor_digest, trainer_payload
from jetrl.rollout.tp import TPLayout, TPShapeError, payload_digests, tp_dims, tp_slice, tp_slice_payload
from jetrl.tiny import build_tiny_model

RECIPE = Recipe.from_name("jetrl-unified")
VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE (the engine test reads it from the adapter)
HD = 128
# (num_attention_heads, num_key_value_heads, intermediate_size, tp): GQA with 1 and 2 kv heads per rank,
# MHA over 4 ranks (one q / kv head and 128 intermediate rows per rank)
CASES = [(4, 2, 1024, 2), (4, 4, 512, 4), (8, 4, 768, 2)]


def _model(heads: int, kv: int, inter: int, seed: int = 0):
    model = build_tiny_model(seed, num_attention_heads=heads, num_key_value_heads=kv, intermediate_size=inter)
    convert_model(model, RECIPE, backend="emulated")
    layout = TPLayout.from_hf_config(model.config.to_dict())
    return model, layout


def _rank_heads(n_heads: int, tp: int, rank: int) -> list[int]:
    per = n_heads // tp
    return list(range(rank * per, (rank + 1) * per))


def _reference_slice(name: str, w: torch.Tensor, layout: TPLayout, tp: int, rank: int) -> torch.Tensor:
    """vLLM's rank-`rank` part of a full (dequantized or BF16) weight, written head by head."""
    leaf = name.rsplit(".", 2)[-2]
    if leaf in ("q_proj", "k_proj", "v_proj", "o_proj"):
        n_heads = layout.num_key_value_heads if leaf in ("k_proj", "v_proj") else layout.num_attention_heads
        idx = torch.cat([torch.arange(h * HD, (h + 1) * HD) for h in _rank_heads(n_heads, tp, rank)])
        return w[:, idx] if leaf == "o_proj" else w[idx]
    per = layout.intermediate_size // tp
    idx = torch.arange(rank * per, (rank + 1) * per)
    return w[:, idx] if leaf == "down_proj" else w[idx]


@pytest.mark.parametrize(("heads", "kv", "inter", "tp"), CASES, ids=[f"h{h}-kv{k}-i{i}-tp{t}" for h, k, i, t in CASES])
def test_fp8_slices_are_exact_and_are_what_each_rank_holds(heads, kv, inter, tp):
    model, layout = _model(heads, kv, inter)
    payload = trainer_payload(model, RECIPE)
    bf16 = {k: v.detach() for k, v in model.state_dict().items()}
    fp8_names = [n for n, v in payload.items() if isinstance(v, tuple)]
    assert len(fp8_names) == 14
    slices = [tp_slice_payload(payload, tp, r, layout, vocab_padding=VOCAB_PADDING) for r in range(tp)]
    for name in fp8_names:
        q, s = payload[name]
        full_deq = dequantize_128x128(q, s)
        for r, sl in enumerate(slices):
            qr, sr = sl[name]
            assert qr.is_contiguous() and sr.is_contiguous(), name
            ref = _reference_slice(name, full_deq, layout, tp, r)
            assert torch.equal(dequantize_128x128(qr, sr), ref), f"{name} rank {r}: dequant(slice) != slice(dequant)"
            q_ref, s_ref = quantize_128x128(_reference_slice(name, bf16[name], layout, tp, r))
            assert torch.equal(qr.view(torch.uint8), q_ref.view(torch.uint8)), f"{name} rank {r}: bytes"
            assert torch.equal(sr, s_ref), f"{name} rank {r}: scales differ from quantizing the slice"
        # the ranks' slices tile the weight exactly once
        dim = 1 if name.rsplit(".", 2)[-2] in ("o_proj", "down_proj") else 0
        whole = torch.cat([sl[name][0].view(torch.uint8) for sl in slices], dim=dim)
        assert torch.equal(whole, q.view(torch.uint8)), name
    # per-rank shapes vLLM's rank r creates for this layer (fused qkv / gate_up rows, o_proj / down_proj columns)
    attn, mlp = "model.layers.0.self_attn", "model.layers.0.mlp"
    qkv_rows = sum(slices[0][f"{attn}.{p}.weight"][0].shape[0] for p in ("q_proj", "k_proj", "v_proj"))
    assert qkv_rows == (heads + 2 * kv) * HD // tp
    assert slices[0][f"{attn}.k_proj.weight"][0].shape[0] == kv // tp * HD
    assert slices[0][f"{mlp}.gate_proj.weight"][0].shape == (inter // tp, 256)
    assert slices[0][f"{attn}.o_proj.weight"][0].shape == (256, heads * HD // tp)
    assert slices[0][f"{attn}.o_proj.weight"][1].shape == (2, heads // tp)
    assert slices[0][f"{mlp}.down_proj.weight"][1].shape == (2, inter // tp // 128)
    # norms whole on every rank, vocabulary rows split over the padded vocab
    for r, sl in enumerate(slices):
        assert torch.equal(sl["model.norm.weight"], payload["model.norm.weight"])
        assert torch.equal(sl[f"{attn}.k_norm.weight"], payload[f"{attn}.k_norm.weight"])
        vocab = payload["lm_head.weight"].shape[0]
        per = -(-vocab // VOCAB_PADDING) * VOCAB_PADDING // tp
        lo = min(r * per, vocab)
        assert torch.equal(sl["lm_head.weight"], payload["lm_head.weight"][lo : min(lo + per, vocab)])


def test_per_rank_digests_are_the_reference_slices_digests():
    model, layout = _model(4, 2, 1024)
    payload = trainer_payload(model, RECIPE)
    per_rank = [payload_digests(tp_slice_payload(payload, 2, r, layout, vocab_padding=VOCAB_PADDING)) for r in (0, 1)]
    name = "model.layers.1.self_attn.v_proj.weight"
    for r in (0, 1):
        q, s = payload[name]
        ref_q = _reference_slice(name, q.view(torch.uint8), layout, 2, r).contiguous().view(torch.float8_e4m3fn)
        assert per_rank[r][name] == tensor_digest(ref_q)
        assert per_rank[r][f"{name}:scales"] == tensor_digest(s[r : r + 1].contiguous())
    differ = [n for n in per_rank[0] if per_rank[0][n] != per_rank[1][n]]
    assert f"{name}" in differ and "model.norm.weight" not in differ


def test_bf16_payloads_split_without_the_block_rule():
    model = build_tiny_model(0, intermediate_size=384, num_key_value_heads=2)
    layout = TPLayout.from_hf_config(model.config.to_dict())
    payload = trainer_payload(model, Recipe.from_name("bf16"))
    sl = tp_slice_payload(payload, 2, 1, layout, vocab_padding=VOCAB_PADDING)
    w = payload["model.layers.0.mlp.down_proj.weight"]
    assert torch.equal(sl["model.layers.0.mlp.down_proj.weight"], w[:, 192:])
    assert torch.equal(sl["model.layers.0.mlp.up_proj.weight"], payload["model.layers.0.mlp.up_proj.weight"][192:])


def test_kv_heads_fewer_than_ranks_are_refused():
    model, layout = _model(2, 1, 512)  # the default tiny model: one kv head
    payload = trainer_payload(model, RECIPE)
    with pytest.raises(TPShapeError, match=r"num_key_value_heads=1 does not split over tensor-parallel size 2"):
        tp_slice_payload(payload, 2, 0, layout, vocab_padding=VOCAB_PADDING)
    with pytest.raises(TPShapeError, match=r"num_attention_heads=2 does not split over tensor-parallel size 4"):
        tp_dims(layout, 4)


def test_slices_off_128_rows_are_refused_naming_layer_and_dims():
    model, layout = _model(2, 2, 384)  # 384 / 2 = 192 intermediate rows per rank
    payload = trainer_payload(model, RECIPE)
    with pytest.raises(TPShapeError, match=r"intermediate_size \(gate_proj/up_proj N, down_proj K\)\)?=384.*192"):
        tp_slice_payload(payload, 2, 0, layout, vocab_padding=VOCAB_PADDING)
    gate, down = "model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.down_proj.weight"
    with pytest.raises(TPShapeError, match=rf"{gate}: gate_proj N=384 splits into 192 per rank.*multiple of 128"):
        tp_slice(gate, payload[gate], 2, 0, layout, vocab_padding=VOCAB_PADDING)
    with pytest.raises(TPShapeError, match=rf"{down}: down_proj K=384 splits into 192 per rank"):
        tp_slice(down, payload[down], 2, 1, layout, vocab_padding=VOCAB_PADDING)
    assert tp_dims(layout, 2, block=None)["intermediate_size (gate_proj/up_proj N, down_proj K)"] == 192


def test_tensors_without_a_rule_or_off_the_config_are_refused():
    model, layout = _model(4, 2, 1024)
    payload = trainer_payload(model, RECIPE)
    router = {"model.layers.0.mlp.gate.weight": torch.zeros(8, 256, dtype=torch.bfloat16)}
    with pytest.raises(TPShapeError, match=r"mlp\.gate\.weight \(8, 256\): .*no tensor-parallel rule"):
        tp_slice_payload({**payload, **router}, 2, 0, layout, vocab_padding=VOCAB_PADDING)
    expert = "model.layers.0.mlp.experts.3.up_proj.weight"
    with pytest.raises(TPShapeError, match=rf"{expert}.*no tensor-parallel rule"):
        tp_slice(expert, payload["model.layers.0.mlp.up_proj.weight"], 2, 0, layout, vocab_padding=VOCAB_PADDING)
    wrong = TPLayout(4, 2, HD, 256, 2048)  # the config says 2048, the trainer's weights have 1024 rows
    with pytest.raises(TPShapeError, match=r"gate_proj.weight: 1024 rows, but the model config gives gate_proj N=2048"):
        tp_slice_payload(payload, 2, 0, wrong, vocab_padding=VOCAB_PADDING)
    with pytest.raises(TPShapeError, match=r"rank 2 is outside \[0, 2\)"):
        tp_slice("model.norm.weight", payload["model.norm.weight"], 2, 2, layout, vocab_padding=VOCAB_PADDING)
    with pytest.raises(TPShapeError, match=r"missing 'intermediate_size'"):
        TPLayout.from_hf_config({"num_attention_heads": 4, "hidden_size": 256})
