"""What the rollout engine's Linear layers compute, without any vLLM import.

Two rollout precisions exist, chosen by the recipe's rollout QuantSpecs:

- ``block`` (recipe ``jetrl-unified``; vLLM method name ``jetrl_fp8``): weights are e4m3 ``[N, K]``
  with fp32 128x128 block scales (vLLM's ``weight_scale_inv``), activations are quantized 1x128 per
  token, and the forward is `jetrl.gemm.linear_fp8` -- the very op the trainer's `JetFP8Linear`
  calls, so a rollout Linear computes what the training forward computes. A BF16 checkpoint is
  quantized once at load with `jetrl.gemm.quantize.quantize_128x128` (the trainer's weight quantizer);
  the first weight sync replaces those bytes with the trainer's own.
- ``bf16`` (recipe ``bf16``; vLLM method name ``jetrl_bf16``): plain BF16 Linears computed with
  ``torch.nn.functional.linear`` on the weight as loaded. On CPU this keeps vLLM from prepacking the
  weights into oneDNN/SGL layouts (which empties ``weight`` and makes an in-place sync impossible); on
  CUDA it is vLLM's own unquantized path.
- ``naive`` (recipe ``naive-fp8-rollout``; vLLM method name ``jetrl_fp8_naive``): the emulation of vLLM's
  online ``fp8_per_tensor`` path on a BF16 model -- one scale per (fused) weight tensor, amax/448 with
  no floor, and dynamic per-token activation scales with vLLM's floor (eps 1/512 on the amax). The
  quantizers are `jetrl.quant`'s, the product is `jetrl.quant.gemm_emulated` with each token's and the
  tensor's single scale broadcast over the 128-groups (the same real number per group, so the sum is
  unchanged). vLLM quantizes a fused ``qkv_proj`` / ``gate_up_proj`` as ONE tensor, and so do we.

Every method is compile-safe (vLLM runs them under torch.compile with CUDA graphs): the FP8 forwards
are opaque torch ops, and nothing in them synchronises with the host on CUDA. Non-finite Linear
input is never dropped silently: CPU raises at once, CUDA sets a device flag (the naive method's
per-layer flag; the Triton kernels' flags in block mode, which the trainer's `jetrl.kernels.check_nonfinite`
reads; both over the step's real token rows, `live_rows`) that `check_rollout_nonfinite` turns into
`NonFiniteError` naming the layer after each generate.

`RolloutQuantConfig` is the serialisable description handed to vLLM (as the checkpoint's
``quantization_config``) and read back by the plugin in every worker.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from dataclasses import dataclass

import torch

from jetrl.quant import NonFiniteError, ceil_div, defer_finite_checks, gemm_emulated, quantize
from jetrl.recipe import BLOCK, Granularity, QuantSpec, Recipe, RecipeError

__all__ = [
    "CHECKPOINT_FORMATS",
    "METHOD_NAMES",
    "RolloutQuantConfig",
    "block_quantize_weight",
    "block_forward",
    "block_forward_pre",
    "PreQuantized",
    "producer_values",
    "keep_producer_values",
    "naive_quantize_weight",
    "naive_forward",
    "naive_forward_impl",
    "rollout_linear_fp8_naive",
    "nonfinite_flag",
    "check_rollout_nonfinite",
    "reset_rollout_nonfinite",
    "live_rows",
    "set_live_rows_provider",
]

CHECKPOINT_FORMATS = ("bf16", "fp8-128x128")
"""``bf16``: the checkpoint holds BF16 Linear weights (quantized at load). ``fp8-128x128``: it holds
e4m3 ``weight`` + fp32 ``weight_scale_inv`` (a jetrl export or a stock vLLM block-FP8 checkpoint)."""
METHOD_NAMES = {"block": "jetrl_fp8", "naive": "jetrl_fp8_naive", "bf16": "jetrl_bf16"}
"""vLLM quantization-method name registered for each rollout mode."""

_BLOCK_ACT, _BLOCK_WGT = QuantSpec(Granularity.G1x128), QuantSpec(Granularity.G128x128)


def _mode_of(recipe: Recipe) -> str:
    if not recipe.rollout_fp8:
        return "bf16"
    if (recipe.rollout_activation, recipe.rollout_weight) == (_BLOCK_ACT, _BLOCK_WGT):
        return "block"
    if (recipe.rollout_activation.granularity, recipe.rollout_weight.granularity) == (
        Granularity.PER_TOKEN,
        Granularity.PER_TENSOR,
    ):
        return "naive"
    raise RecipeError(
        f"recipe {recipe.name!r}: rollout activation {recipe.rollout_activation.label()} with weight "
        f"{recipe.rollout_weight.label()} has no vLLM method; jetrl_fp8 runs exactly "
        f"{_BLOCK_ACT.label()} x {_BLOCK_WGT.label()}, jetrl_fp8_naive per-token x per-tensor"
    )


@dataclass(frozen=True)
class RolloutQuantConfig:
    """How the jetrl vLLM method quantizes one engine (JSON-serialisable through `to_hf_dict`)."""

    recipe: str = "jetrl-unified"
    """Name of the `Recipe` whose rollout side the engine runs."""
    checkpoint_format: str = "bf16"
    """One of `CHECKPOINT_FORMATS`: what the Linear weights on disk are."""
    backend: str = "auto"
    """`jetrl.gemm` backend for block mode (naive mode is emulated only)."""
    keep_bf16: tuple[str, ...] | None = None
    """Module-name fragments kept BF16; None = the recipe's `keep_bf16`."""
    ignored_layers: tuple[str, ...] = ()
    """Exact module names the checkpoint stores unquantized (a stock FP8 checkpoint's
    ``ignored_layers`` / ``modules_to_not_convert``)."""

    def __post_init__(self) -> None:
        if self.checkpoint_format not in CHECKPOINT_FORMATS:
            raise ValueError(
                f"RolloutQuantConfig.checkpoint_format={self.checkpoint_format!r}: choose one of {CHECKPOINT_FORMATS}"
            )
        object.__setattr__(self, "ignored_layers", tuple(self.ignored_layers))
        if self.keep_bf16 is not None:
            object.__setattr__(self, "keep_bf16", tuple(self.keep_bf16))
        mode = _mode_of(self.recipe_obj)  # validates the recipe name and its rollout specs
        if mode in ("naive", "bf16") and self.checkpoint_format != "bf16":
            raise ValueError(f"RolloutQuantConfig: the {mode} mode needs a BF16 checkpoint (checkpoint_format='bf16')")
        if mode == "naive" and self.backend not in ("auto", "emulated"):
            raise ValueError(f"RolloutQuantConfig: the naive mode is emulated only, got backend={self.backend!r}")

    @property
    def recipe_obj(self) -> Recipe:
        over = {} if self.keep_bf16 is None else {"keep_bf16": self.keep_bf16}
        return Recipe.from_name(self.recipe, **over)

    @property
    def mode(self) -> str:
        """``block``, ``naive`` or ``bf16``."""
        return _mode_of(self.recipe_obj)

    @property
    def method_name(self) -> str:
        """The vLLM quantization-method name of this mode."""
        return METHOD_NAMES[self.mode]

    def keeps_bf16(self, module_name: str) -> bool:
        """True if the (unfused, HF-named) module stays BF16."""
        return module_name in self.ignored_layers or self.recipe_obj.keeps_bf16(module_name)

    def to_hf_dict(self) -> dict:
        """The ``quantization_config`` dict vLLM hands back to `from_hf_dict` in each worker."""
        d = dataclasses.asdict(self)
        d["quant_method"] = self.method_name
        d["keep_bf16"] = None if self.keep_bf16 is None else list(self.keep_bf16)
        d["ignored_layers"] = list(self.ignored_layers)
        return d

    @classmethod
    def from_hf_dict(cls, d: dict) -> RolloutQuantConfig:
        """Inverse of `to_hf_dict`; also accepts a stock vLLM block-FP8 checkpoint config
        (``quant_method: fp8``, ``weight_block_size: [128, 128]``, dynamic activations, no ``scale_fmt``)."""
        method = d.get("quant_method")
        if method == "fp8":
            problems = []
            if list(d.get("weight_block_size") or []) != [BLOCK, BLOCK]:
                problems.append(f"weight_block_size={d.get('weight_block_size')!r} (need [128, 128])")
            if d.get("activation_scheme", "dynamic") != "dynamic":
                problems.append(f"activation_scheme={d.get('activation_scheme')!r} (need 'dynamic')")
            if d.get("scale_fmt") is not None:
                problems.append(f"scale_fmt={d.get('scale_fmt')!r} (power-of-two scales are not the jetrl numerics)")
            if problems:
                raise ValueError("this FP8 checkpoint cannot run under jetrl_fp8: " + "; ".join(problems))
            ignored = d.get("ignored_layers") or d.get("modules_to_not_convert") or ()
            return cls(recipe="jetrl-unified", checkpoint_format="fp8-128x128", ignored_layers=tuple(ignored))
        if method not in METHOD_NAMES.values():
            raise ValueError(f"quantization_config quant_method={method!r} is not a jetrl method {METHOD_NAMES}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - fields - {"quant_method"})
        if unknown:
            raise ValueError(f"quantization_config: unknown jetrl fields {unknown}; known {sorted(fields)}")
        cfg = cls(**{k: v for k, v in d.items() if k in fields})
        if cfg.method_name != method:
            raise ValueError(f"quantization_config: quant_method={method!r} but recipe {cfg.recipe!r} is {cfg.mode}")
        return cfg


def block_quantize_weight(w: torch.Tensor, *, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """BF16 ``[N, K]`` -> (e4m3 ``[N, K]``, fp32 ``[ceil(N/128), ceil(K/128)]``): the trainer's quantizer."""
    from jetrl.gemm.quantize import quantize_128x128

    return quantize_128x128(w, name=name)


def block_forward(x, w_q, w_s, bias, *, backend: str, name: str) -> torch.Tensor:
    """The rollout Linear of block mode: exactly `jetrl.gemm.linear_fp8`."""
    from jetrl.gemm import linear_fp8

    return linear_fp8(x, w_q, w_s, bias, backend=backend, name=name, live=live_rows(x.numel() // x.shape[-1]))


@dataclass
class PreQuantized:
    """An activation a fused producer of the engine already quantized for the next ``jetrl_fp8`` Linear
    (`jetrl.rollout.vllm_model`, ``engine_ops: fused``): the 1x128 bytes `q` ``[M, K]`` and scales `s` (the
    consumer backend's scale layout), the producing op, and the ``[..., K]`` `shape` and `dtype` of the value
    they quantize. vLLM's Linear layers hand their input to the quant method untouched, so it travels as the
    Linear's input. The value itself, `y`, is written only while `producer_values` is open (the lint's
    capture records it); otherwise the producer's kernel quantizes it without storing it (None)."""

    q: torch.Tensor
    s: torch.Tensor
    op: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    y: torch.Tensor | None = None


_PRODUCER_VALUES = [0]


@contextlib.contextmanager
def producer_values():
    """While open (in the process running the engine's model), the engine's fused producers also write the
    value they quantize (`PreQuantized.y`), for `jetrl.lint.capture.Recorder`. Read when a producer runs,
    so an engine whose forward vLLM compiled or captured into CUDA graphs outside it keeps not writing it."""
    _PRODUCER_VALUES[0] += 1
    try:
        yield
    finally:
        _PRODUCER_VALUES[0] -= 1


def keep_producer_values() -> bool:
    """Whether `producer_values` is open: the engine's fused producers write their value."""
    return _PRODUCER_VALUES[0] > 0


def block_forward_pre(x_q, x_s, w_q, w_s, bias, *, backend: str, name: str, out_dtype: torch.dtype) -> torch.Tensor:
    """The block-mode Linear of an already quantized input ``[M, K]`` (`PreQuantized`): `jetrl.gemm.fprop`
    of its bytes, what `block_forward` computes from the value they quantize; ``[M, N]``."""
    from jetrl.gemm import fprop, get_backend

    return fprop(x_q, x_s, w_q, w_s, bias, backend=get_backend(backend), out_dtype=out_dtype, name=name)


def naive_quantize_weight(w: torch.Tensor, spec: QuantSpec, *, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One per-tensor scale for the whole (fused) weight, as vLLM's online fp8: (e4m3 ``[N, K]``, fp32 ``[]``)."""
    if spec.granularity is not Granularity.PER_TENSOR:
        raise ValueError(f"{name}: naive weight quantization is per-tensor, got {spec.label()}")
    return quantize(w, spec, name=name)


def naive_forward(x, w_q, w_s, bias, *, act_spec: QuantSpec, name: str) -> torch.Tensor:
    """Per-token activations x per-tensor weight, emulated exactly (float64 block sums).

    Input: x ``[..., K]``, w_q e4m3 ``[N, K]``, w_s fp32 ``[]`` (or one element). Output ``[..., N]`` in x.dtype.

    Compile-safe: the computation is the opaque torch op ``jetrl::rollout_linear_fp8_naive``, so vLLM's
    torch.compile (fullgraph) sees one node and CUDA-graph capture never reaches a host sync. Non-finite
    input raises `NonFiniteError` naming `name` at once on CPU; on CUDA the test runs on the device
    into this layer's flag, and `check_rollout_nonfinite` (called after every generate) raises with the
    name."""
    if act_spec.granularity is not Granularity.PER_TOKEN:
        raise ValueError(f"{name}: naive activation quantization is per-token, got {act_spec.label()}")
    k = x.shape[-1]
    if w_q.dim() != 2 or w_q.shape[1] != k:
        raise ValueError(f"{name}: input has K={k} features but the weight is {tuple(w_q.shape)}")
    if w_s.numel() != 1:
        raise ValueError(f"{name}: naive weight scale must be one value per tensor, got shape {tuple(w_s.shape)}")
    return rollout_linear_fp8_naive(
        x, w_q, w_s, bias, act_spec.eps, act_spec.scale_format.value, act_spec.division.value, name
    )


def _naive_eager(x, w_q, w_s, bias, act_spec: QuantSpec, name: str) -> torch.Tensor:
    k = x.shape[-1]
    n = w_q.shape[0]
    x2 = x.reshape(-1, k)
    x_q, x_s = quantize(x2, act_spec, name=name)  # x_s [M, 1]
    kb = ceil_div(k, BLOCK)
    a_s = x_s.expand(x2.shape[0], kb).contiguous()
    b_s = w_s.reshape(1, 1).to(torch.float32).expand(ceil_div(n, BLOCK), kb).contiguous()
    # Shapes: [M, K] @ [N, K]^T -> [M, N]
    y = gemm_emulated(x_q, a_s, w_q, b_s, role="fprop", out_dtype=x.dtype)
    if bias is not None:
        y = y + bias.to(x.dtype)
    return y.reshape(*x.shape[:-1], n)


def naive_forward_impl(x, w_q, w_s, bias, act_spec: QuantSpec, name: str, *, defer: bool) -> torch.Tensor:
    """The eager body of ``jetrl::rollout_linear_fp8_naive``. `defer` False: non-finite `x` raises at
    once (what CPU runs). `defer` True (what CUDA runs): no host synchronisation; the finite test is
    recorded in `nonfinite_flag(name, x.device)` for `check_rollout_nonfinite`."""
    if not defer:
        return _naive_eager(x, w_q, w_s, bias, act_spec, name)
    flag = nonfinite_flag(name, x.device)
    rows = live_rows(x.numel() // x.shape[-1])

    def _record(t: torch.Tensor, _name: str) -> None:
        bad = ~torch.isfinite(t)
        if rows is not None and t.dim() == 2 and t.shape[0] == rows.shape[0]:
            bad = bad.any(-1) & (rows >= 0)  # padding rows of a CUDA-graph batch hold stale memory: not inputs
        flag.bitwise_or_(bad.any().to(torch.int32).reshape(1))

    with defer_finite_checks(_record):
        return _naive_eager(x, w_q, w_s, bias, act_spec, name)


@torch.library.custom_op("jetrl::rollout_linear_fp8_naive", mutates_args=())
def rollout_linear_fp8_naive(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_s: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    scale_format: str,
    division: str,
    name: str,
) -> torch.Tensor:
    """`naive_forward` as one opaque torch op (see there). The layer's non-finite flag is written as a
    side effect on CUDA, like the Triton kernels' flags."""
    spec = QuantSpec(Granularity.PER_TOKEN, scale_format=scale_format, eps=eps, division=division)
    return naive_forward_impl(x, w_q, w_s, bias, spec, name, defer=x.is_cuda).contiguous()


@rollout_linear_fp8_naive.register_fake
def _(x, w_q, w_s, bias, eps, scale_format, division, name):
    return x.new_empty((*x.shape[:-1], w_q.shape[0]))


# -- non-finite flags of the rollout methods ----------------------------------------------------

_live_rows_provider = None
"""None, or ``fn(n_rows) -> integer [n_rows] device tensor | None``: per row of the current engine step's
activations, an entry < 0 where the row is padding (vLLM's slot mapping). vLLM pads a CUDA-graph batch to
its captured size and leaves the padding rows' activations unwritten (stale memory, NaN bit patterns
included; attention writes only the real rows), so the deferred finite tests look at real rows only. Set by
the vLLM plugin (`set_live_rows_provider`), which reads vLLM's step context."""


def set_live_rows_provider(fn) -> None:
    """Install (or, with None, remove) the `_live_rows_provider` of this process."""
    global _live_rows_provider
    if fn is not None and not callable(fn):
        raise TypeError(f"set_live_rows_provider: expected a callable or None, got {fn!r}")
    _live_rows_provider = fn


def live_rows(n_rows: int) -> torch.Tensor | None:
    """The current engine step's rows as the ``live`` argument of `jetrl.kernels`' launchers (an integer
    ``[n_rows]`` tensor, < 0 on padding rows), or None (every row counts) outside a step or without a
    provider. Called in the ops' eager bodies, so a captured CUDA graph reads the step's buffer each replay."""
    return None if _live_rows_provider is None else _live_rows_provider(n_rows)


_flag_lock = threading.Lock()
_flags: dict[tuple[str, torch.device], torch.Tensor] = {}
"""(layer input name, device) -> int32 [1], set to 1 by the device when that input held NaN/Inf.
One tensor per name, allocated at its first (eager, pre-capture) call and never reallocated, so a
captured CUDA graph keeps writing where `check_rollout_nonfinite` reads."""


def nonfinite_flag(name: str, device: torch.device | str) -> torch.Tensor:
    """The device flag of the rollout Linear input `name` on `device` (created zeroed on first use)."""
    device = torch.device(device)
    key = (name, device)
    with _flag_lock:
        flag = _flags.get(key)
        if flag is None:
            # a normal tensor even when first reached under vLLM's inference mode (an inference tensor
            # could not be cleared by `check_rollout_nonfinite` outside it)
            with torch.inference_mode(False):
                flag = _flags[key] = torch.zeros(1, dtype=torch.int32, device=device)
    return flag


def reset_rollout_nonfinite() -> None:
    """Clear the rollout methods' flags without checking (after an engine's warm-up on dummy data)."""
    with _flag_lock:
        for flag in _flags.values():
            flag.zero_()


def check_rollout_nonfinite(*, kernels: bool = False, reset: bool = True) -> None:
    """Raise `NonFiniteError` naming every rollout Linear input that held NaN/Inf since the last check.

    Reads the naive method's per-layer flags (one device-to-host copy per device) and, with `kernels`,
    also the Triton kernels' flags (`jetrl.kernels.check_nonfinite`; the jetrl_fp8 method's activation
    quantizer and the fused engine's producers set them, on the step's real rows (`live_rows`), and the
    trainer reads them each step). Call after a generate, outside any graph. With `reset` the flags are
    cleared, also when raising."""
    bad: list[str] = []
    with _flag_lock:
        by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
        for (name, device), flag in _flags.items():
            by_device.setdefault(device, []).append((name, flag))
        for device, items in by_device.items():
            hits = torch.cat([f for _, f in items]).tolist()  # the one device->host sync per device
            bad += [f"{name} ({device})" for (name, _), h in zip(items, hits, strict=True) if h]
            if reset and any(hits):
                for _, f in items:
                    f.zero_()
    kernel_error = None
    if kernels:
        from jetrl.kernels import check_nonfinite

        try:
            check_nonfinite(reset=reset)
        except NonFiniteError as e:
            kernel_error = str(e)
    if bad or kernel_error:
        parts = []
        if bad:
            parts.append("naive FP8 Linear inputs: " + "; ".join(bad))
        if kernel_error:
            parts.append(kernel_error)
        raise NonFiniteError(
            "non-finite values (NaN/Inf) reached the rollout's FP8 Linears; the samples are invalid: "
            + " | ".join(parts)
        )
