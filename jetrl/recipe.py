"""The precision flow as one frozen object: what is quantized where, and exactly how.

A `Recipe` says, for the training step and for the rollout engine, how the activations and the
weights entering every quantized Linear are represented (`QuantSpec`), what the backward passes
use, and which modules stay BF16. The Jet-RL invariant is that the rollout side of a recipe is a
restriction of its training forward side: same granularity, same scale dtype and format, same eps,
same division formula. `Recipe.rollout_matches_training()` states that check for the recipe alone;
the precision-graph lint (`jetrl.lint`) proves it on real graphs.

The numbers (1x128 / 128x128 groups, e4m3 max 448, eps 1e-10, true division, clamp then RNE cast)
are `../shared/NUMERICS.md` section 1; `jetrl.quant` is the executable form of this file.

Named recipes (`Recipe.from_name`):

- ``jetrl-unified``: the Jet-RL flow. Training fprop, dgrad and wgrad in FP8 (1x128 activations and
  grads, 128x128 weights, fp32 scales); rollout uses the trainer's own weight bytes and quantizes
  activations exactly as the trainer does.
- ``bf16``: nothing quantized anywhere (the baseline; its mismatch is the kernel floor).
- ``naive-fp8-rollout``: BF16 training; the rollout engine quantizes BF16 weights per tensor and
  activations per token, as vLLM's online ``quantization="fp8"`` does. The off-policy setup the
  seeds warn about.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field

__all__ = [
    "E4M3_MAX",
    "DEFAULT_EPS",
    "BLOCK",
    "Granularity",
    "ScaleFormat",
    "Division",
    "QuantSpec",
    "Recipe",
    "RecipeError",
    "RECIPE_NAMES",
]

E4M3_MAX = 448.0
"""Largest finite float8_e4m3fn value."""
DEFAULT_EPS = 1e-10
"""Floor on a group's amax before the scale is computed (all-zero groups get scale eps/448)."""
BLOCK = 128
"""Group / block edge length."""


class RecipeError(ValueError):
    """An unknown recipe name or an invalid combination of recipe fields."""


class Granularity(enum.StrEnum):
    """How many values share one scale."""

    G1x128 = "1x128"
    """One scale per 128 consecutive values along the last (contraction) dim: per token group."""
    G128x1 = "128x1"
    """One scale per 128 consecutive rows of one column (1x128 of the transposed tensor)."""
    G128x128 = "128x128"
    """One scale per 128x128 block of a [N, K] weight."""
    PER_TOKEN = "per-token"
    """One scale per row (vLLM's dynamic per-token activation quantization)."""
    PER_TENSOR = "per-tensor"
    """One scale for the whole tensor (vLLM's online fp8 weight quantization)."""


class ScaleFormat(enum.StrEnum):
    FP32 = "fp32"
    """Scale = max(amax, eps) / 448, the correctly rounded fp32 quotient."""
    POW2 = "pow2"
    """Scale rounded up to the next power of two (UE8M0-representable); exact powers are kept."""


class Division(enum.StrEnum):
    TRUE = "x/s"
    """q = x / s, IEEE division (the jetrl and vLLM per_token_group_quant_fp8 formula)."""
    RECIPROCAL = "x*(1/s)"
    """q = x * (1/s): DeepGEMM test helpers, vLLM online per-block. Not the same bytes."""


