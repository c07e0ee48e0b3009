"""fp8_param: the model holds its Linear weights as FP8 bytes + scales; fp32 masters live with the optimizer.

Design. For every `JetFP8Linear` of a model, `enable_fp8_params`:

- replaces the module's ``weight`` Parameter by a frozen Parameter of dtype float8_e4m3fn ``[N, K]``
  under the SAME name, and registers the 128x128 scales as the buffer ``weight_scale_inv``
  ``[ceil(N/128), ceil(K/128)]`` -- exactly vLLM's block-FP8 checkpoint layout, so ``state_dict()``
  is an FP8 checkpoint and a weight sync sends it as is;
- creates an fp32 master copy (a leaf ``nn.Parameter``, not registered in the module) that receives
  the wgrad: the autograd function takes the master as its weight input, ignores its values in the
  forward (the forward reads the fp8 bytes) and returns dW for it in fp32 (or accumulates into
  ``master.main_grad`` when present);
- after each ``optimizer.step()`` (a step post-hook installed by `FP8Params.attach`), re-quantizes
  every master into the module's bytes and scales in place, exactly once per step; the in-place copy
  bumps the weight's version counter, which invalidates the module's transposed (dgrad) bytes.

Build the optimizer on `FP8Params.optimizer_parameters(model)` (the masters plus every other trainable
parameter). Parameter names stay visible to FSDP/verl: ``named_parameters()`` still yields
``...q_proj.weight`` (fp8, frozen) and `FP8Params.named_master_parameters()` yields the masters under
the same names (for checkpoints and sharding of the optimizer path). Memory: the module-resident
weights take 1 byte per element plus 4 bytes per 128x128 block instead of BF16's 2
(`weight_memory_report`); the fp32 masters are the optimizer's, as in any mixed-precision setup.
Call `enable_fp8_params` after any ``model.to(dtype)`` (a dtype cast would convert the fp8 bytes).
"""

from __future__ import annotations

import torch
from torch import nn

from jetrl.gemm.quantize import quantize_128x128
from jetrl.linear import JetFP8Linear

__all__ = ["FP8Params", "enable_fp8_params", "weight_memory_report"]


class FP8Params:
    """The fp32 masters of a model's FP8-stored Linear weights and their once-per-step re-quantization."""

    def __init__(self, model: nn.Module) -> None:
        self.entries: list[tuple[str, JetFP8Linear, nn.Parameter]] = []
        self.requantizations = 0
        """Number of `requantize` calls (one per optimizer step once attached)."""
        for name, m in model.named_modules():
            if not isinstance(m, JetFP8Linear) or m._master is not None:
                continue
            w = m.weight
            master = nn.Parameter(w.detach().to(torch.float32).clone(), requires_grad=w.requires_grad)
            q, s = quantize_128x128(master.detach(), name=f"{name}.weight")
            m.weight = nn.Parameter(q, requires_grad=False)
            m.register_buffer("weight_scale_inv", s)
            # not registered as a module Parameter: the module's parameters stay exactly the HF names
            object.__setattr__(m, "_master", master)
            m._cache = None
            self.entries.append((f"{name}.weight" if name else "weight", m, master))
        if not self.entries:
            raise ValueError("enable_fp8_params: the model has no JetFP8Linear (run jetrl.convert.convert_model first)")

    def named_master_parameters(self):
        """(HF weight name, fp32 master) of every FP8-stored weight."""
        for name, _, master in self.entries:
            yield name, master

    def master_parameters(self) -> list[nn.Parameter]:
        return [master for _, _, master in self.entries]

    def optimizer_parameters(self, model: nn.Module) -> list[nn.Parameter]:
        """Everything the optimizer should update: the masters, then every other trainable parameter."""
        fp8 = {id(m.weight) for _, m, _ in self.entries}
        rest = [p for p in model.parameters() if p.requires_grad and id(p) not in fp8]
        return self.master_parameters() + rest

    @torch.no_grad()
    def requantize(self) -> None:
        """Write the masters' 128x128 quantization into the modules' bytes and scales (in place)."""
        for name, m, master in self.entries:
            q, s = quantize_128x128(master, name=name)
            m.weight.copy_(q)
            m.weight_scale_inv.copy_(s)
        self.requantizations += 1

    def attach(self, optimizer: torch.optim.Optimizer):
        """Re-quantize after every ``optimizer.step()``; returns the hook handle."""
        return optimizer.register_step_post_hook(lambda *_: self.requantize())


def enable_fp8_params(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> FP8Params:
    """Store every JetFP8Linear weight of `model` as fp8 bytes + scales (see the module docstring).
    With `optimizer` (already built on `FP8Params.optimizer_parameters`), attach the per-step hook."""
    params = FP8Params(model)
    if optimizer is not None:
        params.attach(optimizer)
    return params


def weight_memory_report(model: nn.Module) -> dict:
    """Bytes held by the model for its JetFP8Linear weights vs the same weights in BF16.

    Returns ``{"n_linears", "numel", "bf16_bytes", "fp8_bytes", "scale_bytes", "resident_bytes", "ratio"}``
    where resident = what the modules hold now (fp8 bytes + scales in fp8_param mode, else the weight
    tensor) and ratio = resident / bf16. Cached quantized copies and fp32 masters are not counted."""
    n = numel = resident = fp8_bytes = scale_bytes = 0
    for m in model.modules():
        if not isinstance(m, JetFP8Linear):
            continue
        n += 1
        numel += m.weight.numel()
        if m._master is not None:
            wb = m.weight.numel() * m.weight.element_size()
            sb = m.weight_scale_inv.numel() * m.weight_scale_inv.element_size()
            fp8_bytes, scale_bytes, resident = fp8_bytes + wb, scale_bytes + sb, resident + wb + sb
        else:
            resident += m.weight.numel() * m.weight.element_size()
    bf16 = numel * 2
    return {
        "n_linears": n,
        "numel": numel,
        "bf16_bytes": bf16,
        "fp8_bytes": fp8_bytes,
        "scale_bytes": scale_bytes,
        "resident_bytes": resident,
        "ratio": resident / bf16 if bf16 else float("nan"),
    }
