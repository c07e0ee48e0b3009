"""vLLM model classes whose ops between the Linears are the trainer's (``engine_ops`` 'hf' / 'fused').

Why. Under ``jetrl-unified`` the Linears of trainer and engine compute the same bytes, so what keeps
their log-probs apart is the ops between them. vLLM computes those its own way: on CUDA under
torch.compile its RMSNorm normalizes the fp32 sum ``x + residual`` and inductor drops the BF16
rounding between normalizing and weighting, RoPE and SiLU-and-mul are fused into one fp32 expression
rounded once, while transformers (the trainer) rounds to BF16 after each op. One BF16 ulp moved upstream
of an FP8 quantizer lands in the neighbouring e4m3 bin, so these differences reach the Linears' FP8
inputs (NUMERICS.md; the fidelity results in the README).

What. `JetrlQwen3ForCausalLM`, `JetrlLlamaForCausalLM`, `JetrlQwen2ForCausalLM` are vLLM's own model
classes with, after construction (before vLLM loads weights, compiles or captures graphs), these
modules swapped on the instance -- parameter names unchanged, so loading and the weight sync are
vLLM's:

- each decoder layer's ``input_layernorm`` / ``post_attention_layernorm`` (vLLM's fused add + norm):
  the BF16 residual add as transformers does it, then the norm -- ``hf``: transformers' RMSNorm formula
  (`hf_rms_norm`), ``fused``: `jetrl.kernels.rmsnorm_quant`, the trainer's fused producer
  (``model.fuse_producers``), whose Triton kernel has one row configuration for any number of rows, with the
  add in the same kernel (`jetrl.kernels.add_rmsnorm_quant`: the same bits as the add then the norm);
- the MLP's SiLU-and-mul: ``act_fn(gate) * up`` (transformers' activation) or `jetrl.kernels.swiglu_quant`;
- Qwen3's per-head ``q_norm`` / ``k_norm`` and the final ``norm``: `hf_rms_norm`;
- the rotary embedding: transformers' ``apply_rotary_pos_emb`` of transformers' own rotary module's cos/sin
  (same config, rope scaling included) as `jetrl.kernels.rope_pair` (q and k), one kernel on CUDA bit-equal to
  transformers' eager ops, reading a cos/sin table the module computed once for the engine's positions
  (`jetrl.kernels.rope_table`; the rope types whose frequencies follow the sequence length are refused).

Each runs inside an opaque ``jetrl::engine_*`` torch op, so vLLM's torch.compile cannot re-fuse it
and CUDA graphs capture it as is. Attention (vLLM's paged kernels against the trainer's SDPA) and
lm_head are not replaced: they are what still differs, and `jetrl lint --numeric` names attention's
output (the first layer's ``o_proj`` input) as the first drift.

The engine is selected per ``vllm.LLM`` through ``hf_overrides`` (`engine_overrides`): the
architecture name registered by `register_models` (from the ``vllm.general_plugins`` entry point, in
every vLLM process) and ``jetrl_ops`` on the HF config. Stock architectures are never overridden
globally.

FP8 hand-off (``fused``, where the consumer is a ``jetrl_fp8`` Linear: qkv_proj after the input norm,
gate_up_proj after the post-attention norm, down_proj after SiLU-and-mul): the producer's FP8 bytes and
scales, written in the consumer backend's scale layout, travel as the Linear's input (a
`jetrl.rollout.methods.PreQuantized`; vLLM's Linear layers pass their input to the quant method
untouched), and the Linear runs its GEMM on them without quantizing again -- the trainer's fused
producers do the same (`jetrl.linear.attach_quantized`), and the bytes are those the Linear would have
made of the BF16 output (`jetrl.kernels` are bit-exact to `jetrl.quant`).
"""

from __future__ import annotations

import importlib

import torch
from torch import nn

from jetrl.rollout.methods import PreQuantized, keep_producer_values, live_rows

