"""Benchmark the FP8 Linear and a Llama-3.1-8B-shaped decoder layer against BF16 on one GPU.

Measures (median of CUDA-event timings after warm-up; DeepGEMM JIT-compiles each new shape first):

1. Linear fwd+bwd at Llama-8B shapes (qkv 6144x4096, o 4096x4096, gate_up 28672x4096, down 4096x14336)
   for 8192 and 16384 tokens: bf16 ``nn.Linear`` vs `JetFP8Linear` including every quantize and
   transpose (X and dY each 1x128 and 128x1, W 128x128 + transpose re-done every
   iteration, i.e. one micro-batch per optimizer step: the worst case; "cached W" reuses it).
   Eager steps are timed two ways: one synchronised step at a time (``*_ms``: its host issue time is
   not hidden behind anything) and back to back (``*_b2b_ms``: 20 steps between two events, no sync
   inside, as a training loop runs, where the host enqueues the next step during this one's GPU work).
   Per shape also the host "issue time" (perf_counter around the calls, no synchronisation inside:
   how long Python + dispatch take to enqueue one fwd+bwd), for the eager fast path (Triton launchers
   called directly) and for the ``jetrl::`` custom-op path it bypasses.
2. One decoder layer (RMSNorm, GQA attention through SDPA, SwiGLU MLP; random weights) fwd+bwd, BF16
   vs FP8 (projections converted by `jetrl.convert.convert_model`): unfused (every Linear quantizes
   its input), shared (the normed hidden state quantized once and shared by q/k/v and gate/up via
   `attach_quantized`), and fused (``convert_model(fuse=True)``: RMSNorm+quantize and SwiGLU+quantize
   kernels hand their bytes to the Linears): time, peak memory, bytes saved for backward (all, and by
   the Linears alone).
3. fp8_param: the layer's Linear weight memory with fp8 bytes + scales vs BF16.
4. ``--cuda-graphs`` (default on, CUDA only): the same fwd+bwd steps captured once in a
   ``torch.cuda.CUDAGraph`` (warm-up on a side stream, static inputs, grads allocated inside the
   capture) and timed by replay. This is the GPU-bound speed without host overhead. Eager stays the
   headline ("eager training"); graphed numbers show what the GPU work alone costs. Graphs run after
   every eager number is written, so a capture problem cannot lose them.

Prints a table and writes scripts/results/linear-<gpu>.json (or --out). ``--smoke`` runs tiny shapes
on any device (CPU: emulated backend) to check the script itself.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import statistics
import time

import benchmeta
import torch
import torch.nn.functional as F
from torch import nn

from jetrl.convert import convert_model
from jetrl.fp8_param import enable_fp8_params, weight_memory_report
from jetrl.gemm import get_backend
from jetrl.gemm import quantize as gq
from jetrl.gemm.quantize import eager_fast_path, quantize_1x128, quantize_paths, set_quantize_impl
from jetrl.linear import JetFP8Linear, attach_quantized, invalidate_fp8_caches
from jetrl.recipe import Recipe
from jetrl.testing.numerics import sqnr_db

LINEARS = [("qkv", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up", 28672, 4096), ("down_proj", 4096, 14336)]
LAYER = dict(hidden=4096, inter=14336, heads=32, kv_heads=8, head_dim=128, seq=4096)
SMOKE_LINEARS = [("qkv", 384, 256), ("down_proj", 256, 512)]
SMOKE_LAYER = dict(hidden=256, inter=512, heads=2, kv_heads=1, head_dim=128, seq=64)


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def timeit(fn, dev, warmup=3, rep=10) -> float:
    """Median milliseconds of fn()."""
    for _ in range(warmup):
        fn()
    sync(dev)
    times = []
    for _ in range(rep):
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def back_to_back_ms(fn, dev, warmup=3, rep=20) -> float:
    """Milliseconds per fn() when `rep` calls are issued back to back and timed as one span (CUDA events
    around the loop, no synchronisation inside): the steady state of an eager training loop, where the
    host enqueues the next step while the GPU still runs this one, so a step costs about
    max(host issue, GPU time) instead of `timeit`'s host issue + GPU time of a lone, synchronised step."""
    for _ in range(warmup):
        fn()
    sync(dev)
    if dev.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(rep):
            fn()
        return (time.perf_counter() - t0) * 1e3 / rep
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(rep):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / rep


