"""Capture a precision graph from a running model: module hooks for paths, a function mode for ops.

`Recorder` observes one forward (or a whole vLLM generate) without changing anyone's code:

- forward pre/post hooks on every submodule keep a stack of module paths, so each observed op knows
  the innermost module that ran it, and record each module's first call (input/output tensors);
- a `TorchFunctionMode` sees every call of a ``torch.ops.jetrl.*`` custom op (the FP8 quantizers of
  `jetrl.kernels` — the trainer's `JetFP8Linear` and the rollout's ``jetrl_fp8`` method both reach
  them through `jetrl.gemm.linear_fp8`) with its inputs and outputs.

`trace_model` turns the recording plus static facts read from the modules (which Linear class or
vLLM quant method, weight dtype, fused output partitions, K/V cache dtype) into a `ModelTrace`: plain,
picklable data, so a vLLM worker can build it in-process and hand it back through `Engine.apply`.
`graph_from_trace` makes the precision `Graph` from it.

Labels are observed, not assumed, wherever the data allows: an activation's QuantSpec is the spec of
the jetrl op that produced its bytes (`OP_SPECS`; the kernels are tested bit-equal to `jetrl.quant`),
and a trainer weight's spec is identified from its bytes (`identify_spec` requantizes the BF16 master
with candidate specs and keeps the one that reproduces bytes and scales exactly). Where nothing is
observable (a quantizer that is not a jetrl op, an engine holding only fp8 bytes) the label is the
one the layer's method declares, and the edge's producer says so. When a recipe declares one spec and
the observed op computes another, the trace records a ``declared-vs-observed`` discrepancy.
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from jetrl import quant
from jetrl.lint.ir import BF16, FP8, Graph, OpKind, Precision, linear_site
from jetrl.recipe import DEFAULT_EPS, Division, Granularity, QuantSpec, ScaleFormat

__all__ = [
    "OP_SPECS",
    "Recorder",
    "ModuleInfo",
    "ModelTrace",
    "trace_model",
    "graph_from_trace",
    "identify_spec",
    "digest",
]

OP_SPECS: dict[str, QuantSpec] = {
    "jetrl::quantize_1x128": QuantSpec(Granularity.G1x128),
    "jetrl::quantize_128x128": QuantSpec(Granularity.G128x128),
    "jetrl::transpose_quantize": QuantSpec(Granularity.G128x1),
    "jetrl::rmsnorm_quant": QuantSpec(Granularity.G1x128),
    "jetrl::add_rmsnorm_quant": QuantSpec(Granularity.G1x128),
    "jetrl::swiglu_quant": QuantSpec(Granularity.G1x128),
}
"""The spec each jetrl custom op implements (interface A: each is bit-identical to `jetrl.quant`)."""

_ACT_OPS = ("jetrl::quantize_1x128",)
"""Ops that quantize a Linear's input inside the Linear (the weight quantizers also run there, once)."""
_FUSED_OPS = {
    "jetrl::rmsnorm_quant": OpKind.NORM_QUANT,
    "jetrl::add_rmsnorm_quant": OpKind.NORM_QUANT,  # the rollout engine's residual add + norm + quantize
    "jetrl::swiglu_quant": OpKind.ACTIVATION_QUANT,
}


def digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes (dtype and shape included), for weight-equality checks."""
    shape = tuple(t.shape)
    t = t.detach().contiguous().cpu().reshape(-1)
    h = hashlib.sha256(f"{t.dtype}{shape}".encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _candidate_specs(granularity: Granularity, hint: QuantSpec | None) -> list[QuantSpec]:
    out = [hint] if hint is not None and hint.granularity is granularity else []
    for fmt, div, eps in itertools.product(ScaleFormat, Division, (DEFAULT_EPS, 0.0, 1e-4, 1e-12, 1.0 / 512.0)):
        spec = QuantSpec(granularity, scale_format=fmt, eps=eps, division=div)
        if spec not in out:
            out.append(spec)
    return out


def identify_spec(
    x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, granularity: Granularity, hint: QuantSpec | None = None
) -> QuantSpec | None:
    """The first candidate spec (the `hint` first) whose `jetrl.quant.quantize(x, spec)` reproduces
    bytes `q` and scales `s` exactly; None if no candidate does. Specs that differ only where `x`
    has no distinguishing data (e.g. eps without an all-zero group) are indistinguishable here, so
    the hint wins ties."""
    for spec in _candidate_specs(granularity, hint):
        q2, s2 = quant.quantize(x, spec, name="identify_spec")
        if torch.equal(q2.view(torch.uint8), q.contiguous().view(torch.uint8)) and torch.equal(
            s2.reshape(s.shape), s.contiguous()
        ):
            return spec
    return None


@dataclass
class OpCall:
    op: str
    module: str
    inputs: list[Any]
    outputs: list[Any]


@dataclass
class ModuleCall:
    path: str
    x: torch.Tensor | None
    y: torch.Tensor | None


class _OpMode(TorchFunctionMode):
    def __init__(self, rec: Recorder) -> None:
        super().__init__()
        self.rec = rec

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not (isinstance(func, torch._ops.OpOverload) and func.namespace == "jetrl"):
            return func(*args, **kwargs)
        name = f"jetrl::{func._opname}"
        impl = None if name in OP_SPECS else _composite_impl(name, args)
        if impl is not None:
            # A composite jetrl op (the rollout's jetrl::rollout_linear_fp8 wraps linear_fp8 as one opaque
            # node for torch.compile): a mode is switched off while its handler runs, so calling the op
            # would hide the quantizers inside it. Run its Python body (what the dispatcher would run)
            # with this mode switched back on instead, so they are observed too.
            with self:
                out = impl(*args, **kwargs)
        else:
            out = func(*args, **kwargs)
        self.rec._on_op(name, args, out)
        return out


def _composite_impl(name: str, args: Any):
    """The Python implementation of a ``torch.library.custom_op`` for the device of `args`, or None
    (unknown op, or autograd would be needed: then the op is called as is and its inside not observed)."""
    from torch._library import custom_ops

    opdef = custom_ops.OPDEFS.get(name)
    t = _first_tensor(list(args))
    if (
        opdef is None
        or t is None
        or (torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args))
    ):
        return None
    return opdef._backend_fns.get(t.device.type) or opdef._init_fn


def _prequantized(obj: Any):
    """`obj` if it is the engine's pre-quantized Linear input (`jetrl.rollout.methods.PreQuantized`), else None."""
    from jetrl.rollout.methods import PreQuantized

    return obj if isinstance(obj, PreQuantized) else None


def _first_tensor(obj: Any) -> torch.Tensor | None:
    if isinstance(obj, torch.Tensor):
        return obj
    if _prequantized(obj) is not None:
        if obj.y is None:
            raise RuntimeError(
                f"lint capture: the engine's fused producer {obj.op} did not write the value its FP8 bytes "
                "quantize: the forward ran without jetrl.rollout.methods.producer_values open (vLLM compiled or "
                "captured it before the Recorder was installed); capture an eager engine (enforce_eager=True)"
            )
        return obj.y  # the BF16 value its bytes quantize
    if isinstance(obj, list | tuple):
        for o in obj:
            t = _first_tensor(o)
            if t is not None:
                return t
    return None


def _keep(t: Any, keep: bool) -> Any:
    if isinstance(t, torch.Tensor):
        return t.detach().clone().cpu() if keep else None
    if isinstance(t, list | tuple):
        return [_keep(o, keep) for o in t]
    return t


