"""The trainer's micro-batches on CUDA graphs (``algo.cuda_graphs``, issue 19): the update pass's forward +
backward, and the old-log-prob pass's forward.

Why: every FP8 Linear's forward + backward costs 1.3-1.8 ms of host time in eager mode (Triton launches,
DeepGEMM calls, autograd; ``scripts/results/host-nvidia-h200.json``), more than its GPU time at RL micro-batch
sizes, so the FP8 training phase is host-bound. A replayed CUDA graph issues the whole model's kernels at once.

How: `GraphedLogprobs` keeps, per shape bucket, one graph pair (forward, and a backward that adds every
parameter's gradient to its ``main_grad``: `_GradGraph`) and one no-grad forward graph (log-probs and
entropies). A micro-batch ``[rows, width]`` is padded on the right to the bucket ``[R, W]``: ``W`` the narrowest
`bucket_widths` >= width (powers of two from `MIN_WIDTH`, and the engine's context length rounded up to 64 as
the top: with power-of-two buckets only, 512-token responses after a 16-token prompt ran in 1024-wide buckets,
and BF16's update got slower on graphs than eager), ``R`` the micro-batch size, or with a token budget the most
rows a micro-batch of that bucket can have (``budget // (previous width + 1)``, capped by the micro-batch size;
the narrowest bucket takes the micro-batch size). Padding columns have attention mask 0; a padding row attends
to its first token only, so that no batch row is fully masked: on the H200 the GPU test's `bf16` q/k/v wgrads
came out all NaN, eager and graphed alike, for a bucket with a fully masked row (finite on CPU; the likely
source is CUDA SDPA's backward over a row with no key to attend to, which spreads NaN into every wgrad although
the row's log-probs are cut off; with this padding the GPU test passes for both recipes). The log-probs of
padding rows and columns are cut off before the loss, so their gradient is 0; they do take part in the 128-token
blocks of the wgrad operands, as the padding of an eager micro-batch does. Every bucket is captured once, before
training (`capture_all`; its warm-up iterations run with a zero output gradient, and the trainer zeroes the
optimizer's gradients after).

Memory: all graphs share one graph memory pool, so they hold about the largest bucket's activations, not their
sum, and no gradient buffers (with torch's `make_graphed_callables` each graph kept a BF16 gradient of every
parameter: at 8 Llama-8B layers the BF16 recipe's 7 buckets ran out of memory beside vLLM). That is safe for how
the trainer replays them: a bucket's backward always follows its own forward before any other graph runs (a
later capture may reuse what an earlier one freed, never what a graph keeps between its forward and backward),
and the log-probs a forward returns are used up (loss, statistics, the copy into the batch's old log-probs)
before the next replay overwrites them.

What replay reads: the captured tensors. The inputs are copied into the graph's static input buffers; the
BF16 parameters are updated in place by the optimizer (same storage); the FP8 weight caches must be
updated in place too, so after every optimizer step the trainer calls `jetrl.linear.refresh_fp8_weights_`
(a re-quantization into the cached tensors, once per step as in eager mode). Every parameter's gradient
is added to its fp32 ``main_grad`` inside the backward graph: an FP8 Linear's wgrad by the Linear, the
others' as `MixedPrecisionAdamW`'s accumulation hook does in eager mode.

Equality: a graph replays the kernels eager mode launches for the same padded shapes, so the graphed and
the eager log-probs and gradients of a padded micro-batch are equal bit for bit (GPU test
``tests/train/test_cuda_graphs.py``). The default on CUDA (``algo.cuda_graphs: auto`` with numerics 'hf');
eager mode stays available (``false``) and is the path on CPU.
"""

from __future__ import annotations

import torch
from torch import nn

from .policy import TokenBatch, forward_logprobs

__all__ = ["MIN_WIDTH", "GraphedLogprobs", "bucket_shape", "bucket_widths"]