def host_ms(fn, dev, n=10) -> float:
    """Milliseconds the host needs to issue fn() (perf_counter around n calls, no synchronisation inside
    the loop, then one sync): when this is close to the event-timed GPU time, the step is bound by
    launch/Python overhead, not by the GPU."""
    fn()
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    sync(dev)
    return (t1 - t0) * 1e3 / n


def graphed_ms(fn, dev, warmup=3, rep=10) -> float:
    """Median milliseconds of one replay of fn() captured in a CUDA graph.

    fn must use static tensors and set the grads it produces to None first (they are then allocated
    inside the capture and rewritten by every replay). Warm-up runs on a side stream (DeepGEMM and
    Triton JIT, the non-finite flag buffers, the allocator) as ``torch.cuda.graph`` requires."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    try:
        return timeit(graph.replay, dev, warmup=2, rep=rep)
    finally:
        del graph
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


@contextlib.contextmanager
def without_fast_path():
    """The quantizers go through the jetrl:: custom ops (the path the eager fast path bypasses)."""
    saved = gq.FAST_PATH_DEVICE_TYPES
    gq.FAST_PATH_DEVICE_TYPES = ()
    try:
        yield
    finally:
        gq.FAST_PATH_DEVICE_TYPES = saved


# -------------------------------------------------------------------------------------------------
# 1. Linears
# -------------------------------------------------------------------------------------------------
class LinearCase:
    """One Llama-8B Linear shape: a bf16 nn.Linear and a JetFP8Linear sharing its weight, static
    input/grad tensors, and fwd+bwd step functions (W re-quantized per step, or cached)."""

    def __init__(self, name, n, k, tokens, backend, recipe, dev):
        torch.manual_seed(0)
        self.name, self.n, self.k, self.tokens = name, n, k, tokens
        self.lin = nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
        self.fp8 = JetFP8Linear.from_linear(self.lin, recipe=recipe, backend=backend, layer_name=name)
        self.x = torch.randn(tokens, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
        self.dy = torch.randn(tokens, n, device=dev, dtype=torch.bfloat16)

    def step(self, which: str):
        """which: "bf16", "fp8" (W re-quantized every step) or "fp8_cached_w"."""
        mod = self.lin if which == "bf16" else self.fp8
        requantize = which == "fp8"
        x, dy = self.x, self.dy

        def run():
            x.grad = None
            mod.weight.grad = None
            if requantize:
                mod.invalidate_fp8_weight()
            mod(x).backward(dy)

        return run


def bench_linear(case: LinearCase, dev):
    flops = 6.0 * case.tokens * case.n * case.k
    row = {"linear": case.name, "N": case.n, "K": case.k, "tokens": case.tokens}
    for key in ("bf16", "fp8", "fp8_cached_w"):
        row[f"{key}_ms"] = timeit(case.step(key), dev)
        row[f"{key}_tflops"] = flops / row[f"{key}_ms"] / 1e9
    row["speedup"] = row["bf16_ms"] / row["fp8_ms"]
    row["speedup_cached_w"] = row["bf16_ms"] / row["fp8_cached_w_ms"]
    for key in ("bf16", "fp8", "fp8_cached_w"):
        row[f"{key}_b2b_ms"] = back_to_back_ms(case.step(key), dev)
    row["speedup_b2b"] = row["bf16_b2b_ms"] / row["fp8_b2b_ms"]
    row["speedup_cached_w_b2b"] = row["bf16_b2b_ms"] / row["fp8_cached_w_b2b_ms"]
    row["fast_path"] = eager_fast_path(case.x.detach())
    row["bf16_issue_ms"] = host_ms(case.step("bf16"), dev)
    row["fp8_issue_ms"] = host_ms(case.step("fp8"), dev)
    row["fp8_cached_w_issue_ms"] = host_ms(case.step("fp8_cached_w"), dev)
    with without_fast_path():  # the same step through the jetrl:: custom ops: the host cost bypassed
        row["fp8_custom_ops_issue_ms"] = host_ms(case.step("fp8"), dev)
        row["fp8_custom_ops_ms"] = timeit(case.step("fp8"), dev)
    # numerics vs bf16 (same inputs)
    with torch.no_grad():
        row["fwd_sqnr_vs_bf16_db"] = sqnr_db(case.lin(case.x), case.fp8(case.x))
    return row


def bench_linear_graphed(case: LinearCase, dev):
    """The same three steps captured in CUDA graphs (the fp8 graph re-quantizes W inside the replay)."""
    row = {}
    for key in ("bf16", "fp8", "fp8_cached_w"):
        if key == "fp8_cached_w":  # fill the weight cache (with dgrad's transposed bytes) before the capture
            case.fp8.invalidate_fp8_weight()
            case.fp8._fp8_operands(with_transpose=True)
        row[f"{key}_graph_ms"] = graphed_ms(case.step(key), dev)
    row["speedup_graph"] = row["bf16_graph_ms"] / row["fp8_graph_ms"]
    row["speedup_cached_w_graph"] = row["bf16_graph_ms"] / row["fp8_cached_w_graph_ms"]
    return row


def profile_linear(name, n, k, tokens, backend, recipe, dev, steps=5):
    """Per-kernel GPU time of one FP8 Linear fwd+bwd step (W re-quantized), and host issue time."""
    from torch.profiler import ProfilerActivity, profile

    lin = nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
    fp8 = JetFP8Linear.from_linear(lin, recipe=recipe, backend=backend, layer_name=name)
    x = torch.randn(tokens, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, n, device=dev, dtype=torch.bfloat16)

    def run(mod=fp8):
        x.grad = None
        mod.weight.grad = None
        if mod is fp8:
            mod.invalidate_fp8_weight()
        mod(x).backward(dy)

    out = {"linear": name, "tokens": tokens, "fp8_host_issue_ms": host_ms(run, dev)}
    out["bf16_host_issue_ms"] = host_ms(lambda: run(lin), dev)
    if dev.type == "cuda" and backend.name != "torch-blockwise":
        tb = JetFP8Linear.from_linear(lin, recipe=recipe, backend="torch-blockwise", layer_name=name)

        def run_tb():
            x.grad = None
            tb.weight.grad = None
            tb.invalidate_fp8_weight()
            tb(x).backward(dy)

        out["torch_blockwise_host_issue_ms"] = host_ms(run_tb, dev)
        out["torch_blockwise_ms"] = timeit(run_tb, dev)
    import cProfile
    import io
    import pstats

    pr = cProfile.Profile()
    pr.enable()
    for _ in range(steps):
        run()
    pr.disable()
    sync(dev)
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(14)
    out["host_profile"] = buf.getvalue()
    for _ in range(3):
        run()
    sync(dev)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run()
        sync(dev)
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if t > 0:
            rows.append((t / steps / 1e3, e.count / steps, e.key))
    rows.sort(reverse=True)
    out["gpu_kernel_ms"] = sum(r[0] for r in rows)
    out["kernels"] = [{"ms": r[0], "calls": r[1], "name": r[2][:100]} for r in rows[:15]]
    return out


# -------------------------------------------------------------------------------------------------
# 2. Decoder layer
# -------------------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    """HF LlamaRMSNorm numerics."""

    def __init__(self, d, eps=1e-5, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d, device=device, dtype=torch.bfloat16))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class MLP(nn.Module):
    """HF LlamaMLP: down_proj(act_fn(gate_proj(h)) * up_proj(h)) with SiLU."""

    def __init__(self, hidden, inter, lin):
        super().__init__()
        self.gate_proj = lin(hidden, inter)
        self.up_proj = lin(hidden, inter)
        self.down_proj = lin(inter, hidden)
        self.act_fn = nn.SiLU()

    def forward(self, h):
        return self.down_proj(self.act_fn(self.gate_proj(h)) * self.up_proj(h))


class DecoderLayer(nn.Module):
    """Llama decoder layer (no RoPE: it does not touch the Linears) with HF module names."""

    def __init__(self, hidden, inter, heads, kv_heads, head_dim, device):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        lin = lambda i, o: nn.Linear(i, o, bias=False, device=device, dtype=torch.bfloat16)  # noqa: E731
        self.input_layernorm = RMSNorm(hidden, device=device)
        self.self_attn = nn.Module()
        self.self_attn.q_proj = lin(hidden, heads * head_dim)
        self.self_attn.k_proj = lin(hidden, kv_heads * head_dim)
        self.self_attn.v_proj = lin(hidden, kv_heads * head_dim)
        self.self_attn.o_proj = lin(heads * head_dim, hidden)
        self.post_attention_layernorm = RMSNorm(hidden, device=device)
        self.mlp = MLP(hidden, inter, lin)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)
        self.share_quantized = False

    def _norm(self, norm, x):
        h = norm(x)
        if self.share_quantized:  # what a fused RMSNorm+quantize kernel hands to the next Linears
            be = self.self_attn.q_proj.backend
            attach_quantized(h, *quantize_1x128(h.detach().reshape(-1, h.shape[-1]), scale_layout=be.scale_layout))
        return h

    def forward(self, x):
        b, s, _ = x.shape
        h = self._norm(self.input_layernorm, x)
        a = self.self_attn
        q = a.q_proj(h).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = a.k_proj(h).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = a.v_proj(h).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + a.o_proj(o.transpose(1, 2).reshape(b, s, -1))
        h = self._norm(self.post_attention_layernorm, x)
        return x + self.mlp(h)


def saved_bytes(layer, x, dy):
    """(all bytes saved for backward, bytes saved by the Linears), distinct storages, parameters excluded."""
    params = {p.data_ptr() for p in layer.parameters()}
    seen_all, seen_lin = {}, {}
    state = {"in_linear": 0}
    hooks = []
    for mod in layer.modules():
        if isinstance(mod, nn.Linear):
            hooks.append(mod.register_forward_pre_hook(lambda *_: state.__setitem__("in_linear", 1)))
            hooks.append(mod.register_forward_hook(lambda *_: state.__setitem__("in_linear", 0)))

    def pack(t):
        st = t.untyped_storage()
        if t.data_ptr() not in params:
            seen_all[st.data_ptr()] = st.nbytes()
            if state["in_linear"]:
                seen_lin[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer(x)
    y.backward(dy)
    for h in hooks:
        h.remove()
    return sum(seen_all.values()), sum(seen_lin.values())


LAYER_VARIANTS = ("bf16", "fp8", "fp8_shared", "fp8_fused")
"""bf16; fp8: every Linear quantizes its input; fp8_shared: the normed hidden state quantized once for
q/k/v and for gate/up (`attach_quantized`); fp8_fused: ``convert_model(fuse=True)`` (RMSNorm+quantize
and SwiGLU+quantize kernels hand their bytes to the Linears)."""


class LayerCase:
    """A decoder layer in one of `LAYER_VARIANTS`, static input/grad, and its fwd+bwd step."""

    def __init__(self, tokens, backend, recipe, dev, dims, variant):
        torch.manual_seed(0)
        seq = dims["seq"]
        self.batch, self.seq = max(1, tokens // seq), seq
        self.x = torch.randn(self.batch, seq, dims["hidden"], device=dev, dtype=torch.bfloat16, requires_grad=True)
        self.dy = torch.randn_like(self.x)
        self.layer = DecoderLayer(**{k: v for k, v in dims.items() if k != "seq"}, device=dev)  # same seed: same W
        if variant != "bf16":
            convert_model(self.layer, recipe, backend=backend, fuse=variant == "fp8_fused")
        self.layer.share_quantized = variant == "fp8_shared"

    def run(self):
        x, layer = self.x, self.layer
        x.grad = None
        for p in layer.parameters():
            p.grad = None
        invalidate_fp8_caches(layer)  # one micro-batch per optimizer step: W re-quantized every iteration
        layer(x).backward(self.dy)


def bench_layer(tokens, backend, recipe, dev, dims):
    out = {}
    y_bf16 = None
    for variant in LAYER_VARIANTS:
        case = LayerCase(tokens, backend, recipe, dev, dims, variant)
        out.update(tokens=case.batch * case.seq, batch=case.batch, seq=case.seq)
        with torch.no_grad():
            y = case.layer(case.x)
        if variant == "bf16":
            y_bf16 = y
        else:
            out[f"{variant}_fwd_sqnr_vs_bf16_db"] = sqnr_db(y_bf16, y)
        del y
        out[f"{variant}_ms"] = timeit(case.run, dev)
        out[f"{variant}_b2b_ms"] = back_to_back_ms(case.run, dev, warmup=1, rep=5)
        out[f"{variant}_issue_ms"] = host_ms(case.run, dev, n=5)
        if dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            case.run()
            torch.cuda.synchronize()
            out[f"{variant}_peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        else:
            out[f"{variant}_peak_mib"] = float("nan")
        saved = saved_bytes(case.layer, case.x, case.dy)
        out[f"{variant}_saved_mib"], out[f"{variant}_linear_saved_mib"] = (v / 2**20 for v in saved)
        if variant != "bf16":
            out[f"{variant}_speedup"] = out["bf16_ms"] / out[f"{variant}_ms"]
            out[f"{variant}_speedup_b2b"] = out["bf16_b2b_ms"] / out[f"{variant}_b2b_ms"]
        if variant == "fp8_shared":
            out["linear_saved_ratio"] = out["fp8_shared_linear_saved_mib"] / out["bf16_linear_saved_mib"]
            out["fp8_param"], out["fp8_param_ms"] = _fp8_param(case, dev)
        del case
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return out


def _fp8_param(case, dev):
    """3. fp8_param on the (shared-quantization) FP8 layer: weight memory, and a step with re-quantization."""
    layer, x, dy = case.layer, case.x, case.dy
    before = torch.cuda.memory_allocated() if dev.type == "cuda" else 0
    params = enable_fp8_params(layer)
    rep = weight_memory_report(layer)
    out = {**rep, "bf16_mib": rep["bf16_bytes"] / 2**20, "resident_mib": rep["resident_bytes"] / 2**20}
    if dev.type == "cuda":
        # net change of allocated memory: + fp32 masters + fp8 bytes/scales - bf16 weights - the cached
        # fp8 weight copies (q and q_t) the converted layer held before; not the master size
        out["allocated_delta_mib_incl_fp32_masters"] = (torch.cuda.memory_allocated() - before) / 2**20
    return out, timeit(lambda: (layer(x).backward(dy), params.requantize()), dev)


def bench_layer_graphed(tokens, backend, recipe, dev, dims):
    """Each layer variant's fwd+bwd (W re-quantized inside) captured in a CUDA graph."""
    out = {}
    for variant in LAYER_VARIANTS:
        case = LayerCase(tokens, backend, recipe, dev, dims, variant)
        out[f"{variant}_graph_ms"] = graphed_ms(case.run, dev)
        if variant != "bf16":
            out[f"{variant}_speedup_graph"] = out["bf16_graph_ms"] / out[f"{variant}_graph_ms"]
        del case
        torch.cuda.empty_cache()
    return out