class Recorder:
    """Context manager recording module calls and jetrl op calls of `model` (see module docstring).

    ``keep_tensors``: keep CPU copies of each module's first input/output and of each op's first
    call per module (numeric mode). Only the first call of every module and op is kept: a vLLM
    generate runs one prefill then decode steps, and the prefill is the call compared."""

    def __init__(self, model: nn.Module, *, keep_tensors: bool = False) -> None:
        self.model = model
        self.keep = keep_tensors
        self.stack: list[str] = []
        self.module_calls: dict[str, ModuleCall] = {}
        self.order: list[str] = []
        self.op_calls: dict[tuple[str, str], OpCall] = {}
        self.op_counts: dict[tuple[str, str], int] = {}
        self.prequantized: dict[str, tuple[str, Any, Any]] = {}
        """Module -> (producing op, fp8 bytes, scales) of a pre-quantized input (first call; tensors kept
        with ``keep_tensors``)."""
        self._handles: list[Any] = []
        self._mode: _OpMode | None = None
        self._values: Any = None

    def _on_op(self, op: str, args: Any, out: Any) -> None:
        module = self.stack[-1] if self.stack else ""
        key = (module, op)
        self.op_counts[key] = self.op_counts.get(key, 0) + 1
        if key not in self.op_calls:
            self.op_calls[key] = OpCall(op, module, _keep(list(args), self.keep), _keep(list(out), self.keep))

    def _pre(self, path: str):
        def hook(mod, args, kwargs):
            self.stack.append(path)
            if path not in self.module_calls:
                self.order.append(path)
                self.module_calls[path] = ModuleCall(path, _keep(_first_tensor(args), self.keep), None)
                pre = _prequantized(args[0]) if args else None
                if pre is not None:
                    self.prequantized[path] = (pre.op, _keep(pre.q, self.keep), _keep(pre.s, self.keep))

        return hook

    def _post(self, path: str):
        def hook(mod, args, kwargs, out):
            if self.stack and self.stack[-1] == path:
                self.stack.pop()
            call = self.module_calls.get(path)
            if call is not None and call.y is None and self.keep:
                call.y = _keep(_first_tensor(out), True)

        return hook

    def __enter__(self) -> Recorder:
        for path, mod in self.model.named_modules():
            if not path:
                continue
            self._handles.append(mod.register_forward_pre_hook(self._pre(path), with_kwargs=True))
            self._handles.append(mod.register_forward_hook(self._post(path), with_kwargs=True))
        self._mode = _OpMode(self)
        self._mode.__enter__()
        from jetrl.rollout.methods import producer_values

        self._values = producer_values()  # the engine's fused producers write the values recorded here
        self._values.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._values is not None:
            self._values.__exit__(*exc)
            self._values = None
        if self._mode is not None:
            self._mode.__exit__(*exc)
            self._mode = None
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.stack.clear()


# ---------------------------------------------------------------------------------------------
# Static facts about the modules, and the trace
# ---------------------------------------------------------------------------------------------


@dataclass
class ModuleInfo:
    """What one module is, precision-wise (picklable)."""

    path: str
    kind: str
    """One of: embedding, norm, linear, lm_head, attention, activation."""
    type_name: str
    n: int = 0
    k: int = 0
    parts: tuple[tuple[str, int], ...] = ()
    x: Precision | None = None
    w: Precision | None = None
    kv: Precision | None = None
    x_origin: str = ""
    w_origin: str = ""
    tp_size: int = 1
    weight_digest: str = ""
    declared: dict[str, str] = field(default_factory=dict)
    """Declared-vs-observed discrepancies: tensor -> message."""
    fused_op: str = ""
    """A fused op+quantize (``jetrl::rmsnorm_quant``, ``jetrl::swiglu_quant``) observed in this module."""


