"""`JetFP8Linear`: an `nn.Linear` whose fprop, dgrad and wgrad run as block-scaled FP8 GEMMs.

The math (``../shared/NUMERICS.md`` sections 1 and 4), for X ``[M, K]`` (tokens x in_features),
W ``[N, K]`` and dY ``[M, N]``::

    fprop  Y  = Q1x128(X) @ Q128x128(W)^T      -> bf16 [M, N]  (jetrl.gemm.fprop, THE fprop)
    dgrad  dX = Q1x128(dY) @ Q128x128(W)        -> bf16 [M, K]  (W^T bytes: 128x128 is transpose invariant)
    wgrad  dW = Q128x1(dY)^T @ Q128x1(X)        -> fp32 [N, K]  (1x128 along the token axis, fp32 accumulate)

What is stored, and when it is computed:

- W is quantized 128x128 once per optimizer step, together with its transposed bytes (for dgrad),
  and cached on the module. The cache key is the weight's version counter, data pointer, shape and
  dtype: every in-place update (``optimizer.step()``, ``copy_``) bumps the version and invalidates
  it. Writes through ``weight.data`` bypass the version counter; call `invalidate_fp8_caches(model)`
  after them, or `invalidate_on_step(optimizer, model)` once to do it after every step.
  Under FSDP (verl's engine) the weight a Linear sees is a fresh all-gather each forward, so the cache would
  only hold a full-size FP8 copy of every layer on every rank (the sharding undone) and keep it past writes
  FSDP makes into its shards (a checkpoint load): `set_fp8_weight_caching(model, False)` turns it off. Each
  forward then quantizes the gathered weight for fprop only, and the backward quantizes the weight it finds
  on the module then (FSDP gathers it again for the backward, the same values) for dgrad, so no FP8 weight
  is held between a layer's forward and its backward either; the bytes are those of the cached path.
- X is quantized 1x128 in the forward. When ``recipe.save_activations_fp8`` (default), what is saved
  for backward is wgrad's operand itself, X^T quantized 128x1 (along tokens) from the BF16 X, fp8
  bytes + scales (half the bytes of BF16), made in the forward by `transpose_quantize`; so wgrad uses
  exactly the spec's 128x1 operand (no dequantize-requantize round trip, see `transpose_requantize`
  for what that would cost) and the backward reads no X. Otherwise the BF16 X is saved and quantized
  128x1 in the backward.
- dY arrives in BF16 (gradients between ops stay BF16); it is quantized 1x128 for dgrad and 128x1
  for wgrad. dX leaves in X's dtype. dW is accumulated in fp32: into
  ``weight.main_grad`` in place when that attribute exists (Megatron/verl style; ``weight.grad`` then
  stays None), else returned as the weight's gradient in the weight's dtype.

Pre-quantized inputs. A fused producer (RMSNorm + quantize, SwiGLU + quantize) computes the 1x128
bytes of its output anyway; it hands them over with ``attach_quantized(y, q, s)``, which stores a
`QuantizedActivation` on the output tensor ``y``. A JetFP8Linear receiving exactly that tensor
(same object, same data pointer, same version counter, matching shape) uses the bytes instead of
quantizing again; any in-place change of ``y`` or a different tensor makes it quantize afresh. The
three projections reading one normed hidden state (q/k/v, gate/up) then share one quantization, and
one saved wgrad operand (`transpose_quantize` of ``y``, computed by the first of them and attached
to ``y`` the same way). The bytes are the same either way (the producer's quantizer is the reference's).

The two fused producers are here too: `JetRMSNormQuant` (replaces an HF RMSNorm whose output feeds
FP8 Linears; `jetrl.kernels.rmsnorm_quant`) and `JetSwiGLUMLP` (replaces an HF gate/up/down MLP with
SiLU; `jetrl.kernels.swiglu_quant` between up/gate and down). Both keep HF numerics and parameter
names; `jetrl.convert.convert_model(..., fuse=True)` installs them.

Host cost. In eager CUDA training the quantizers are called through `jetrl.gemm.quantize`, which
launches the Triton kernels directly instead of through the ``jetrl::`` custom ops (~0.2 ms of
dispatcher time each, more than most of the kernels take); the ops stay in use wherever something
traces or intercepts (torch.compile, FakeTensor, the lint's capture): see `eager_fast_path` there.
The backward reads the saved X scales in whatever layout the backend asked for (no copy).

`fp8_param` mode (`jetrl.fp8_param`): the module's ``weight`` holds the fp8 bytes themselves (with a
``weight_scale_inv`` buffer) and wgrad goes to an fp32 master held by the optimizer path; see there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from jetrl.gemm import GemmBackend, fprop, get_backend
from jetrl.gemm import quantize as gq
from jetrl.gemm.quantize import quantize_1x128, quantize_128x128, transpose_quantize
from jetrl.recipe import Recipe, RecipeError

__all__ = [
    "JetFP8Linear",
    "QuantizedActivation",
    "attach_quantized",
    "quantized_of",
    "invalidate_fp8_caches",
    "set_fp8_weight_caching",
    "invalidate_on_step",
    "refresh_fp8_weights_",
    "JetRMSNormQuant",
    "JetSwiGLUMLP",
]

_ATTR = "_jetrl_fp8_activation"
_ATTR_T = "_jetrl_fp8_activation_t"  # its wgrad operand (quantize_128x1), attached on first use


@dataclass(frozen=True)
class QuantizedActivation:
    """A quantization of a tensor (its 1x128 bytes, or its 128x1 wgrad operand), valid while the
    tensor is unchanged."""

    q: torch.Tensor
    """e4m3 [M, K] (M = numel / K); for the wgrad operand [K, M]."""
    s: torch.Tensor
    """fp32 [M, ceil(K/128)], row or DeepGEMM layout; for the wgrad operand [K, ceil(M/128)]."""
    data_ptr: int
    version: int
    shape: tuple[int, ...]

    @classmethod
    def of(cls, x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> QuantizedActivation:
        """(q, s) recorded as a quantization of `x` as it is now."""
        return cls(q, s, x.data_ptr(), x._version, tuple(x.shape))

    def describes(self, x: torch.Tensor) -> bool:
        """Whether `x` is still the tensor these bytes were made from (same storage, version, shape)."""
        return self.data_ptr == x.data_ptr() and self.version == x._version and self.shape == tuple(x.shape)


def attach_quantized(y: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Record that ``(q, s) = quantize_1x128(y.reshape(-1, K))``; returns `y` (for chaining)."""
    k = y.shape[-1]
    if tuple(q.shape) != (y.numel() // max(k, 1), k):
        raise ValueError(f"attach_quantized: bytes {tuple(q.shape)} do not match tensor {tuple(y.shape)}")
    setattr(y, _ATTR, QuantizedActivation.of(y, q, s))
    return y


def quantized_of(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The (q, s) attached to `x` if they still describe it, else None."""
    qa = getattr(x, _ATTR, None)
    if qa is None or not qa.describes(x):
        return None
    return qa.q, qa.s


class _FP8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, grad_weight, bias, module, pre, grad_mode):
        be = module.backend
        k = x.shape[-1]
        x2 = x.reshape(-1, k)
        xname = f"{module.layer_name}:input"
        ctx.fp8_saved = module.recipe.save_activations_fp8
        # needs_input_grad follows requires_grad even without grad mode, where no backward can follow (the
        # old-log-prob and ref passes): nothing is made for one then
        wgrad = grad_mode and ctx.needs_input_grad[1]
        xq, xs = pre if pre is not None else quantize_1x128(x2, scale_layout=be.scale_layout, name=xname)
        saved: tuple = ()
        if wgrad and not ctx.fp8_saved:
            saved = (x2,)
        elif wgrad:  # the wgrad operand (X^T quantized along tokens) is saved instead of X
            saved = _wgrad_operand_of(x, x2, xname) if pre is not None else transpose_quantize(x2, name=xname)
        dgrad = grad_mode and ctx.needs_input_grad[0]
        # without the cache (FSDP) dgrad's transposed bytes are made in the backward from the weight FSDP gathers
        # for it again, so no FP8 copy of the weight waits here between the forward and the backward
        ctx.requantize_w = dgrad and not module.cache_weight
        wq, ws, wq_t, ws_t = module._fp8_operands(with_transpose=dgrad and not ctx.requantize_w)
        y = fprop(xq, xs, wq, ws, bias, backend=be, out_dtype=x.dtype, name=xname)
        ctx.module = module
        ctx.grad_weight = grad_weight
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.save_for_backward(*saved)
        ctx.w_t = (wq_t, ws_t)
        return y.reshape(*x.shape[:-1], wq.shape[0])

    @staticmethod
    def backward(ctx, dy):
        module = ctx.module
        be = module.backend
        nm = module.layer_name
        n = dy.shape[-1]
        dy2 = dy.reshape(-1, n)
        if dy2.dtype != ctx.x_dtype:
            dy2 = dy2.to(ctx.x_dtype)
        dx = dw = db = None
        dgrad, wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dname = f"{nm}:grad_output"
        if dgrad:
            dyq, dys = quantize_1x128(dy2, scale_layout=be.scale_layout, name=dname)
            wq_t, ws_t = module._fp8_operands(with_transpose=True)[2:] if ctx.requantize_w else ctx.w_t
            # Shapes: [M, N] @ [K, N]^T -> [M, K]
            dx = be.gemm(dyq, dys, wq_t, ws_t, role="dgrad", out_dtype=ctx.x_dtype).reshape(ctx.x_shape)
        if wgrad:
            dyt_q, dyt_s = transpose_quantize(dy2, name=dname)
            if ctx.fp8_saved:
                xt_q, xt_s = ctx.saved_tensors
            else:
                (x2,) = ctx.saved_tensors
                xt_q, xt_s = transpose_quantize(x2, name=f"{nm}:input")
            target = ctx.grad_weight
            main_grad = getattr(target, "main_grad", None)
            if main_grad is not None:
                # Shapes: [N, M] @ [K, M]^T -> [N, K], accumulated in fp32 in place
                be.gemm_accumulate_(dyt_q, dyt_s, xt_q, xt_s, main_grad)
            else:
                # Shapes: [N, M] @ [K, M]^T -> [N, K]
                dw = be.gemm(dyt_q, dyt_s, xt_q, xt_s, role="wgrad", out_dtype=torch.float32)
                dw = dw.to(target.dtype)
        if ctx.needs_input_grad[2]:
            db = dy2.float().sum(0).to(ctx.bias_dtype)
        ctx.w_t = None
        return dx, dw, db, None, None, None


def _wgrad_operand_of(x: torch.Tensor, x2: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """X^T quantized along tokens for a pre-quantized input: computed once per tensor and attached to
    it, so the Linears sharing one fused producer's output (q/k/v, gate/up) share one copy too."""
    qt = getattr(x, _ATTR_T, None)
    if qt is not None and qt.describes(x):
        return qt.q, qt.s
    q_t, s_t = transpose_quantize(x2, name=name)
    setattr(x, _ATTR_T, QuantizedActivation.of(x, q_t, s_t))
    return q_t, s_t


def _check_supported_training_specs(recipe: Recipe, layer_name: str) -> None:
    """The kernels and GEMMs implement the jetrl-unified training specs only; any other QuantSpec in
    a recipe's training fields is refused here rather than silently trained with the default."""
    truth = Recipe.from_name("jetrl-unified")
    for field in ("train_activation", "train_weight", "train_grad_output", "train_wgrad"):
        got, want = getattr(recipe, field), getattr(truth, field)
        if got != want:
            raise RecipeError(
                f"{layer_name}: recipe {recipe.name!r} sets {field}={got.label() if got else None}, but the FP8 "
                f"Linear implements only {want.label()} for it; use the jetrl-unified spec for training"
            )


class JetFP8Linear(nn.Linear):
    """A drop-in `nn.Linear` (same ``weight``/``bias`` parameters and names) computing in block FP8.

    `backend` is a `jetrl.gemm` backend name or instance; `recipe` must train in FP8; `layer_name`
    (e.g. "model.layers.3.mlp.down_proj") names the layer in errors and reports.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
        *,
        recipe: Recipe | str = "jetrl-unified",
        backend: str | GemmBackend = "auto",
        layer_name: str = "",
    ) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self._setup(recipe, backend, layer_name)

    def _setup(self, recipe, backend, layer_name) -> None:
        recipe = Recipe.from_name(recipe) if isinstance(recipe, str) else recipe
        if not recipe.train_fp8:
            raise RecipeError(f"{layer_name or 'JetFP8Linear'}: recipe {recipe.name!r} does not train in FP8")
        _check_supported_training_specs(recipe, layer_name or "JetFP8Linear")
        self.recipe = recipe
        self.backend = get_backend(backend)
        self.layer_name = layer_name or "JetFP8Linear"
        reason = self.backend.check_linear_shape(self.out_features, self.in_features)
        if reason:
            raise ValueError(f"{self.layer_name}: {reason}")
        self._cache: tuple | None = None
        self.cache_weight = True
        """Keep the quantized weight until the weight changes (False: quantize it in every forward and again in
        the backward; `set_fp8_weight_caching`)."""
        self._master: nn.Parameter | None = None  # set by jetrl.fp8_param
        self.weight_quantizations = 0
        """How many times the weight has been quantized (tests check: once per optimizer step with the cache, once
        per forward and backward without it)."""

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, *, recipe: Recipe | str, backend: str | GemmBackend = "auto", layer_name: str = ""
    ) -> JetFP8Linear:
        """Wrap an existing Linear, sharing its Parameter objects (an optimizer built before the
        conversion keeps working; names are unchanged)."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self._setup(recipe, backend, layer_name)
        return self

    # -- weights ---------------------------------------------------------------------------------
    def _cache_key(self) -> tuple:
        w = self.weight
        return (w._version, w.data_ptr(), tuple(w.shape), w.dtype, w.device)

    def _fp8_operands(self, with_transpose: bool):
        """(q [N,K], s, q_t [K,N] or None, s_t or None) for the current weight."""
        key = self._cache_key()
        if self._cache is not None and self._cache[0] == key:
            _, q, s, q_t, s_t = self._cache
            if with_transpose and q_t is None:
                q_t, s_t = q.t().contiguous(), s.t().contiguous()  # 128x128 is transpose invariant
                self._cache = (key, q, s, q_t, s_t)
            return q, s, q_t, s_t
        if self._master is not None:  # fp8_param: the bytes are the parameter itself
            q, s = self.weight, self.weight_scale_inv
            q_t, s_t = (q.t().contiguous(), s.t().contiguous()) if with_transpose else (None, None)
        else:
            wname = f"{self.layer_name}.weight"
            if with_transpose:
                q, s, q_t, s_t = quantize_128x128(self.weight.detach(), with_transpose=True, name=wname)
            else:
                (q, s), q_t, s_t = quantize_128x128(self.weight.detach(), name=wname), None, None
            self.weight_quantizations += 1
        if self.cache_weight:
            self._cache = (key, q, s, q_t, s_t)
        return q, s, q_t, s_t

    def fp8_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(q e4m3 [N, K], s fp32 [ceil(N/128), ceil(K/128)]): the weight as fprop and the rollout see it."""
        q, s, _, _ = self._fp8_operands(with_transpose=False)
        return q, s

    def invalidate_fp8_weight(self) -> None:
        """Drop the cached fp8 weight (needed only after writes that bypass the version counter)."""
        self._cache = None

    @torch.no_grad()
    def refresh_fp8_weight_(self) -> None:
        """Re-quantize the current weight INTO the cached tensors (same objects and addresses; the transposed
        copy too), so that CUDA graphs captured with them read the new bytes on replay. Makes the cache
        (with the transpose) when there is none; nothing to do when it is current."""
        if not self.cache_weight:
            raise RuntimeError(f"{self.layer_name}: refresh_fp8_weight_ needs the FP8 weight cache, which is off")
        if self._cache is None:
            self._fp8_operands(with_transpose=True)
            return
        key, q, s, q_t, s_t = self._cache
        if key == self._cache_key():
            return
        if self._master is not None:  # fp8_param: the bytes are the parameter, only the transpose is a copy
            nq, ns = self.weight, self.weight_scale_inv
            new = (nq, ns, nq.t(), ns.t())
        else:
            name = f"{self.layer_name}.weight"
            new = quantize_128x128(self.weight.detach(), with_transpose=True, name=name)
            self.weight_quantizations += 1
        for dst, src in zip((q, s, q_t, s_t), new, strict=True):
            if dst is not None and dst is not src:
                dst.copy_(src)
        self._cache = (self._cache_key(), q, s, q_t, s_t)

    # -- forward ---------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"{self.layer_name}: input has {x.shape[-1]} features, expected {self.in_features}")
        if x.device != self.weight.device:
            raise ValueError(f"{self.layer_name}: input is on {x.device} but the weight is on {self.weight.device}")
        pre = quantized_of(x)
        grad_weight = self._master if self._master is not None else self.weight
        return _FP8LinearFn.apply(x, grad_weight, self.bias, self, pre, torch.is_grad_enabled())

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"fp8={self.recipe.name}, backend={self.backend.name}" + (", fp8_param" if self._master is not None else "")
        )


def _each_fp8_linear(model: nn.Module, method: str) -> int:
    n = 0
    for m in model.modules():
        if isinstance(m, JetFP8Linear):
            getattr(m, method)()
            n += 1
    return n


def invalidate_fp8_caches(model: nn.Module) -> int:
    """Drop every JetFP8Linear's cached fp8 weight; returns how many modules were reset."""
    return _each_fp8_linear(model, "invalidate_fp8_weight")


def set_fp8_weight_caching(model: nn.Module, enabled: bool) -> int:
    """Turn every JetFP8Linear's FP8 weight cache on or off (off drops what is cached; see the module docstring
    for when: FSDP); returns how many modules were set."""
    n = 0
    for m in model.modules():
        if isinstance(m, JetFP8Linear):
            m.cache_weight = enabled
            m._cache = None
            n += 1
    return n


def refresh_fp8_weights_(model: nn.Module) -> int:
    """`JetFP8Linear.refresh_fp8_weight_` on every FP8 Linear of `model` (after an optimizer step, before CUDA
    graphs that read the cached weights replay); returns how many modules were refreshed."""
    return _each_fp8_linear(model, "refresh_fp8_weight_")


def invalidate_on_step(optimizer: torch.optim.Optimizer, model: nn.Module):
    """Invalidate the model's fp8 weight caches after every ``optimizer.step()`` (belt and braces for
    optimizers that write through ``.data``). Returns the hook handle."""
    return optimizer.register_step_post_hook(lambda *_: invalidate_fp8_caches(model))


def _scale_layout_of(linears) -> str:
    for lin in linears:
        if isinstance(lin, JetFP8Linear):
            return lin.backend.scale_layout
    return "row"


class _RMSNormQuantFn(torch.autograd.Function):
    """Eager fast path of ``jetrl::rmsnorm_quant`` (see `jetrl.gemm.quantize.eager_fast_path`): the
    launchers its CUDA kernel registration runs, and the backward its registered autograd runs."""

    @staticmethod
    def forward(ctx, x, weight, eps, scale_layout, name):
        y, q, s, rstd = gq.launcher("rmsnorm_quant", "launch_rmsnorm_quant")(x, weight, eps, scale_layout, name)
        ctx.save_for_backward(x, weight, rstd)
        ctx.mark_non_differentiable(q, s, rstd)
        return y, q, s, rstd

    @staticmethod
    def backward(ctx, dy, dq, ds, drstd):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = gq.launcher("rmsnorm_quant", "launch_rmsnorm_backward")(dy.contiguous(), x, weight, rstd)
        return dx, dw, None, None, None


class _SwiGLUQuantFn(torch.autograd.Function):
    """Eager fast path of ``jetrl::swiglu_quant``, as `_RMSNormQuantFn`."""

    @staticmethod
    def forward(ctx, gate, up, scale_layout, name):
        h, q, s = gq.launcher("swiglu_quant", "launch_swiglu_quant")(gate, up, scale_layout, name)
        ctx.save_for_backward(gate, up)
        ctx.mark_non_differentiable(q, s)
        return h, q, s

    @staticmethod
    def backward(ctx, dh, dq, ds):
        gate, up = ctx.saved_tensors
        dg, du = gq.launcher("swiglu_quant", "launch_swiglu_backward")(dh.contiguous(), gate, up)
        return dg, du, None, None


class JetRMSNormQuant(nn.Module):
    """HF Llama/Qwen RMSNorm (``weight * (x_f32 * rsqrt(mean(x_f32^2) + eps)).to(x.dtype)``) fused with
    the 1x128 quantization of its output, which it attaches to the output for the next JetFP8Linears.
    Keeps the ``weight`` Parameter (same object) of the norm it replaces."""

    def __init__(self, norm: nn.Module, *, scale_layout: str = "row", layer_name: str = "") -> None:
        super().__init__()
        eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
        if eps is None or not isinstance(getattr(norm, "weight", None), nn.Parameter):
            raise TypeError(f"{layer_name}: {type(norm).__name__} is not an HF RMSNorm (needs weight and eps)")
        self.weight = norm.weight
        self.variance_epsilon = float(eps)
        self.scale_layout = scale_layout
        self.layer_name = layer_name or "rmsnorm"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from jetrl.kernels import rmsnorm_quant

        if self.weight.dtype != x.dtype:
            raise TypeError(
                f"{self.layer_name}: fused RMSNorm needs weight dtype == input dtype (HF would promote "
                f"{self.weight.dtype} x {x.dtype}); convert without fuse=True for mixed dtypes"
            )
        k = x.shape[-1]
        x2 = x.reshape(-1, k).contiguous()
        w, eps, layout, name = self.weight, self.variance_epsilon, self.scale_layout, f"{self.layer_name}:output"
        if gq.eager_fast_path(x2) and gq.eager_fast_path(w):
            y, q, s, _ = _RMSNormQuantFn.apply(x2, w, eps, layout, name)
        else:
            y, q, s, _ = rmsnorm_quant(x2, w, eps, scale_layout=layout, name=name)
        return attach_quantized(y.view(x.shape), q, s)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, fused 1x128 quantize"


class JetSwiGLUMLP(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))`` with the product and its 1x128 quantization fused
    (`jetrl.kernels.swiglu_quant`); the bytes go to down_proj. Holds the MLP's own gate_proj, up_proj
    and down_proj modules under the same names."""

    def __init__(self, mlp: nn.Module, *, layer_name: str = "") -> None:
        super().__init__()
        act = getattr(mlp, "act_fn", None)
        if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")) or not (
            isinstance(act, nn.SiLU) or "silu" in type(act).__name__.lower()
        ):
            raise TypeError(f"{layer_name}: {type(mlp).__name__} is not a SiLU gate/up/down MLP")
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self.layer_name = layer_name or "mlp"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from jetrl.kernels import swiglu_quant

        g, u = self.gate_proj(x), self.up_proj(x)
        n = g.shape[-1]
        g2, u2 = g.reshape(-1, n), u.reshape(-1, n)
        layout, name = _scale_layout_of([self.down_proj]), f"{self.layer_name}.down_proj:input"
        if gq.eager_fast_path(g2) and gq.eager_fast_path(u2):
            h, q, s = _SwiGLUQuantFn.apply(g2, u2, layout, name)
        else:
            h, q, s = swiglu_quant(g2, u2, scale_layout=layout, name=name)
        return self.down_proj(attach_quantized(h.view(g.shape), q, s))
