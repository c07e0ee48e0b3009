"""fp8_param: fp8 bytes as the module's weight, fp32 masters updated by the optimizer, one
re-quantization per step, and the weight-memory saving."""

from __future__ import annotations

import pytest
import torch

from jetrl import quant
from jetrl.convert import convert_model
from jetrl.fp8_param import enable_fp8_params, weight_memory_report
from jetrl.tiny import CharTokenizer, build_tiny_model

pytest.importorskip("transformers")


VOCAB = CharTokenizer().vocab_size


def tiny_qwen3(seed=0, dtype=torch.bfloat16):
    """The project's tiny Qwen3 (every projection a multiple of 128), in `dtype`."""
    return build_tiny_model(seed).to(dtype)


def test_fp8_params_train_and_requantize_once_per_step():
    model = tiny_qwen3(seed=2, dtype=torch.float32)
    convert_model(model, "jetrl-unified", backend="emulated")
    names = [n for n, _ in model.named_parameters()]
    before = weight_memory_report(model)
    fp8 = enable_fp8_params(model)
    assert [n for n, _ in model.named_parameters()] == names
    opt = torch.optim.AdamW(fp8.optimizer_parameters(model), lr=3e-3)
    fp8.attach(opt)
    ids = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))
    losses = []
    for step in range(4):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        _, master = next(fp8.named_master_parameters())
        assert master.grad is not None and master.grad.dtype == torch.float32
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        assert fp8.requantizations == step + 1
    assert losses[-1] < losses[0] - 0.5, losses
    for name, master in fp8.named_master_parameters():
        mod = model.get_submodule(name.rsplit(".", 1)[0])
        q_ref, s_ref = quant.quantize_128x128(master.detach())
        assert mod.weight.dtype == quant.FP8_DTYPE and not mod.weight.requires_grad
        assert torch.equal(mod.weight.view(torch.uint8), q_ref.view(torch.uint8)), name
        assert torch.equal(mod.weight_scale_inv, s_ref) and torch.equal(mod.fp8_weight()[1], s_ref)
        assert mod.weight_quantizations == 0  # the module never quantizes: the manager does, once per step
    sd = model.state_dict()
    assert sd["model.layers.0.mlp.up_proj.weight"].dtype == quant.FP8_DTYPE
    assert sd["model.layers.0.mlp.up_proj.weight_scale_inv"].shape == (4, 2)
    after = weight_memory_report(model)
    assert before["ratio"] == 2.0  # fp32 weights before
    assert after["ratio"] <= 0.55 and after["bf16_bytes"] == before["bf16_bytes"]
    assert after["resident_bytes"] == after["fp8_bytes"] + after["scale_bytes"]


def test_fp8_params_needs_converted_model():
    with pytest.raises(ValueError, match="no JetFP8Linear"):
        enable_fp8_params(tiny_qwen3())


def test_refresh_in_fp8_param_mode_rewrites_the_transposed_copy_in_place():
    from jetrl.linear import refresh_fp8_weights_

    model = tiny_qwen3(seed=2, dtype=torch.float32)
    convert_model(model, "jetrl-unified", backend="emulated")
    fp8 = enable_fp8_params(model)
    mod = model.get_submodule("model.layers.0.mlp.up_proj")
    mod._fp8_operands(with_transpose=True)
    _, _, _, q_t, s_t = mod._cache
    master = dict(fp8.named_master_parameters())["model.layers.0.mlp.up_proj.weight"]
    with torch.no_grad():
        master.mul_(-2.0)
    fp8.requantize()
    refresh_fp8_weights_(model)
    _, q, s, q_t2, s_t2 = mod._cache
    assert q is mod.weight and s is mod.weight_scale_inv and q_t2 is q_t and s_t2 is s_t
    assert torch.equal(q_t.view(torch.uint8), mod.weight.t().contiguous().view(torch.uint8))
    assert torch.equal(s_t, mod.weight_scale_inv.t()) and mod.weight_quantizations == 0