def versions():
    v = {"torch": torch.__version__}
    try:
        import triton

        v["triton"] = triton.__version__
    except ImportError:
        v["triton"] = None
    try:
        from jetrl.gemm.deepgemm import import_deep_gemm

        dg = import_deep_gemm()
        v["deep_gemm"] = getattr(dg, "__version__", "unknown") + f" ({dg.__name__})"
    except Exception as e:
        v["deep_gemm"] = f"unavailable: {e}"[:200]
    return v


def _write(res, path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(res, f, indent=1, default=str)


def _graphed(fn, *args):
    """fn(*args), or {"graph_error": ...} when the capture fails (reported, never hidden)."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - recorded in the JSON and printed
        msg = f"{type(e).__name__}: {e}"[:500]
        print(f"CUDA graph capture failed: {msg}")
        return {"graph_error": msg}


def _print_tables(res):
    print()
    print("Linear fwd+bwd, W re-quantized every step. Eager = one synchronised step (host issue + GPU); b2b =")
    print("eager steps issued back to back (a training loop's steady state); graphed = the step replayed from a")
    print("CUDA graph (GPU-bound, no host overhead). issue = host ms to enqueue one step.")
    print(
        "| linear | T | bf16 ms | fp8 ms | eager speedup | cached-W speedup | b2b bf16/fp8 ms | b2b speedup "
        "| graphed bf16/fp8 ms | graphed speedup | issue ms bf16 / fp8 / fp8 via custom ops |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in res["linears"]:
        g = (
            f"{r['bf16_graph_ms']:.3f}/{r['fp8_graph_ms']:.3f} | {r['speedup_graph']:.2f}x"
            if "fp8_graph_ms" in r
            else f"- | {r.get('graph_error', 'not run')[:40]}"
        )
        print(
            f"| {r['linear']} {r['N']}x{r['K']} | {r['tokens']} | {r['bf16_ms']:.3f} | {r['fp8_ms']:.3f} | "
            f"{r['speedup']:.2f}x | {r['speedup_cached_w']:.2f}x | {r['bf16_b2b_ms']:.3f}/{r['fp8_b2b_ms']:.3f} | "
            f"{r['speedup_b2b']:.2f}x | {g} | {r['bf16_issue_ms']:.3f} / "
            f"{r['fp8_issue_ms']:.3f} / {r['fp8_custom_ops_issue_ms']:.3f} |"
        )
    geomeans = (
        ("linear_speedup_geomean", "eager"),
        ("linear_speedup_b2b_geomean", "eager back to back"),
        ("linear_speedup_graph_geomean", "graphed"),
    )
    for key, label in geomeans:
        if key in res:
            print(f"geomean Linear speedup {label}: {res[key]:.2f}x (goal >= 1.5x)")
    if res["layers"]:
        print()
        print(
            "| layer T | bf16 ms | fp8 / shared-q / fused ms | eager speedup (best) | b2b speedup (best) "
            "| graphed speedup (best) | peak MiB bf16/fused | Linear saved MiB bf16/shared |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for r in res["layers"]:
            best = max(r[f"{v}_speedup"] for v in LAYER_VARIANTS[1:])
            best_b2b = max(r[f"{v}_speedup_b2b"] for v in LAYER_VARIANTS[1:])
            gs = [r[f"{v}_speedup_graph"] for v in LAYER_VARIANTS[1:] if f"{v}_speedup_graph" in r]
            gtxt = f"{max(gs):.2f}x" if gs else r.get("graph_error", "-")[:40]
            print(
                f"| {r['tokens']} | {r['bf16_ms']:.2f} | {r['fp8_ms']:.2f} / {r['fp8_shared_ms']:.2f} / "
                f"{r['fp8_fused_ms']:.2f} | {best:.2f}x | {best_b2b:.2f}x | {gtxt} | "
                f"{r['bf16_peak_mib']:.0f}/{r['fp8_fused_peak_mib']:.0f} | "
                f"{r['bf16_linear_saved_mib']:.0f}/{r['fp8_shared_linear_saved_mib']:.0f} "
                f"({r['linear_saved_ratio']:.2f}x) |"
            )
        fp = res["layers"][0]["fp8_param"]
        print(
            f"fp8_param weight memory: {fp['resident_mib']:.1f} MiB vs bf16 {fp['bf16_mib']:.1f} MiB "
            f"= {fp['ratio']:.3f}x (goal <= 0.55x); layer goal >= 1.35x"
        )


def _geomean(values):
    values = list(values)
    return math.exp(statistics.mean(math.log(v) for v in values)) if values else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="auto", help="jetrl.gemm backend (auto, deepgemm, torch-blockwise)")
    ap.add_argument("--tokens", default="8192,16384")
    ap.add_argument("--quantize-impl", default="kernels", choices=["kernels", "kernels+compose", "reference"])
    ap.add_argument("--skip-layer", action="store_true")
    ap.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time every step replayed from a CUDA graph (CUDA only; after all eager numbers)",
    )
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (any device) to test the script")
    ap.add_argument("--out", default=None, help="output JSON path (default scripts/results/linear-<gpu>.json)")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    set_quantize_impl(args.quantize_impl)
    backend = get_backend(args.backend)
    recipe = Recipe.from_name("jetrl-unified")
    tokens = [128, 256] if args.smoke else [int(t) for t in args.tokens.split(",")]
    shapes = SMOKE_LINEARS if args.smoke else LINEARS
    dims = SMOKE_LAYER if args.smoke else LAYER
    graphs = args.cuda_graphs and dev.type == "cuda"
    gpu = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    res = {
        "gpu": gpu,
        **versions(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "backend": backend.name,
        "quantize_impl": args.quantize_impl,
        "quantize_paths": quantize_paths(),
        "cuda_graphs": graphs if args.cuda_graphs else False,
        "headline": (
            "eager (eager training): *_ms = one synchronised step, *_b2b_ms = steps issued back to back (a "
            "training loop's steady state); *_graph_* = the same step replayed from a CUDA graph (GPU-bound)"
        ),
        "goals": {"linear_speedup": 1.5, "layer_speedup": 1.35, "linear_saved_ratio": "~0.5", "fp8_param": 0.55},
        "linears": [],
        "layers": [],
        "elapsed_s": {},
    }
    path = args.out or os.path.join(
        os.path.dirname(os.path.abspath(__file__)),
        "results",
        f"linear-{benchmeta.device_tag(gpu)}{'-smoke' if args.smoke else ''}.json",
    )
    print(f"# {gpu} | torch {res['torch']} | triton {res['triton']} | deep_gemm {res['deep_gemm']}")
    print(f"# backend {backend.name} | quantize paths {res['quantize_paths']} | cuda graphs {graphs}")

    # 1. Linears, eager
    for name, n, k in shapes:
        for t in tokens:
            row = bench_linear(LinearCase(name, n, k, t, backend, recipe, dev), dev)
            res["linears"].append(row)
            print(
                f"linear {name:9s} T={t:6d}  bf16 {row['bf16_ms']:7.3f} ms | fp8 {row['fp8_ms']:7.3f} ms "
                f"({row['speedup']:.2f}x; cached W {row['speedup_cached_w']:.2f}x; back to back "
                f"{row['speedup_b2b']:.2f}x) | issue ms bf16 "
                f"{row['bf16_issue_ms']:.3f} fp8 {row['fp8_issue_ms']:.3f} "
                f"(custom ops {row['fp8_custom_ops_issue_ms']:.3f}) "
                f"| sqnr {row['fwd_sqnr_vs_bf16_db']:.1f} dB",
                flush=True,
            )
    res["linear_speedup_geomean"] = _geomean(r["speedup"] for r in res["linears"])
    res["linear_speedup_b2b_geomean"] = _geomean(r["speedup_b2b"] for r in res["linears"])
    res["elapsed_s"]["linears"] = time.perf_counter() - t_start
    if dev.type == "cuda":
        name, n, k = shapes[1]
        prof = profile_linear(name, n, k, tokens[0], backend, recipe, dev)
        res["profile"] = prof
        print(
            f"profile {name} T={tokens[0]}: GPU {prof['gpu_kernel_ms']:.3f} ms/step (profiler rows, CPU-op rows "
            f"double-count), host issue fp8 {prof['fp8_host_issue_ms']:.3f} ms vs bf16 "
            f"{prof['bf16_host_issue_ms']:.3f} ms"
        )
        for r in prof["kernels"]:
            print(f"   {r['ms']:7.3f} ms  x{r['calls']:.0f}  {r['name']}")
        lines = [ln for ln in prof["host_profile"].splitlines() if ln.strip()]
        print("\n".join(ln[:150] for ln in lines[-16:]))
        res["elapsed_s"]["profile"] = time.perf_counter() - t_start
    # 2./3. Decoder layer, eager
    if not args.skip_layer:
        for t in tokens:
            r = bench_layer(t, backend, recipe, dev, dims)
            res["layers"].append(r)
            print(
                f"layer T={r['tokens']}: bf16 {r['bf16_ms']:.2f} ms | fp8 {r['fp8_ms']:.2f} | shared "
                f"{r['fp8_shared_ms']:.2f} | fused {r['fp8_fused_ms']:.2f} ms",
                flush=True,
            )
        res["elapsed_s"]["layers"] = time.perf_counter() - t_start
    _write(res, path)
    # 4. CUDA graphs, after every eager number is on disk
    if graphs:
        for row in res["linears"]:
            case = LinearCase(row["linear"], row["N"], row["K"], row["tokens"], backend, recipe, dev)
            row.update(_graphed(bench_linear_graphed, case, dev))
            del case
            torch.cuda.empty_cache()
            if "fp8_graph_ms" in row:
                print(
                    f"graphed {row['linear']:9s} T={row['tokens']:6d}  bf16 {row['bf16_graph_ms']:.3f} ms | fp8 "
                    f"{row['fp8_graph_ms']:.3f} ms ({row['speedup_graph']:.2f}x; cached W "
                    f"{row['speedup_cached_w_graph']:.2f}x)",
                    flush=True,
                )
        ok = [r["speedup_graph"] for r in res["linears"] if "speedup_graph" in r]
        if len(ok) == len(res["linears"]):
            res["linear_speedup_graph_geomean"] = _geomean(ok)
        res["elapsed_s"]["linears_graphed"] = time.perf_counter() - t_start
        for r in res["layers"]:
            r.update(_graphed(bench_layer_graphed, r["tokens"], backend, recipe, dev, dims))
        res["elapsed_s"]["layers_graphed"] = time.perf_counter() - t_start
        _write(res, path)
    _print_tables(res)
    print(f"wrote {path} ({time.perf_counter() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
