"""The trainer's micro-batches on CUDA graphs (``algo.cuda_graphs``, issue 19): the update pass's forward +
backward, and the old-log-prob pass's forward.

Why: every FP8 Linear's forward + backward costs 1.3-1.8 ms of host time in eager mode (Triton launches,
DeepGEMM calls, autograd; ``scripts/results/host-nvidia-h200.json``), more than its GPU time at RL micro-batch
sizes, so the FP8 training phase is host-bound. A replayed CUDA graph issues the whole model's kernels at once.

How: `GraphedLogprobs` keeps, per shape bucket, one graph pair (forward, backward:
`torch.cuda.make_graphed_callables`) and one no-grad forward graph (log-probs and entropies). A micro-batch
``[rows, width]`` is padded on the right to the bucket ``[R, W]``: ``W`` the narrowest `bucket_widths` >= width
(powers of two from `MIN_WIDTH`, and the engine's context length rounded up to 64 as the top: with power-of-two
buckets only, 512-token responses after a 16-token prompt ran in 1024-wide buckets, and BF16's update got
slower on graphs than eager), ``R`` the micro-batch size, or with a token budget the most rows a micro-batch of
that bucket can have (``budget // (previous width + 1)``, capped by the micro-batch size; the narrowest bucket
takes the micro-batch size). Padding columns have attention mask 0; a padding row attends to its first token only, so
that no batch row is fully masked: on the H200 the GPU test's `bf16` q/k/v wgrads came out all NaN, eager and
graphed alike, for a bucket with a fully masked row (finite on CPU; the likely source is CUDA SDPA's backward
over a row with no key to attend to, which spreads NaN into every wgrad although the row's log-probs are cut
off; with this padding the GPU test passes for both recipes). The log-probs of padding rows and columns are
cut off before the loss, so their gradient is 0; they do take part in the 128-token blocks of the wgrad
operands, as the padding of an eager micro-batch does. Every bucket is captured once, before training
(`capture_all`), because capturing runs warm-up iterations whose gradients land in the accumulators (the
optimizer's gradients are zeroed after) and whose uninitialised output gradients may trip the kernels'
non-finite flags (cleared after).

Memory: all graphs share one graph memory pool, so they hold about the largest bucket's activations, not
their sum. That is safe for how the trainer replays them: a bucket's backward always follows its own
forward before any other graph runs (a later capture may reuse what an earlier one freed, never what a graph
keeps between its forward and backward), and the log-probs a forward returns are used up (loss, statistics,
the copy into the batch's old log-probs) before the next replay overwrites them.

What replay reads: the captured tensors. The inputs are copied into the graph's static input buffers; the
BF16 parameters are updated in place by the optimizer (same storage); the FP8 weight caches must be
updated in place too, so after every optimizer step the trainer calls `jetrl.linear.refresh_fp8_weights_`
(a re-quantization into the cached tensors, once per step as in eager mode). fp32 wgrads accumulate into
the parameters' ``main_grad`` inside the backward graph; the other parameters' gradients come out of it and
are accumulated by autograd as usual.

Equality: a graph replays the kernels eager mode launches for the same padded shapes, so the graphed and
the eager log-probs and gradients of a padded micro-batch are equal bit for bit (GPU test
``tests/train/test_cuda_graphs.py``). The eager path stays the default.
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


class _NoGradGraph:
    """One captured no-grad forward (log-probs and entropies) with static inputs."""

    def __init__(self, fn: _Logprobs, sample: tuple[torch.Tensor, ...], pool) -> None:
        self.inputs = tuple(t.clone() for t in sample)
        with torch.no_grad():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up outside the capture (lazy initialisation, autotuning)
                fn(*self.inputs)
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool):
                self.outputs = fn(*self.inputs)

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for dst, src in zip(self.inputs, inputs, strict=True):
            dst.copy_(src)
        self.graph.replay()
        return self.outputs


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
        self._graphs: dict[tuple[int, int], object] = {}
        self._nograd: dict[tuple[int, int], _NoGradGraph] = {}
        self.replays = 0

    def capture_all(self) -> None:
        """Capture every bucket (warm-up iterations included: zero the gradients afterwards)."""
        device = next(self.model.parameters()).device
        pool = torch.cuda.graph_pool_handle()
        for r, w in self.buckets:
            ids = torch.full((r, w), self.pad_id, dtype=torch.long, device=device)
            mask = torch.ones((r, w), dtype=torch.long, device=device)
            mask[:, w // 2 + 1 :] = 0  # a padded sample: the masked attention path a replay takes
            sample = (ids, mask, ids[:, 1:].contiguous())
            # a wrapper of its own per bucket: make_graphed_callables replaces the module's forward with the graph;
            # allow_unused_input: an FP8 Linear's weight gets no autograd gradient (its wgrad goes to main_grad)
            self._graphs[(r, w)] = torch.cuda.make_graphed_callables(
                _Logprobs(self.model, self.temperature), sample, pool=pool, allow_unused_input=True
            )
            forward_only = _Logprobs(self.model, self.temperature, with_entropy=True)
            self._nograd[(r, w)] = _NoGradGraph(forward_only, sample, pool)
        torch.cuda.synchronize(device)
        # the warm-up backward runs on uninitialised output gradients (torch.empty_like): whatever non-finite
        # values it met must not be reported as the first step's
        from jetrl.kernels import reset_nonfinite

        reset_nonfinite()

    def _bucket(self, sub: TokenBatch, width: int) -> tuple[int, int]:
        rows = sub.input_ids.shape[0]
        key = bucket_shape(rows, width, **self._limits)
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
        return self._graphs[key](*pad_to(sub, *key, self.pad_id))[: len(sub), : width - 1]

    def no_grad(self, sub: TokenBatch, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probs, entropies) ``[rows, width - 1]`` of `sub` without autograd (the old-log-prob pass),
        through the bucket's forward-only graph. The results are views of the graph's outputs: use them before
        the next replay."""
        key = self._bucket(sub, width)
        self.replays += 1
        lp, ent = self._nograd[key](*pad_to(sub, *key, self.pad_id))
        return lp[: len(sub), : width - 1], ent[: len(sub), : width - 1]
