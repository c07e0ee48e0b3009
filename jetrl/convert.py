"""Convert an HF causal LM (Llama / Qwen2 / Qwen3, or anything with a name filter) to FP8 Linears.

`convert_model` swaps, in place, every selected ``nn.Linear`` for a `jetrl.linear.JetFP8Linear` that
shares its Parameter objects (names, optimizer state and FSDP/verl wrapping see an unchanged model),
and returns a `ConversionReport` listing every Linear of the model -- converted, or kept in BF16 and
why. That report is the raw material of the precision graph (`jetrl.lint`).

Selection, in order:

1. BF16 recipes convert nothing.
2. ``recipe.keeps_bf16(name)``: embeddings, lm_head, norms, MoE routers (``mlp.gate``) stay BF16.
3. ``name_filter`` (a callable ``name -> bool`` or a regex searched in the name) when given, else the
   HF projection names ``q_proj k_proj v_proj o_proj gate_proj up_proj down_proj`` (also inside MoE
   experts).
4. The GEMM backend's shape check (DeepGEMM and cuBLASLt need in/out features multiples of 128). A
   refused shape raises `ConversionError` naming the module, unless
   ``recipe.allow_bf16_fallback_shapes`` (then the Linear stays BF16 and the report says why).

All checks run before any module is swapped: a refused conversion leaves the model untouched.
`export_fp8_weights` returns the fp8 bytes and scales of every converted Linear under its HF weight
name, the payload of an FP8 weight sync.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from jetrl.gemm import GemmBackend, get_backend
from jetrl.linear import JetFP8Linear, JetRMSNormQuant, JetSwiGLUMLP, _scale_layout_of
from jetrl.recipe import Recipe

__all__ = [
    "HF_PROJECTIONS",
    "ConversionEntry",
    "ConversionReport",
    "ConversionError",
    "convert_model",
    "export_fp8_weights",
]

HF_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Last name components of the Linears converted by default (HF Llama / Qwen2 / Qwen3 / their MoE experts)."""


class ConversionError(ValueError):
    """A selected Linear cannot run on the FP8 GEMM backend and the recipe does not allow BF16 for it."""


@dataclass(frozen=True)
class ConversionEntry:
    name: str
    """Module name, e.g. "model.layers.0.self_attn.q_proj"."""
    in_features: int
    out_features: int
    converted: bool
    reason: str
    """Why it was converted or kept."""


@dataclass
class ConversionReport:
    recipe: str
    backend: str | None
    """GEMM backend of the converted Linears (None when nothing was converted)."""
    entries: list[ConversionEntry] = field(default_factory=list)
    fused: list[str] = field(default_factory=list)
    """Norms / MLPs replaced by fused quantizing modules (``fuse=True``)."""

    def converted_names(self) -> list[str]:
        return [e.name for e in self.entries if e.converted]

    def kept(self) -> list[ConversionEntry]:
        return [e for e in self.entries if not e.converted]

    def to_dict(self) -> dict:
        return {
            "recipe": self.recipe,
            "backend": self.backend,
            "entries": [asdict(e) for e in self.entries],
            "fused": list(self.fused),
        }

    def __str__(self) -> str:
        n_fp8 = len(self.converted_names())
        lines = [f"conversion ({self.recipe}, backend={self.backend}): {n_fp8} FP8 / {len(self.entries)} Linears"]
        for e in self.entries:
            tag = "FP8 " if e.converted else "BF16"
            lines.append(f"  {tag} {e.name} [{e.out_features}x{e.in_features}]: {e.reason}")
        return "\n".join(lines)


def _selector(name_filter: Callable[[str], bool] | str | None) -> tuple[Callable[[str], bool], str]:
    if name_filter is None:
        return (lambda n: n.rsplit(".", 1)[-1] in HF_PROJECTIONS), "an HF q/k/v/o/gate/up/down projection"
    if isinstance(name_filter, str):
        pattern = re.compile(name_filter)
        return (lambda n: pattern.search(n) is not None), f"matches name_filter {name_filter!r}"
    if callable(name_filter):
        return name_filter, "selected by name_filter"
    raise TypeError(f"name_filter must be None, a regex string or a callable, got {type(name_filter).__name__}")