@dataclass
class ModelTrace:
    side: str
    source: str
    modules: list[ModuleInfo]
    order: list[str]
    """Module paths in first-call order."""
    op_counts: dict[str, int] = field(default_factory=dict)
    tensors: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Numeric mode: path -> {"x", "y", "xq", "xs", "wq", "ws"} CPU tensors."""
    meta: dict[str, Any] = field(default_factory=dict)


_NORM_TYPES = ("RMSNorm", "LayerNorm")


def _is_vllm_linear(mod: nn.Module) -> bool:
    return any(c.__name__ == "LinearBase" for c in type(mod).__mro__)


def _classify(path: str, mod: nn.Module) -> str | None:
    tn = type(mod).__name__
    leaf = path.rsplit(".", 1)[-1]
    if "Embedding" in tn and "Rotary" not in tn and leaf != "lm_head":
        return "embedding"
    if any(t in tn for t in _NORM_TYPES):
        return "norm"
    if leaf == "lm_head" or tn == "LogitsProcessor":
        return "lm_head"
    if isinstance(mod, nn.Linear) or _is_vllm_linear(mod):
        return "linear"
    if tn.endswith("Attention"):
        children = dict(mod.named_children())
        if any(type(c).__name__.endswith("Attention") for c in children.values()):
            return None  # vLLM's Qwen3Attention container; its .attn child is the attention core
        return "attention"
    if leaf == "act_fn":
        return "activation"
    return None


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def _kv_precision(mod: nn.Module, act_dtype: str) -> Precision:
    kvd = getattr(mod, "kv_cache_dtype", None)
    if kvd is None or kvd == "auto":
        return Precision(act_dtype)
    if "e5m2" in str(kvd):
        return Precision("float8_e5m2", None, f"vllm kv-cache {kvd}")
    if "fp8" in str(kvd):
        return Precision(FP8, QuantSpec(Granularity.PER_TENSOR, eps=0.0), f"vllm kv-cache {kvd} (static per-tensor)")
    return Precision(str(kvd))


def _hf_linear_info(path: str, mod: nn.Linear, kind: str, rec: Recorder, conversion: dict[str, str]) -> ModuleInfo:
    info = ModuleInfo(path, kind, type(mod).__name__, n=mod.out_features, k=mod.in_features)
    origin = f"convert:{conversion[path]}" if path in conversion else ""
    info.x_origin = info.w_origin = origin
    fp8_weight = getattr(mod, "fp8_weight", None)
    if fp8_weight is None:
        info.x = Precision(_dtype_name(mod.weight.dtype))
        info.w = Precision(_dtype_name(mod.weight.dtype))
        info.weight_digest = digest(mod.weight)
        return info
    recipe = getattr(mod, "recipe", None)
    declared_w = getattr(recipe, "train_weight", None)
    declared_x = getattr(recipe, "train_activation", None)
    with torch.no_grad():
        wq, ws = fp8_weight()
        spec = identify_spec(mod.weight.detach(), wq, ws, Granularity.G128x128, declared_w)
    info.weight_digest = digest(wq) + ":" + digest(ws)
    if spec is None:
        raise ValueError(f"{path}: the trainer's fp8 weight bytes match no known 128x128 QuantSpec of its BF16 weight")
    info.w = Precision(FP8, spec, "JetFP8Linear.fp8_weight (bytes identified against jetrl.quant)")
    if declared_w is not None and declared_w != spec:
        info.declared["w"] = f"recipe declares {declared_w.label()} but the trainer's weight bytes are {spec.label()}"
    ops = [op for (m, op) in rec.op_calls if m == path and op in _ACT_OPS]
    # a pre-quantized input (attach_quantized by a fused producer): the fused op's spec labels it
    pre = [op for (m, op) in rec.op_calls if op in _FUSED_OPS]
    if ops:
        info.x = Precision(FP8, OP_SPECS[ops[0]], ops[0])
    elif pre:
        info.x = Precision(FP8, OP_SPECS[pre[0]], f"{pre[0]} (pre-quantized by a fused producer)")
    else:
        raise ValueError(f"{path}: JetFP8Linear ran but no jetrl quantize op was observed for its input")
    if declared_x is not None and declared_x != info.x.spec:
        info.declared["x"] = f"recipe declares {declared_x.label()} but the trainer quantizes with {info.x.label()}"
    return info


def _vllm_linear_info(path: str, mod: nn.Module, kind: str, rec: Recorder) -> ModuleInfo:
    qm = getattr(mod, "quant_method", None)
    qm_name = type(qm).__name__ if qm is not None else "none"
    widths = tuple(getattr(mod, "logical_widths", None) or getattr(mod, "output_partition_sizes", None) or ())
    n = int(getattr(mod, "output_size_per_partition", 0) or sum(widths) or mod.weight.shape[0])
    k = int(getattr(mod, "input_size_per_partition", 0) or mod.weight.shape[-1])
    info = ModuleInfo(path, kind, type(mod).__name__, n=n, k=k, tp_size=int(getattr(mod, "tp_size", 1) or 1))
    leaf = path.rsplit(".", 1)[-1]
    from jetrl.lint.layout import FUSED_LINEARS

    if leaf in FUSED_LINEARS and len(widths) == len(FUSED_LINEARS[leaf]):
        info.parts = tuple(zip(FUSED_LINEARS[leaf], (int(w) for w in widths), strict=True))
    recipe = getattr(qm, "recipe", None)
    mode = getattr(mod, "jetrl_mode", None)
    cfg = getattr(qm, "cfg", None)
    info.x_origin = info.w_origin = f"jetrl-vllm:{qm_name}" + (f" (recipe {cfg.recipe})" if cfg is not None else "")
    if mode not in ("block", "naive"):  # vLLM's UnquantizedLinearMethod or jetrl_bf16
        act = _dtype_name(getattr(mod, "orig_dtype", None) or mod.weight.dtype)
        info.x = info.w = Precision(act, None, f"vllm:{qm_name}")
        why = "recipe bf16" if mode == "bf16" else "kept BF16: keep_bf16 / ignored_layers"
        info.x_origin = info.w_origin = f"jetrl-vllm:{qm_name} ({why})"
        info.weight_digest = digest(mod.weight)
        return info
    w_spec = recipe.rollout_weight
    info.w = Precision(FP8, w_spec, f"engine weight bytes ({qm_name}, declared)")
    scale = getattr(mod, "weight_scale_inv", None)
    if scale is None:
        scale = getattr(mod, "weight_scale", None)
    info.weight_digest = digest(mod.weight) + ":" + (digest(scale) if scale is not None else "")
    ops = [op for (m, op) in rec.op_calls if m == path and op in _ACT_OPS]
    pre = rec.prequantized.get(path)
    if ops or pre is not None:
        # quantized inside the Linear, or before it by the trainer-matched model's fused producer
        op = ops[0] if ops else pre[0]
        info.x = Precision(FP8, OP_SPECS[op], op if ops else f"{op} (pre-quantized by a fused producer)")
        if recipe.rollout_activation != info.x.spec:
            info.declared["x"] = (
                f"the rollout recipe declares {recipe.rollout_activation.label()} but the engine quantizes with "
                f"{info.x.label()}"
            )
    else:
        info.x = Precision(FP8, recipe.rollout_activation, f"{qm_name} apply (declared; not a jetrl op)")
    return info


def trace_model(
    model: nn.Module,
    rec: Recorder,
    *,
    side: str,
    source: str,
    conversion: dict[str, str] | None = None,
    act_dtype: str = "bfloat16",
) -> ModelTrace:
    """Static facts of `model`'s precision-relevant modules plus what `rec` observed (see module docstring).
    `conversion`: HF Linear name -> the conversion report's reason (the training side's origins)."""
    conversion = conversion or {}
    modules: list[ModuleInfo] = []
    by_path = dict(model.named_modules())
    vllm = any(_is_vllm_linear(m) for m in by_path.values())
    for path, mod in by_path.items():
        kind = _classify(path, mod) if path else None
        if kind is None:
            qm = getattr(mod, "quant_method", None)
            if qm is not None and type(mod).__name__ != "LogitsProcessor":
                # a quantizable engine module the lint does not model (e.g. vLLM's FusedMoE): refuse
                # rather than leave a rollout op unchecked
                raise ValueError(
                    f"{path}: {type(mod).__name__} with quant method {type(qm).__name__} is not modelled by the "
                    "precision lint (dense Linear, lm_head, attention only)"
                )
            continue
        if kind == "lm_head" and type(mod).__name__ == "LogitsProcessor":
            continue  # the vLLM lm_head's precision is read from the lm_head module itself
        if kind in ("linear", "lm_head"):
            if vllm:
                if kind == "lm_head":
                    info = ModuleInfo(path, kind, type(mod).__name__, n=mod.weight.shape[0], k=mod.weight.shape[1])
                    qm = type(getattr(mod, "quant_method", None)).__name__
                    info.x = Precision(act_dtype, None, f"vllm:{qm}")
                    info.w = Precision(_dtype_name(mod.weight.dtype), None, f"vllm:{qm}")
                    info.x_origin = info.w_origin = f"vllm:ParallelLMHead ({qm}; never given to jetrl_fp8)"
                    info.weight_digest = digest(mod.weight)
                else:
                    info = _vllm_linear_info(path, mod, kind, rec)
            else:
                info = _hf_linear_info(path, mod, kind, rec, conversion)
        else:
            info = ModuleInfo(path, kind, type(mod).__name__)
            fused = [op for (m, op) in rec.op_calls if m == path and op in _FUSED_OPS]
            info.fused_op = fused[0] if fused else ""
            if kind == "attention":
                info.kv = _kv_precision(mod, act_dtype)
        modules.append(info)
    trace = ModelTrace(side, source, modules, list(rec.order), {f"{m}|{op}": c for (m, op), c in rec.op_counts.items()})
    if rec.keep:
        for info in modules:
            call = rec.module_calls.get(info.path)
            t: dict[str, Any] = {"x": call.x, "y": call.y} if call is not None else {}
            for (m, op), oc in rec.op_calls.items():
                if m == info.path and op == "jetrl::quantize_1x128" and oc.outputs:
                    t["xq"], t["xs"] = oc.outputs[0], oc.outputs[1]
            if "xq" not in t and info.path in rec.prequantized:
                t["xq"], t["xs"] = rec.prequantized[info.path][1:]
            mod = by_path[info.path]
            if info.kind in ("linear", "lm_head") and info.w is not None and info.w.quantized:
                if hasattr(mod, "fp8_weight"):
                    with torch.no_grad():
                        wq, ws = mod.fp8_weight()
                else:
                    wq = mod.weight
                    ws = getattr(mod, "weight_scale_inv", None)
                    ws = ws if ws is not None else getattr(mod, "weight_scale", None)
                t["wq"], t["ws"] = _keep(wq, True), _keep(ws, True)
            elif info.kind in ("linear", "lm_head") and hasattr(mod, "weight"):
                t["w"] = _keep(mod.weight, True)
            if t:
                trace.tensors[info.path] = t
        lp = rec.module_calls.get("logits_processor")
        if lp is not None:  # vLLM computes the logits here, not in lm_head.forward
            trace.tensors["logits_processor"] = {"x": lp.x, "y": lp.y}
    return trace


# ---------------------------------------------------------------------------------------------
# Trace -> Graph
# ---------------------------------------------------------------------------------------------


def graph_from_trace(trace: ModelTrace) -> Graph:
    """The precision graph of a trace, in the model's own module names (normalize it before checking).

    Only modules that ran are included; edges follow first-call order (the source of a node's input
    is the previous precision-relevant node that ran). Attention gets a ``kv`` port for its K/V."""
    g = Graph(trace.side, trace.source, meta=dict(trace.meta))
    infos = {i.path: i for i in trace.modules}
    prev = "input"
    ran = [p for p in trace.order if p in infos]
    # vLLM never calls lm_head.forward (LogitsProcessor applies it): include it after the last node
    for i in trace.modules:
        if i.kind == "lm_head" and i.path not in ran:
            ran.append(i.path)
    for path in ran:
        info = infos[path]
        if info.kind in ("linear", "lm_head"):
            attrs: dict[str, Any] = {"n": info.n, "k": info.k, "impl": info.type_name}
            if info.parts:
                attrs["parts"] = info.parts
            kind = OpKind.LM_HEAD if info.kind == "lm_head" else OpKind.GEMM
            gemm = linear_site(
                g,
                path,
                x=info.x,
                w=info.w,
                x_src=prev,
                kind=kind,
                x_origin=info.x_origin,
                w_origin=info.w_origin,
                **attrs,
            )
            prev = gemm.id
            continue
        kind = {
            "embedding": OpKind.EMBEDDING,
            "norm": OpKind.NORM,
            "attention": OpKind.ATTENTION,
            "activation": OpKind.ACTIVATION,
        }[info.kind]
        if info.fused_op:
            # interface A: the fused ops quantize their output after rounding it to the input dtype
            kind = _FUSED_OPS[info.fused_op]
            node = g.add_node(kind, path, impl=info.fused_op, quant_input="bfloat16", out_dtype="bfloat16")
        else:
            node = g.add_node(kind, path, impl=info.type_name)
        if kind is OpKind.EMBEDDING:
            g.add_edge(f"param:{path}.weight", node.id, "w", BF16)
        else:
            g.add_edge(prev, node.id, "x", BF16)
        if kind is OpKind.ATTENTION:
            g.add_edge(prev, node.id, "kv", info.kv or BF16)
        prev = node.id
    g.meta["declared_vs_observed"] = {
        f"{i.path}:{t}": msg for i in trace.modules for t, msg in i.declared.items() if i.path in ran
    }
    g.meta["weight_digests"] = {i.path: i.weight_digest for i in trace.modules if i.weight_digest}
    return g
