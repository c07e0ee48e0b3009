"""Benchmark the FP8 Linear and a Llama-3.1-8B-shaped decoder layer against BF16 on one GPU.

Measures (median of CUDA-event timings after warm-up; DeepGEMM JIT-compiles each new shape first):

1. Linear fwd+bwd at Llama-8B shapes (qkv 6144x4096, o 4096x4096, gate_up 28672x4096, down 4096x14336)
   for 8192 and 16384 tokens: bf16 ``nn.Linear`` vs `JetFP8Linear` including every quantize and
   transpose (X 1x128, dY 1x128 and 128x1, X^T requantize, W 128x128 + transpose re-done every
   iteration, i.e. one micro-batch per optimizer step: the worst case).
2. One decoder layer (RMSNorm, GQA attention through SDPA, SwiGLU MLP; random weights) fwd+bwd, BF16
   vs FP8 (projections converted by `jetrl.convert.convert_model`; the normed hidden state quantized
   once and shared by q/k/v and gate/up via `attach_quantized`): time, peak memory, bytes saved for
   backward (all, and by the Linears alone).
3. fp8_param: the layer's Linear weight memory with fp8 bytes + scales vs BF16.

Prints a table and writes scripts/results/linear-<gpu>.json (or --out). ``--smoke`` runs tiny shapes
on any device (CPU: emulated backend) to check the script itself.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from jetrl.convert import convert_model
from jetrl.fp8_param import enable_fp8_params, weight_memory_report
from jetrl.gemm import get_backend
from jetrl.gemm.quantize import quantize_1x128, quantize_paths, set_quantize_impl
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


# -------------------------------------------------------------------------------------------------
# 1. Linears
# -------------------------------------------------------------------------------------------------
def bench_linear(name, n, k, tokens, backend, recipe, dev):
    torch.manual_seed(0)
    lin = nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
    x = torch.randn(tokens, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, n, device=dev, dtype=torch.bfloat16)

    def step(mod, requantize):
        def run():
            x.grad = None
            mod.weight.grad = None
            if requantize:
                mod.invalidate_fp8_weight()
            mod(x).backward(dy)

        return run

    flops = 6.0 * tokens * n * k
    row = {"linear": name, "N": n, "K": k, "tokens": tokens}
    row["bf16_ms"] = timeit(step(lin, False), dev)
    fp8 = JetFP8Linear.from_linear(lin, recipe=recipe, backend=backend, layer_name=name)
    row["fp8_ms"] = timeit(step(fp8, True), dev)
    row["fp8_cached_w_ms"] = timeit(step(fp8, False), dev)
    for key in ("bf16", "fp8", "fp8_cached_w"):
        row[f"{key}_tflops"] = flops / row[f"{key}_ms"] / 1e9
    row["speedup"] = row["bf16_ms"] / row["fp8_ms"]
    row["speedup_cached_w"] = row["bf16_ms"] / row["fp8_cached_w_ms"]
    # numerics vs bf16 (same inputs)
    with torch.no_grad():
        row["fwd_sqnr_vs_bf16_db"] = sqnr_db(lin(x), fp8(x))
    return row


def host_ms(fn, dev, n=10) -> float:
    """Milliseconds the host needs to issue fn() (no synchronisation inside the loop): when this is close
    to the event-timed GPU time, the step is bound by launch/Python overhead, not by the GPU."""
    fn()
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    sync(dev)
    return (t1 - t0) * 1e3 / n


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
        self.mlp = nn.Module()
        self.mlp.gate_proj = lin(hidden, inter)
        self.mlp.up_proj = lin(hidden, inter)
        self.mlp.down_proj = lin(inter, hidden)
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
        m = self.mlp
        return x + m.down_proj(F.silu(m.gate_proj(h)) * m.up_proj(h))


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


def bench_layer(tokens, backend, recipe, dev, dims):
    torch.manual_seed(0)
    seq = dims["seq"]
    bsz = max(1, tokens // seq)
    out = {"tokens": bsz * seq, "batch": bsz, "seq": seq}
    x = torch.randn(bsz, seq, dims["hidden"], device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    layer = DecoderLayer(**{k: v for k, v in dims.items() if k != "seq"}, device=dev)

    def run():
        x.grad = None
        for p in layer.parameters():
            p.grad = None
        invalidate_fp8_caches(layer)  # one micro-batch per optimizer step: W re-quantized every iteration
        layer(x).backward(dy)

    def peak():
        if dev.type != "cuda":
            return float("nan")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20

    with torch.no_grad():
        y_bf16 = layer(x)
    out["bf16_ms"] = timeit(run, dev)
    out["bf16_peak_mib"] = peak()
    out["bf16_saved_mib"], out["bf16_linear_saved_mib"] = (v / 2**20 for v in saved_bytes(layer, x, dy))
    convert_model(layer, recipe, backend=backend)
    for shared in (False, True):
        layer.share_quantized = shared
        tag = "fp8_shared" if shared else "fp8"
        out[f"{tag}_ms"] = timeit(run, dev)
        out[f"{tag}_peak_mib"] = peak()
        out[f"{tag}_saved_mib"], out[f"{tag}_linear_saved_mib"] = (v / 2**20 for v in saved_bytes(layer, x, dy))
        out[f"{tag}_speedup"] = out["bf16_ms"] / out[f"{tag}_ms"]
        with torch.no_grad():
            out[f"{tag}_fwd_sqnr_vs_bf16_db"] = sqnr_db(y_bf16, layer(x))
    out["linear_saved_ratio"] = out["fp8_shared_linear_saved_mib"] / out["bf16_linear_saved_mib"]
    # 3. fp8_param on this layer
    before = torch.cuda.memory_allocated() if dev.type == "cuda" else 0
    params = enable_fp8_params(layer)
    rep = weight_memory_report(layer)
    out["fp8_param"] = {**rep, "bf16_mib": rep["bf16_bytes"] / 2**20, "resident_mib": rep["resident_bytes"] / 2**20}
    if dev.type == "cuda":
        # net change of allocated memory: + fp32 masters + fp8 bytes/scales - bf16 weights - the cached
        # fp8 weight copies (q and q_t) the converted layer held before
        out["fp8_param"]["allocated_delta_mib"] = (torch.cuda.memory_allocated() - before) / 2**20
    layer.share_quantized = True
    out["fp8_param_ms"] = timeit(lambda: (layer(x).backward(dy), params.requantize()), dev)
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="auto", help="jetrl.gemm backend (auto, deepgemm, torch-blockwise)")
    ap.add_argument("--tokens", default="8192,16384")
    ap.add_argument("--quantize-impl", default="kernels", choices=["kernels", "kernels+compose", "reference"])
    ap.add_argument("--skip-layer", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (any device) to test the script")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    set_quantize_impl(args.quantize_impl)
    backend = get_backend(args.backend)
    recipe = Recipe.from_name("jetrl-unified")
    tokens = [128, 256] if args.smoke else [int(t) for t in args.tokens.split(",")]
    gpu = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    res = {
        "gpu": gpu,
        **versions(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "backend": backend.name,
        "quantize_impl": args.quantize_impl,
        "quantize_paths": quantize_paths(),
        "goals": {"linear_speedup": 1.5, "layer_speedup": 1.35, "linear_saved_ratio": "~0.5", "fp8_param": 0.55},
        "linears": [],
        "layers": [],
    }
    print(f"# {gpu} | torch {res['torch']} | triton {res['triton']} | deep_gemm {res['deep_gemm']}")
    print(f"# backend {backend.name} | quantize paths {res['quantize_paths']}")
    for name, n, k in SMOKE_LINEARS if args.smoke else LINEARS:
        for t in tokens:
            row = bench_linear(name, n, k, t, backend, recipe, dev)
            res["linears"].append(row)
            print(
                f"linear {name:9s} T={t:6d}  bf16 {row['bf16_ms']:7.3f} ms {row['bf16_tflops']:6.0f} TF | fp8 "
                f"{row['fp8_ms']:7.3f} ms {row['fp8_tflops']:6.0f} TF ({row['speedup']:.2f}x; cached W "
                f"{row['speedup_cached_w']:.2f}x) | sqnr {row['fwd_sqnr_vs_bf16_db']:.1f} dB"
            )
    if not args.smoke or dev.type == "cuda":
        name, n, k = (SMOKE_LINEARS if args.smoke else LINEARS)[1]
        prof = profile_linear(name, n, k, tokens[0], backend, recipe, dev)
        res["profile"] = prof
        print(
            f"profile {name} T={tokens[0]}: GPU kernels {prof['gpu_kernel_ms']:.3f} ms/step, host issue "
            f"fp8 {prof['fp8_host_issue_ms']:.3f} ms vs bf16 {prof['bf16_host_issue_ms']:.3f} ms"
        )
        for r in prof["kernels"]:
            print(f"   {r['ms']:7.3f} ms  x{r['calls']:.0f}  {r['name']}")
        if "torch_blockwise_ms" in prof:
            print(
                f"   torch-blockwise backend: {prof['torch_blockwise_ms']:.3f} ms/step, host issue "
                f"{prof['torch_blockwise_host_issue_ms']:.3f} ms"
            )
        lines = [ln for ln in prof["host_profile"].splitlines() if ln.strip()]
        print("\n".join(ln[:150] for ln in lines[-18:]))
    if not args.skip_layer:
        for t in tokens:
            r = bench_layer(t, backend, recipe, dev, SMOKE_LAYER if args.smoke else LAYER)
            res["layers"].append(r)
    print()
    print("| linear | T | bf16 ms | fp8 ms | speedup | speedup (W cached) | fp8 TFLOP/s |")
    print("|---|---|---|---|---|---|---|")
    for r in res["linears"]:
        print(
            f"| {r['linear']} {r['N']}x{r['K']} | {r['tokens']} | {r['bf16_ms']:.3f} | {r['fp8_ms']:.3f} | "
            f"{r['speedup']:.2f}x | {r['speedup_cached_w']:.2f}x | {r['fp8_tflops']:.0f} |"
        )
    if res["linears"]:
        g = math.exp(statistics.mean(math.log(r["speedup"]) for r in res["linears"]))
        res["linear_speedup_geomean"] = g
        print(f"geomean Linear speedup {g:.2f}x (goal >= 1.5x)")
    if res["layers"]:
        print()
        print("| layer T | bf16 ms | fp8 ms | fp8+shared-q ms | speedup | peak MiB bf16/fp8 | Linear saved MiB |")
        print("|---|---|---|---|---|---|---|")
        for r in res["layers"]:
            print(
                f"| {r['tokens']} | {r['bf16_ms']:.2f} | {r['fp8_ms']:.2f} | {r['fp8_shared_ms']:.2f} | "
                f"{r['fp8_shared_speedup']:.2f}x | {r['bf16_peak_mib']:.0f}/{r['fp8_shared_peak_mib']:.0f} | "
                f"{r['bf16_linear_saved_mib']:.0f}/{r['fp8_shared_linear_saved_mib']:.0f} "
                f"({r['linear_saved_ratio']:.2f}x) |"
            )
        fp = res["layers"][0]["fp8_param"]
        print(
            f"fp8_param weight memory: {fp['resident_mib']:.1f} MiB vs bf16 {fp['bf16_mib']:.1f} MiB "
            f"= {fp['ratio']:.3f}x (goal <= 0.55x)"
        )
    path = args.out or os.path.join(
        os.path.dirname(os.path.abspath(__file__)),
        "results",
        "linear-" + re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-") + ("-smoke" if args.smoke else "") + ".json",
    )
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(res, f, indent=1, default=str)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