@dataclass(frozen=True)
class QuantSpec:
    """How one tensor is quantized to e4m3. Two edges of the precision graph carry the same values
    only if their QuantSpecs are equal."""

    granularity: Granularity
    """Which values share a scale."""
    scale_format: ScaleFormat = ScaleFormat.FP32
    """fp32 quotient or power-of-two scales."""
    eps: float = DEFAULT_EPS
    """amax floor before the scale is computed."""
    division: Division = Division.TRUE
    """Formula that maps a value to the fp8 grid."""
    dtype: str = "float8_e4m3fn"
    """Quantized element dtype (only e4m3 is supported)."""
    scale_dtype: str = "float32"
    """Scale element dtype (only fp32 is supported)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "granularity", Granularity(self.granularity))
        object.__setattr__(self, "scale_format", ScaleFormat(self.scale_format))
        object.__setattr__(self, "division", Division(self.division))
        if self.dtype != "float8_e4m3fn":
            raise RecipeError(f"QuantSpec.dtype={self.dtype!r}: only 'float8_e4m3fn' is supported")
        if self.scale_dtype != "float32":
            raise RecipeError(f"QuantSpec.scale_dtype={self.scale_dtype!r}: only 'float32' is supported")
        if not (self.eps >= 0.0):
            raise RecipeError(f"QuantSpec.eps={self.eps!r} must be a non-negative float")

    def label(self) -> str:
        """Short human-readable precision label, used by reports and the lint."""
        return (
            f"e4m3[{self.granularity.value}, scale={self.scale_dtype}/{self.scale_format.value}, "
            f"eps={self.eps:g}, {self.division.value}]"
        )


def _act() -> QuantSpec:
    return QuantSpec(Granularity.G1x128)


def _wgt() -> QuantSpec:
    return QuantSpec(Granularity.G128x128)


DEFAULT_KEEP_BF16 = ("embed_tokens", "lm_head", "norm", "mlp.gate", "router")
"""Module-name fragments that stay BF16 in every recipe (embeddings, lm_head, norms, MoE routers).
`mlp.gate` is a MoE router (a dense MLP's projection is `mlp.gate_proj`, which does not match a
component-wise comparison; see `Recipe.keeps_bf16`)."""


@dataclass(frozen=True)
class Recipe:
    """The whole precision flow of one RL setup. `None` for a QuantSpec means "stays BF16"."""

    name: str
    """Registry name (see RECIPE_NAMES)."""
    train_activation: QuantSpec | None
    """Input X of every quantized Linear in the training forward (fprop)."""
    train_weight: QuantSpec | None
    """Weight W in fprop; its transposed bytes serve dgrad (128x128 is transpose invariant)."""
    train_grad_output: QuantSpec | None
    """dY quantized for dgrad (1x128 along N)."""
    train_wgrad: QuantSpec | None
    """dY^T and X^T for wgrad: 1x128 along the token axis (128x1 of the row-major tensors)."""
    rollout_activation: QuantSpec | None
    """Input X of every quantized Linear in the rollout engine."""
    rollout_weight: QuantSpec | None
    """Weight W as the rollout engine holds it."""
    weight_sync: str = "fp8-bytes"
    """What the trainer sends at a sync: 'fp8-bytes' (its own bytes + scales) or 'bf16' (engine quantizes)."""
    grad_dtype: str = "bfloat16"
    """Dtype of gradients flowing between ops."""
    master_dtype: str = "float32"
    """Dtype of master weights and optimizer state."""
    save_activations_fp8: bool = True
    """Whether the Linear saves its input for backward in fp8 (wgrad's 128x1 operand, bytes + scales,
    quantized from the BF16 input in the forward) instead of the BF16 input itself."""
    fp8_param: bool = False
    """Store the primary weight as fp8 bytes + scales (fp32 masters in the optimizer path)."""
    keep_bf16: tuple[str, ...] = DEFAULT_KEEP_BF16
    """Module-name fragments never quantized."""
    allow_bf16_fallback_shapes: bool = False
    """Keep a Linear whose shape the FP8 GEMM cannot take in BF16 (reported) instead of refusing."""
    extra: tuple[tuple[str, str], ...] = field(default=())
    """Free-form (key, value) notes carried into reports."""

    def __post_init__(self) -> None:
        if self.grad_dtype != "bfloat16":
            raise RecipeError(f"Recipe.grad_dtype={self.grad_dtype!r}: gradients between ops stay 'bfloat16'")
        if self.master_dtype != "float32":
            raise RecipeError(f"Recipe.master_dtype={self.master_dtype!r}: master weights are 'float32'")
        if self.weight_sync not in ("fp8-bytes", "bf16"):
            raise RecipeError(f"Recipe.weight_sync={self.weight_sync!r}: choose 'fp8-bytes' or 'bf16'")
        if (self.train_activation is None) != (self.train_weight is None):
            raise RecipeError(f"recipe {self.name!r}: train_activation and train_weight must both be set or both None")
        if (self.rollout_activation is None) != (self.rollout_weight is None):
            raise RecipeError(
                f"recipe {self.name!r}: rollout_activation and rollout_weight must both be set or both None"
            )
        if self.train_fp8:
            if self.train_activation.granularity is not Granularity.G1x128:
                raise RecipeError(f"recipe {self.name!r}: train_activation must be 1x128 for the FP8 GEMMs")
            if self.train_weight.granularity is not Granularity.G128x128:
                raise RecipeError(f"recipe {self.name!r}: train_weight must be 128x128 for the FP8 GEMMs")
            if self.train_grad_output is None or self.train_wgrad is None:
                raise RecipeError(
                    f"recipe {self.name!r}: FP8 training needs train_grad_output and train_wgrad "
                    "(dgrad and wgrad run in FP8)"
                )
        else:
            if self.train_grad_output is not None or self.train_wgrad is not None:
                raise RecipeError(f"recipe {self.name!r}: backward quantization set but the forward is BF16")
            if self.save_activations_fp8:
                raise RecipeError(f"recipe {self.name!r}: save_activations_fp8 needs an FP8 training forward")
            if self.fp8_param:
                raise RecipeError(f"recipe {self.name!r}: fp8_param needs an FP8 training forward")
        if self.weight_sync == "fp8-bytes":
            if not self.train_fp8 or self.rollout_weight != self.train_weight:
                raise RecipeError(
                    f"recipe {self.name!r}: weight_sync='fp8-bytes' sends the trainer's own fp8 bytes, so "
                    "rollout_weight must equal train_weight (else use weight_sync='bf16')"
                )

    @property
    def train_fp8(self) -> bool:
        return self.train_weight is not None

    @property
    def rollout_fp8(self) -> bool:
        return self.rollout_weight is not None

    def keeps_bf16(self, module_name: str) -> bool:
        """True if a Linear of this name stays BF16 by the recipe's keep list. A fragment matches a
        run of whole dotted components (`mlp.gate` matches `layers.0.mlp.gate`, not `mlp.gate_proj`)."""
        parts = module_name.split(".")
        for frag in self.keep_bf16:
            fp = frag.split(".")
            for i in range(len(parts) - len(fp) + 1):
                if parts[i : i + len(fp)] == fp:
                    return True
        return False

    def rollout_matches_training(self) -> list[str]:
        """Differences between the rollout side and the training forward; empty when on-policy."""
        out = []
        if self.rollout_activation != self.train_activation:
            out.append(f"activation: training {_lbl(self.train_activation)} vs rollout {_lbl(self.rollout_activation)}")
        if self.rollout_weight != self.train_weight:
            out.append(f"weight: training {_lbl(self.train_weight)} vs rollout {_lbl(self.rollout_weight)}")
        return out

    def replace(self, **changes) -> Recipe:
        """A copy with fields changed (validated again); `name` is kept unless given."""
        return dataclasses.replace(self, **changes)

    @staticmethod
    def from_name(name: str, **overrides) -> Recipe:
        """A named recipe, optionally with fields overridden (e.g. `fp8_param=True`)."""
        try:
            factory = _RECIPES[name]
        except KeyError:
            raise RecipeError(f"unknown recipe {name!r}; choose one of {sorted(_RECIPES)}") from None
        recipe = factory()
        if overrides:
            valid = {f.name for f in dataclasses.fields(Recipe)}
            bad = sorted(set(overrides) - valid)
            if bad:
                raise RecipeError(f"unknown Recipe field(s) {bad}; valid fields: {sorted(valid)}")
            recipe = dataclasses.replace(recipe, **overrides)
        return recipe


def _lbl(spec: QuantSpec | None) -> str:
    return "bf16" if spec is None else spec.label()


def _unified() -> Recipe:
    return Recipe(
        name="jetrl-unified",
        train_activation=_act(),
        train_weight=_wgt(),
        train_grad_output=_act(),
        train_wgrad=QuantSpec(Granularity.G128x1),
        rollout_activation=_act(),
        rollout_weight=_wgt(),
        weight_sync="fp8-bytes",
    )


def _bf16() -> Recipe:
    return Recipe(
        name="bf16",
        train_activation=None,
        train_weight=None,
        train_grad_output=None,
        train_wgrad=None,
        rollout_activation=None,
        rollout_weight=None,
        weight_sync="bf16",
        save_activations_fp8=False,
    )


def _naive() -> Recipe:
    # vLLM online fp8: static per-tensor weight scale amax/448; dynamic per-token activation scale
    # with a floor of 1/(448*512) on the scale (eps on amax = 1/512).
    return Recipe(
        name="naive-fp8-rollout",
        train_activation=None,
        train_weight=None,
        train_grad_output=None,
        train_wgrad=None,
        rollout_activation=QuantSpec(Granularity.PER_TOKEN, eps=1.0 / 512.0),
        rollout_weight=QuantSpec(Granularity.PER_TENSOR, eps=0.0),
        weight_sync="bf16",
        save_activations_fp8=False,
    )


_RECIPES = {"jetrl-unified": _unified, "bf16": _bf16, "naive-fp8-rollout": _naive}
RECIPE_NAMES = tuple(_RECIPES)