def convert_model(
    model: nn.Module,
    recipe: Recipe | str,
    *,
    backend: str | GemmBackend = "auto",
    name_filter: Callable[[str], bool] | str | None = None,
    fuse: bool = False,
) -> ConversionReport:
    """Swap the selected Linears of `model` for JetFP8Linear in place; return the report of every Linear.
    With ``fuse=True``, also replace each decoder layer's ``input_layernorm`` / ``post_attention_layernorm``
    feeding FP8 Linears by `JetRMSNormQuant` and each SiLU gate/up/down ``mlp`` by `JetSwiGLUMLP`
    (`jetrl.kernels` fused norm/activation + quantize; same parameter names, HF numerics)."""
    recipe = Recipe.from_name(recipe) if isinstance(recipe, str) else recipe
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not recipe.train_fp8:
        why = f"recipe {recipe.name!r} trains in BF16"
        entries = [ConversionEntry(n, m.in_features, m.out_features, False, why) for n, m in linears]
        return ConversionReport(recipe.name, None, entries)
    be = get_backend(backend)
    selected, why_selected = _selector(name_filter)
    entries: list[ConversionEntry] = []
    todo: list[tuple[str, nn.Linear]] = []
    for name, mod in linears:
        shape = (name, mod.in_features, mod.out_features)
        if isinstance(mod, JetFP8Linear):
            entries.append(ConversionEntry(*shape, True, f"already FP8 (backend {mod.backend.name})"))
            continue
        if recipe.keeps_bf16(name):
            frag = next(f for f in recipe.keep_bf16 if recipe.replace(keep_bf16=(f,)).keeps_bf16(name))
            entries.append(ConversionEntry(*shape, False, f"kept BF16 by the recipe (keep_bf16 {frag!r})"))
            continue
        if not selected(name):
            why = "not selected by name_filter" if name_filter is not None else "not an HF projection"
            entries.append(ConversionEntry(*shape, False, why + " (pass name_filter to convert it)"))
            continue
        refused = be.check_linear_shape(mod.out_features, mod.in_features)
        if refused:
            if not recipe.allow_bf16_fallback_shapes:
                raise ConversionError(
                    f"{name}: {refused}; refusing to convert (set recipe.allow_bf16_fallback_shapes=True to keep "
                    "such Linears in BF16)"
                )
            entries.append(ConversionEntry(*shape, False, f"kept BF16, shape refused by {be.name}: {refused}"))
            continue
        entries.append(
            ConversionEntry(
                *shape, True, f"{why_selected}; {recipe.train_activation.label()} x {recipe.train_weight.label()}"
            )
        )
        todo.append((name, mod))
    for name, mod in todo:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, JetFP8Linear.from_linear(mod, recipe=recipe, backend=be, layer_name=name))
    report = ConversionReport(recipe.name, be.name, entries)
    if fuse:
        report.fused = _fuse(model)
    return report


def _fuse(model: nn.Module) -> list[str]:
    """Install the fused producers where their consumers are FP8 Linears; returns the replaced names."""
    done = []
    for name, mod in list(model.named_modules()):
        prefix = f"{name}." if name else ""
        attn, mlp = getattr(mod, "self_attn", None), getattr(mod, "mlp", None)
        consumers = {
            "input_layernorm": [getattr(attn, p, None) for p in ("q_proj", "k_proj", "v_proj")],
            "post_attention_layernorm": [getattr(mlp, p, None) for p in ("gate_proj", "up_proj")],
        }
        for norm_name, lins in consumers.items():
            norm = getattr(mod, norm_name, None)
            if norm is None or isinstance(norm, JetRMSNormQuant) or not any(isinstance(x, JetFP8Linear) for x in lins):
                continue
            layout = _scale_layout_of(lins)
            setattr(mod, norm_name, JetRMSNormQuant(norm, scale_layout=layout, layer_name=prefix + norm_name))
            done.append(prefix + norm_name)
        if (
            mlp is not None
            and not isinstance(mlp, JetSwiGLUMLP)
            and isinstance(getattr(mlp, "down_proj", None), JetFP8Linear)
        ):
            mod.mlp = JetSwiGLUMLP(mlp, layer_name=prefix + "mlp")
            done.append(prefix + "mlp")
    return done


def export_fp8_weights(model: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """HF weight name ("model.layers.0.self_attn.q_proj.weight") -> (q e4m3 [N, K], s fp32 128x128 grid)
    of every JetFP8Linear, from `JetFP8Linear.fp8_weight` (the bytes the trainer's fprop uses)."""
    out = {}
    with torch.no_grad():
        for name, mod in model.named_modules():
            if isinstance(mod, JetFP8Linear):
                out[f"{name}.weight" if name else "weight"] = mod.fp8_weight()
    return out