MIN_WIDTH = 64
"""Narrowest bucket (tokens per row)."""


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def bucket_widths(max_width: int) -> list[int]:
    """Every bucket width a sequence of at most `max_width` tokens can fall in: the powers of two from
    `MIN_WIDTH` below the top, and the top, `max_width` rounded up to a multiple of `MIN_WIDTH` (a
    power-of-two top would pad the longest sequences, the common case of long rollouts, up to 2x)."""
    if max_width < 1:
        raise ValueError(f"bucket_widths: max_width={max_width} must be >= 1")
    top = -(-max_width // MIN_WIDTH) * MIN_WIDTH
    widths, w = [], MIN_WIDTH
    while w < top:
        widths.append(w)
        w *= 2
    return [*widths, top]


def bucket_shape(
    rows: int, width: int, *, max_rows: int, max_tokens: int | None, max_width: int | None = None
) -> tuple[int, int]:
    """The bucket ``(R, W)`` of a micro-batch of `rows` sequences padded to `width` tokens, among the
    `bucket_widths` of `max_width` (None: unbounded powers of two)."""
    widths = bucket_widths(max_width) if max_width is not None else [MIN_WIDTH]
    while max_width is None and widths[-1] < width:
        widths.append(widths[-1] * 2)
    fits = [i for i, w in enumerate(widths) if w >= width]
    if not fits:
        raise ValueError(f"cuda graphs: a micro-batch {width} tokens wide exceeds the widest bucket {widths[-1]}")
    i = fits[0]
    w = widths[i]
    shortest = 1 if i == 0 else widths[i - 1] + 1  # the narrowest micro-batch this bucket takes
    r = max_rows if max_tokens is None else max(1, min(max_rows, max_tokens // shortest))
    if rows > r:
        raise ValueError(
            f"cuda graphs: a micro-batch of {rows} rows x {width} tokens does not fit its bucket of {r} rows x {w} "
            f"(algo.micro_batch_size={max_rows}, algo.micro_batch_tokens={max_tokens})"
        )
    return r, w


class _Logprobs(nn.Module):
    def __init__(self, model: nn.Module, temperature: float, with_entropy: bool = False) -> None:
        super().__init__()
        self.model, self.temperature, self.with_entropy = model, temperature, with_entropy

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, targets: torch.Tensor):
        batch = TokenBatch(input_ids, attention_mask, targets, None, None, None)
        lp, ent = forward_logprobs(self.model, batch, temperature=self.temperature, with_entropy=self.with_entropy)
        return (lp, ent) if self.with_entropy else lp


def _warm_up(fn, iters: int) -> None:
    """Run `fn` `iters` times on a side stream, outside any capture (lazy initialisation, Triton autotuning,
    DeepGEMM's JIT), then give the blocks it freed back to the device: a capture allocates from its graph pool,
    which cannot reuse what the ordinary cache keeps."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(iters):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _capture(fn, pool):
    """Capture `fn` (which writes its results to attributes it keeps) into a CUDA graph in `pool`; returns
    the graph's replay."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        fn()
    return graph.replay


class _NoGradGraph:
    """One captured no-grad forward (log-probs and entropies) with static inputs."""

    def __init__(self, fn: _Logprobs, sample: tuple[torch.Tensor, ...], pool) -> None:
        self.fn, self.inputs = fn, tuple(t.clone() for t in sample)
        _warm_up(self._forward, 1)
        self.replay = _capture(self._forward, pool)

    @torch.no_grad()
    def _forward(self) -> None:
        self.outputs = self.fn(*self.inputs)

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for dst, src in zip(self.inputs, inputs, strict=True):
            dst.copy_(src)
        self.replay()
        return self.outputs


class _GradGraph:
    """One captured forward (log-probs, static inputs and output) and its backward, which adds each trainable
    parameter's gradient to its fp32 ``main_grad`` inside the graph, as `MixedPrecisionAdamW`'s hook does in
    eager mode (``main_grad += grad.float()``; a `JetFP8Linear` weight's wgrad is added by the Linear itself
    and has no autograd gradient). So a graph keeps no gradient of its own: torch's `make_graphed_callables`
    returns every parameter's gradient from static buffers each graph holds for its lifetime (a full BF16
    copy of the model per bucket)."""

    WARMUP = 3
    """Warm-up iterations before the capture (as `torch.cuda.make_graphed_callables`)."""

    def __init__(self, fn: _Logprobs, sample: tuple[torch.Tensor, ...], pool, params: list[nn.Parameter]) -> None:
        self.fn, self.params, self.inputs = fn, params, tuple(t.clone() for t in sample)
        self.grad_out: torch.Tensor | None = None
        _warm_up(self._warm_step, self.WARMUP)
        self.replay_forward = _capture(self._forward, pool)
        self.replay_backward = _capture(self._backward, pool)
        self.out = self.out.detach()  # drop the capture's autograd graph: what it kept goes back to the pool

    def _warm_step(self) -> None:
        self._forward()
        if self.grad_out is None:  # 0: the warm-up adds nothing to main_grad; a replay copies the loss's in
            self.grad_out = torch.zeros_like(self.out)
        self._backward()

    def _forward(self) -> None:
        self.out = self.fn(*self.inputs)

    def _backward(self) -> None:
        grads = torch.autograd.grad(self.out, self.params, grad_outputs=self.grad_out, allow_unused=True)
        for p, g in zip(self.params, grads, strict=True):
            if g is not None:
                p.main_grad.add_(g.to(torch.float32))


class _Replay(torch.autograd.Function):
    """The autograd node of a `_GradGraph` replay: forward replays its forward graph on the inputs, backward
    copies the output's gradient in and replays its backward graph. ``anchor`` is an empty tensor that
    requires grad, so that the output does (the parameters' gradients never leave the graph)."""

    @staticmethod
    def forward(ctx, graph: _GradGraph, anchor: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        for dst, src in zip(graph.inputs, inputs, strict=True):
            dst.copy_(src)
        graph.replay_forward()
        ctx.graph, ctx.n_inputs = graph, len(inputs)
        return graph.out.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.graph.grad_out.copy_(grad)
        ctx.graph.replay_backward()
        return (None, None, *(None,) * ctx.n_inputs)


def pad_to(sub: TokenBatch, rows: int, width: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask, targets)`` of `sub` right-padded to ``[rows, width]`` (targets ``width - 1``);
    a padding row attends to its first token, so that no attention row is fully masked (module doc)."""
    n, w = sub.input_ids.shape
    ids = sub.input_ids.new_full((rows, width), pad_id)
    mask = sub.attention_mask.new_zeros((rows, width))
    ids[:n, :w], mask[:n, :w] = sub.input_ids, sub.attention_mask
    mask[n:, 0] = 1
    return ids, mask, ids[:, 1:].contiguous()


def _require_cuda(model: nn.Module) -> None:
    device = next(model.parameters()).device
    if device.type != "cuda":
        raise ValueError(f"algo.cuda_graphs: the model is on {device}; CUDA graphs need a CUDA device")


class GraphedLogprobs:
    """`forward_logprobs` of a CUDA model for the update pass, on one captured graph pair per bucket."""

    def __init__(
        self,
        model: nn.Module,
        *,
        temperature: float,
        pad_id: int,
        max_rows: int,
        max_tokens: int | None,
        max_width: int,
    ) -> None:
        _require_cuda(model)
        self.model, self.pad_id = model, pad_id
        self.max_rows, self.max_tokens = max_rows, max_tokens
        self._limits = {"max_rows": max_rows, "max_tokens": max_tokens, "max_width": max_width}
        self.buckets = sorted(
            {bucket_shape(1, w, **self._limits) for w in bucket_widths(max_width)},
            key=lambda rw: rw[1],
        )
        self.temperature = temperature
        self._params = [p for p in model.parameters() if p.requires_grad]
        missing = [n for n, p in model.named_parameters() if p.requires_grad and not hasattr(p, "main_grad")]
        if missing:
            raise ValueError(
                f"algo.cuda_graphs: parameter {missing[0]!r} has no main_grad; the backward graphs add gradients "
                "to the fp32 accumulators of MixedPrecisionAdamW (create it before the graphs)"
            )
        self._anchor = torch.empty(0, device=next(model.parameters()).device, requires_grad=True)
        self._graphs: dict[tuple[int, int], _GradGraph] = {}
        self._nograd: dict[tuple[int, int], _NoGradGraph] = {}
        self.replays = 0

    def capture_all(self) -> None:
        """Capture every bucket (each graph's warm-up iterations run with a zero output gradient)."""
        device = next(self.model.parameters()).device
        pool = torch.cuda.graph_pool_handle()
        for i, (r, w) in enumerate(self.buckets):
            ids = torch.full((r, w), self.pad_id, dtype=torch.long, device=device)
            mask = torch.ones((r, w), dtype=torch.long, device=device)
            mask[:, w // 2 + 1 :] = 0  # a padded sample: the masked attention path a replay takes
            sample = (ids, mask, ids[:, 1:].contiguous())
            try:
                self._graphs[(r, w)] = _GradGraph(_Logprobs(self.model, self.temperature), sample, pool, self._params)
                forward_only = _Logprobs(self.model, self.temperature, with_entropy=True)
                self._nograd[(r, w)] = _NoGradGraph(forward_only, sample, pool)
            except torch.cuda.OutOfMemoryError as e:
                raise torch.cuda.OutOfMemoryError(
                    f"algo.cuda_graphs: capturing bucket {r}x{w} ({i + 1} of {len(self.buckets)}: "
                    f"{[f'{a}x{b}' for a, b in self.buckets]}) ran out of GPU memory; give the trainer more (a lower "
                    "rollout.gpu_memory_utilization), make micro-batches smaller (algo.micro_batch_size / "
                    f"micro_batch_tokens), or train eagerly with algo.cuda_graphs=false. {e}"
                ) from e
        torch.cuda.synchronize(device)
        # the captures' samples are padding, not data: a non-finite value they met is not the first step's
        from jetrl.kernels import reset_nonfinite

        reset_nonfinite()

    def bucket_of(self, rows: int, width: int) -> tuple[int, int]:
        """The bucket ``(R, W)`` a micro-batch of `rows` sequences `width` tokens wide replays in: the
        ``R x W`` token slots the GPU computes for it."""
        return bucket_shape(rows, width, **self._limits)

    def _bucket(self, sub: TokenBatch, width: int) -> tuple[int, int]:
        rows = sub.input_ids.shape[0]
        key = self.bucket_of(rows, width)
        if key not in self._graphs:
            raise RuntimeError(
                f"cuda graphs: no graph was captured for bucket {key} (rows {rows}, width {width}); the buckets "
                f"captured are {sorted(self._graphs)} (raise rollout.max_model_len?)"
            )
        return key

    def __call__(self, sub: TokenBatch, width: int) -> torch.Tensor:
        """Log-probs ``[rows, width - 1]`` of the micro-batch `sub` (trimmed to `width`), through its bucket;
        backward replays the bucket's backward graph."""
        key = self._bucket(sub, width)
        self.replays += 1
        lp = _Replay.apply(self._graphs[key], self._anchor, *pad_to(sub, *key, self.pad_id))
        return lp[: len(sub), : width - 1]

    def no_grad(self, sub: TokenBatch, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probs, entropies) ``[rows, width - 1]`` of `sub` without autograd (the old-log-prob pass),
        through the bucket's forward-only graph. The results are views of the graph's outputs: use them before
        the next replay."""
        key = self._bucket(sub, width)
        self.replays += 1
        lp, ent = self._nograd[key](*pad_to(sub, *key, self.pad_id))
        return lp[: len(sub), : width - 1], ent[: len(sub), : width - 1]