__all__ = [
    "ENGINE_OPS",
    "ARCHITECTURES",
    "engine_overrides",
    "register_models",
    "hf_rms_norm",
    "install_trainer_ops",
]

ENGINE_OPS = ("vllm", "hf", "fused")
"""``vllm``: vLLM's own model. ``hf``: transformers' ops between the Linears (trainer ``model.numerics:
hf``). ``fused``: as ``hf`` with RMSNorm and SwiGLU through jetrl's fused producer kernels (trainer
``model.fuse_producers: true``)."""

ARCHITECTURES = {
    "Qwen3ForCausalLM": ("vllm.model_executor.models.qwen3", "qwen3"),
    "LlamaForCausalLM": ("vllm.model_executor.models.llama", "llama"),
    "Qwen2ForCausalLM": ("vllm.model_executor.models.qwen2", "qwen2"),
}
"""HF architecture -> (vLLM module of its model class, transformers model type)."""

_PREFIX = "Jetrl"
_ROTARY: dict[str, nn.Module] = {}
"""Key -> transformers rotary module, read by ``jetrl::engine_rope`` (a module is not an op argument). The
module is also a submodule of the vLLM model that installed it (``model.jetrl_rotary``), so that its
buffers (``inv_freq``, the cos/sin table ``jetrl_table``) are the model's buffers: vLLM's level-2 sleep
(verl's, between rollouts) discards the weights' memory and restores only the model's own buffers. The
newest model of a key owns the entry (every model of one key computes the same cos/sin)."""


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama/Qwen RMSNorm: ``weight * (x_f32 * rsqrt(mean(x_f32^2) + eps)).to(x.dtype)``
    (`jetrl.kernels.torch_rmsnorm`, the fused kernel's reference)."""
    from jetrl.kernels import torch_rmsnorm

    return torch_rmsnorm(x, weight, eps)[0]


def _summed(x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the rows to normalize ``[M, K]``, the residual stream out) of ``residual + x``, added in BF16 as
    transformers adds (no residual: `x`, copied, since an op's output may not alias its input)."""
    s = x if residual is None else residual + x
    s2 = s.reshape(-1, s.shape[-1]).contiguous()
    return s2, (s2.clone() if residual is None else s2).view(s.shape)


@torch.library.custom_op("jetrl::engine_add_norm", mutates_args=())
def _add_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, fused: bool, name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(s), s) with ``s = residual + x`` (or `x`): `hf_rms_norm`, or `jetrl.kernels.rmsnorm_quant`
    (`jetrl.kernels.add_rmsnorm_quant` with a residual: the add in the same kernel, the same bits)."""
    if fused:
        y, _, _, s = _fused_add_norm(x, residual, weight, eps, "row", name)
        return y, s
    rows, s = _summed(x, residual)
    return hf_rms_norm(rows, weight, eps).view(s.shape), s


def _fused_add_norm(x, residual, weight, eps, scale_layout, name, keep_y=True):
    """(y, q, s, residual + x) through jetrl's fused producer: the add in its kernel where there is a residual.
    With ``keep_y=False`` y is an empty tensor, and on CUDA the kernel quantizes y without writing it (its
    launcher, called directly: the lint records the ops, and then y is kept), its non-finite flag set by the
    step's real rows only (`methods.live_rows`: CUDA-graph padding rows hold stale memory)."""
    from jetrl.kernels import add_rmsnorm_quant, rmsnorm_quant
    from jetrl.kernels.rmsnorm_quant import launch_add_rmsnorm_quant, launch_rmsnorm_quant

    out_name = f"{name}:output"
    bytes_only = not keep_y and x.is_cuda
    k = x.shape[-1]
    if residual is None:
        rows, s = _summed(x, None)
        if bytes_only:
            live = live_rows(rows.shape[0])
            y, q, sc, _ = launch_rmsnorm_quant(rows, weight, eps, scale_layout, out_name, store_y=False, live=live)
        else:
            y, q, sc, _ = rmsnorm_quant(rows, weight, eps, scale_layout=scale_layout, name=out_name)
        return _value(y, x, x.shape, keep_y), q, sc, s
    x2, r2 = x.reshape(-1, k), residual.reshape(-1, k)
    if bytes_only:
        live = live_rows(x2.shape[0])
        y, q, sc, s = launch_add_rmsnorm_quant(x2, r2, weight, eps, scale_layout, out_name, store_y=False, live=live)
    else:
        y, q, sc, s = add_rmsnorm_quant(x2, r2, weight, eps, scale_layout=scale_layout, name=out_name)
    return _value(y, x, x.shape, keep_y), q, sc, s.view(x.shape)


def _value(y: torch.Tensor | None, like: torch.Tensor, shape, keep: bool) -> torch.Tensor:
    """A producer's output in `shape`, or where it is not kept an empty tensor of `like`'s dtype (a custom op
    returns tensors only)."""
    return y.view(shape) if keep else like.new_empty(0)


@_add_norm.register_fake
def _(x, residual, weight, eps, fused, name):
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(
        x, memory_format=torch.contiguous_format
    )


@torch.library.custom_op("jetrl::engine_add_norm_quant", mutates_args=())
def _add_norm_quant(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, scale_layout: str, name: str,
    keep_y: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """`_add_norm` through jetrl's fused producer, keeping its FP8 output: (y, q, s, residual); y empty
    unless `keep_y`."""
    return _fused_add_norm(x, residual, weight, eps, scale_layout, name, keep_y)


@_add_norm_quant.register_fake
def _(x, residual, weight, eps, scale_layout, name, keep_y):
    from jetrl.kernels import rmsnorm_quant

    m = x.numel() // x.shape[-1]
    _, q, sc, _ = rmsnorm_quant(x.new_empty((m, x.shape[-1])), weight, eps, scale_layout=scale_layout, name=name)
    y = torch.empty_like(x, memory_format=torch.contiguous_format) if keep_y else x.new_empty(0)
    return y, q, sc, torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("jetrl::engine_swiglu_quant", mutates_args=())
def _swiglu_quant(
    gate_up: torch.Tensor, scale_layout: str, name: str, keep_h: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_swiglu` through `jetrl.kernels.swiglu_quant`, keeping its FP8 output: (h, q, s); h empty unless
    `keep_h` (on CUDA the kernel then quantizes h without writing it, through its launcher)."""
    from jetrl.kernels import swiglu_quant
    from jetrl.kernels.swiglu_quant import launch_swiglu_quant

    n = gate_up.shape[-1] // 2
    g2 = gate_up.reshape(-1, 2 * n)
    if gate_up.is_cuda and not keep_h:
        live = live_rows(g2.shape[0])
        h, q, sc = launch_swiglu_quant(g2[:, :n], g2[:, n:], scale_layout, name, store_h=False, live=live)
    else:
        h, q, sc = swiglu_quant(g2[:, :n], g2[:, n:], scale_layout=scale_layout, name=name)
    return _value(h, gate_up, (*gate_up.shape[:-1], n), keep_h), q, sc


@_swiglu_quant.register_fake
def _(gate_up, scale_layout, name, keep_h):
    from jetrl.kernels import swiglu_quant

    n = gate_up.shape[-1] // 2
    g = gate_up.new_empty((gate_up.numel() // (2 * n), n))
    _, q, sc = swiglu_quant(g, g, scale_layout=scale_layout, name=name)
    return gate_up.new_empty((*gate_up.shape[:-1], n) if keep_h else (0,)), q, sc


@torch.library.custom_op("jetrl::engine_norm", mutates_args=())
def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`hf_rms_norm` of the last dim (Qwen3's per-head q/k norms)."""
    return hf_rms_norm(x.contiguous(), weight, eps)


@_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("jetrl::engine_swiglu", mutates_args=())
def _swiglu(gate_up: torch.Tensor, act: str, fused: bool, name: str) -> torch.Tensor:
    """``act_fn(gate) * up`` of vLLM's merged ``[.., 2n]`` gate/up output, as transformers computes it."""
    n = gate_up.shape[-1] // 2
    g2 = gate_up.reshape(-1, 2 * n)
    g, u = g2[:, :n], g2[:, n:]
    if fused:
        from jetrl.kernels import swiglu_quant

        h = swiglu_quant(g, u, scale_layout="row", name=name)[0]
    else:
        from transformers.activations import ACT2FN

        h = ACT2FN[act](g) * u
    return h.reshape(*gate_up.shape[:-1], n)


@_swiglu.register_fake
def _(gate_up, act, fused, name):
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


@torch.library.custom_op("jetrl::engine_rope", mutates_args=())
def _rope(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, head_dim: int, key: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' rotary embedding (``apply_rotary_pos_emb`` of the registered module's cos/sin, through
    `jetrl.kernels.rope_pair`, q and k in one launch, and the module's table) of vLLM's flat
    ``[T, heads * head_dim]`` q and k at `positions`."""
    from jetrl.kernels import rope_pair

    table = _ROTARY[key].jetrl_table
    t = positions.numel()
    if q.shape[0] != t or k.shape[0] != t:
        raise ValueError(f"jetrl::engine_rope: {t} positions for q {tuple(q.shape)} and k {tuple(k.shape)}")
    q2, k2 = rope_pair(q.reshape(t, -1), k.reshape(t, -1), table, positions.reshape(t), head_dim, name=key)
    return q2.view(q.shape), k2.view(k.shape)


@_rope.register_fake
def _(positions, q, k, head_dim, key):
    return torch.empty_like(q, memory_format=torch.contiguous_format), torch.empty_like(
        k, memory_format=torch.contiguous_format
    )


def _eps(norm: nn.Module) -> float:
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if eps is None or not isinstance(getattr(norm, "weight", None), torch.Tensor):
        raise TypeError(f"{type(norm).__name__} is not an RMSNorm with a weight and an epsilon")
    return float(eps)


class _ResidualNorm(nn.Module):
    """vLLM's ``norm(x)`` / ``norm(x, residual) -> (y, residual)`` call, transformers' numerics. With
    `handoff` (the consumer's scale layout) the output is a `PreQuantized` for a ``jetrl_fp8`` Linear."""

    def __init__(self, norm: nn.Module, *, fused: bool, name: str, handoff: str | None = None) -> None:
        super().__init__()
        self.variance_epsilon = _eps(norm)
        self.weight = norm.weight  # the same Parameter: loading and the sync write into it
        self.fused, self.name, self.handoff = fused, name, handoff

    def forward(self, x, residual=None):
        if self.handoff is not None:
            keep = keep_producer_values()
            y, q, sc, s = _add_norm_quant(
                x, residual, self.weight, self.variance_epsilon, self.handoff, self.name, keep
            )
            y = PreQuantized(q, sc, "jetrl::rmsnorm_quant", x.shape, x.dtype, y if keep else None)
        else:
            y, s = _add_norm(x, residual, self.weight, self.variance_epsilon, self.fused, self.name)
        return y if residual is None else (y, s)


class _HeadNorm(nn.Module):
    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.variance_epsilon = _eps(norm)
        self.weight = norm.weight

    def forward(self, x):
        return _norm(x, self.weight, self.variance_epsilon)


class _SwiGLU(nn.Module):
    def __init__(self, act: str, *, fused: bool, name: str, handoff: str | None = None) -> None:
        super().__init__()
        if act not in ("silu", "swish"):
            raise ValueError(f"{name}: hidden_act={act!r}; the trainer-matched engine knows SiLU MLPs only")
        self.act, self.fused, self.name, self.handoff = act, fused, name, handoff

    def forward(self, x):
        if self.handoff is not None:
            keep = keep_producer_values()
            h, q, sc = _swiglu_quant(x, self.handoff, self.name, keep)
            shape = (*x.shape[:-1], x.shape[-1] // 2)
            return PreQuantized(q, sc, "jetrl::swiglu_quant", shape, x.dtype, h if keep else None)
        return _swiglu(x, self.act, self.fused, self.name)


class _Rope(nn.Module):
    def __init__(self, key: str, head_dim: int) -> None:
        super().__init__()
        self.key, self.head_dim = key, head_dim

    def forward(self, positions, q, k):
        return _rope(positions, q, k, self.head_dim, self.key)


def _hf_rotary(hf_config, model_type: str, device: torch.device, positions: int, dtype: torch.dtype) -> nn.Module:
    """transformers' rotary module of `model_type` for `hf_config`, built on the CPU as transformers
    builds it at load, then moved to `device`, with its cos/sin for `positions` positions in `dtype` as the
    buffer ``jetrl_table`` (`jetrl.kernels.rope_table`)."""
    from jetrl.kernels import rope_table

    modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    cls = next(getattr(modeling, n) for n in dir(modeling) if n.endswith("RotaryEmbedding") and n[0].isupper())
    with torch.device("cpu"):
        rot = cls(config=hf_config)
    rot = rot.to(device)
    table = rope_table(rot, positions, dtype, name=f"{model_type} rotary embedding (engine_ops hf/fused)")
    rot.register_buffer("jetrl_table", table, persistent=False)
    return rot


def install_trainer_ops(
    model: nn.Module,
    hf_config,
    ops: str,
    model_type: str,
    *,
    max_positions: int | None = None,
    dtype: torch.dtype | None = None,
) -> list[str]:
    """Swap the ops between the Linears of a constructed vLLM decoder (`model` = its ``.model``) for the
    trainer's (module docstring); returns the replaced module names. `max_positions` (the engine's
    max_model_len; default the config's max_position_embeddings) and `dtype` (the engine's; default the
    default dtype, which vLLM sets while it builds a model) size the RoPE table. Raises naming what is
    missing."""
    if ops not in ("hf", "fused"):
        raise ValueError(f"install_trainer_ops: ops={ops!r}; choose 'hf' or 'fused'")
    fused = ops == "fused"

    def handoff(linear) -> str | None:
        """The scale layout a fused producer writes for `linear`, when it is a ``jetrl_fp8`` Linear (its quant
        method, `jetrl.rollout.vllm_plugin.JetFP8LinearMethod`, says ``input_scale_layout``; the plugin
        imports this module, so it is asked, not imported)."""
        return getattr(getattr(linear, "quant_method", None), "input_scale_layout", None) if fused else None

    layers = getattr(model, "layers", None)
    if layers is None or not hasattr(model, "norm"):
        raise ValueError(f"engine_ops={ops!r}: {type(model).__name__} has no layers/norm")
    device = next(model.parameters()).device
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    positions = int(max_positions or hf_config.max_position_embeddings)
    dtype = dtype or torch.get_default_dtype()
    # a key fixed by what the module computes: vLLM's compile cache may reuse a graph across processes
    rope = {a: getattr(hf_config, a, None) for a in ("rope_parameters", "rope_scaling", "rope_theta")}
    rot_key = f"{model_type}:{head_dim}:{hf_config.max_position_embeddings}:{rope}:{positions}:{dtype}:{device}"
    done: list[str] = []
    for i, layer in enumerate(layers):
        if not hasattr(layer, "self_attn"):  # a pipeline stage's placeholder
            continue
        name = f"model.layers.{i}"
        attn, mlp = layer.self_attn, layer.mlp
        missing = [
            n
            for n, obj in (("input_layernorm", layer), ("post_attention_layernorm", layer), ("rotary_emb", attn))
            if not hasattr(obj, n)
        ] + ([] if hasattr(mlp, "act_fn") else ["mlp.act_fn"])
        if missing:
            raise ValueError(f"engine_ops={ops!r}: {name} lacks {missing}")
        consumers = {"input_layernorm": "qkv_proj", "post_attention_layernorm": "gate_up_proj"}
        for norm_name, linear in consumers.items():
            consumer = getattr(attn if linear == "qkv_proj" else mlp, linear, None)
            norm = _ResidualNorm(
                getattr(layer, norm_name), fused=fused, name=f"{name}.{norm_name}", handoff=handoff(consumer)
            )
            setattr(layer, norm_name, norm)
            done.append(f"{name}.{norm_name}")
        for head_norm in ("q_norm", "k_norm"):
            if hasattr(attn, head_norm):
                setattr(attn, head_norm, _HeadNorm(getattr(attn, head_norm)))
                done.append(f"{name}.self_attn.{head_norm}")
        attn.rotary_emb = _Rope(rot_key, head_dim)
        down = getattr(mlp, "down_proj", None)
        mlp.act_fn = _SwiGLU(
            hf_config.hidden_act, fused=fused, name=f"{name}.mlp.down_proj:input", handoff=handoff(down)
        )
        done += [f"{name}.self_attn.rotary_emb", f"{name}.mlp.act_fn"]
    model.jetrl_rotary = _ROTARY[rot_key] = _hf_rotary(hf_config, model_type, device, positions, dtype)
    model.norm = _ResidualNorm(model.norm, fused=False, name="model.norm")
    done.append("model.norm")
    return done


def _model_class(arch: str):
    module, model_type = ARCHITECTURES[arch]
    base = getattr(importlib.import_module(module), arch)

    def __init__(self, *, vllm_config, prefix: str = ""):
        base.__init__(self, vllm_config=vllm_config, prefix=prefix)
        cfg = vllm_config.model_config.hf_config
        ops = getattr(cfg, "jetrl_ops", None)
        if ops not in ("hf", "fused"):
            raise ValueError(f"{_PREFIX}{arch}: hf_config.jetrl_ops={ops!r}; start it with engine_overrides()")
        self.jetrl_ops = ops
        mc = vllm_config.model_config
        self.jetrl_replaced = install_trainer_ops(
            self.model, cfg, ops, model_type, max_positions=mc.max_model_len, dtype=mc.dtype
        )

    return type(f"{_PREFIX}{arch}", (base,), {"__init__": __init__, "__module__": __name__})


def __getattr__(name: str):
    # vLLM's registry imports "jetrl.rollout.vllm_model:JetrlQwen3ForCausalLM" lazily, in the worker
    if name.startswith(_PREFIX) and name[len(_PREFIX) :] in ARCHITECTURES:
        cls = _model_class(name[len(_PREFIX) :])
        globals()[name] = cls
        return cls
    raise AttributeError(name)


def register_models() -> None:
    """Register the ``Jetrl<Arch>`` classes with vLLM's ModelRegistry, lazily (no vLLM model module is
    imported here); idempotent."""
    from vllm import ModelRegistry

    known = set(ModelRegistry.get_supported_archs())
    for arch in ARCHITECTURES:
        if f"{_PREFIX}{arch}" not in known:
            ModelRegistry.register_model(f"{_PREFIX}{arch}", f"{__name__}:{_PREFIX}{arch}")


def engine_overrides(architectures: list[str] | None, ops: str) -> dict:
    """``hf_overrides`` entries that start the trainer-matched model for a checkpoint of `architectures`
    (its config's list); {} for ``ops='vllm'``. Raises naming the architecture that has no such class."""
    if ops not in ENGINE_OPS:
        raise ValueError(f"engine_ops={ops!r}: choose one of {ENGINE_OPS}")
    if ops == "vllm":
        return {}
    archs = list(architectures or [])
    if len(archs) != 1 or archs[0] not in ARCHITECTURES:
        raise ValueError(
            f"engine_ops={ops!r}: the checkpoint's architectures {archs} have no trainer-matched vLLM class; "
            f"known: {sorted(ARCHITECTURES)} (use engine_ops='vllm')"
        )
    return {"architectures": [f"{_PREFIX}{archs[0]}"], "jetrl_ops": ops}
