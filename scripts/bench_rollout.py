"""Rollout benchmark: decode tokens/s per rollout precision, and weight-sync seconds/bytes.

GPU (H200, vllm>=0.24 with DeepGEMM): a Llama-3.1-8B-shaped model with random weights
(``load_format="dummy"``, config written locally, no download), 256 prompt tokens, 256 (batch 64) and
512 (batch 256) output tokens, for

- ``bf16``          plain vLLM BF16 (``jetrl_bf16``: vLLM's unquantized Linear),
- ``jetrl_fp8``     jetrl-unified through jetrl's vLLM method (`jetrl.gemm.linear_fp8`, backend auto),
- ``stock_fp8``     vLLM's own block-FP8 path with jetrl's settings (`adapter.stock_vllm_settings`),

then a full weight sync of an 8B trainer model (HF Llama on the same GPU, converted with
`jetrl.convert.convert_model`) into the ``jetrl_fp8`` engine: bytes and seconds (first sync includes
quantizing the trainer's weights once and any JIT; the second is a repeat with unchanged weights; the
third follows an in-place update of every trainer weight, as after an optimizer step, so it includes
re-quantizing all of them: the sync an RL step pays). Reference (NUMERICS.md):
stock vLLM 0.26 BF16 8.5k / 16.3k tok/s, block-FP8 10.8k / 19.6k at batch 64 / 256.

``--layers N`` keeps N of the 32 decoder layers and ``--shapes B:IN:OUT,...`` replaces the decode shapes
(e.g. ``--layers 8 --shapes 256:16:2048``: the rollout of ``bench_e2e.py --shape llama3.1-8b --layers 8
--max-tokens 2048``). ``--profile`` then runs one more generate at the last shape (``--profile-tokens``
output tokens) under torch.profiler and keeps per mode the wall and GPU-busy milliseconds per output token
step (its prefill included) and the kernels with the most GPU time: where a decode step's time goes (GPU
kernels, or the host between them), measured. ``--host-profile`` runs the same generate under cProfile: the
Python functions that spend the host time, per step. ``--multiprocess`` (vLLM's engine core in its own
process) and ``--executor mp`` (the model in a worker process of its own) run the engine as verl's rollout
servers do (both: verl's layout); neither allows ``--host-profile`` (the model is in another process), a weight
sync then travels to the model's process in `jetrl.rollout.transfer` parcels (CUDA IPC handles on a GPU; only
for the ``--sync-modes`` named: none by default), and ``--profile`` records the model's process with vLLM's own
profiler (its trace's GPU time against the generate's wall time here). Every timed decode run also records
vLLM's engine core per step, wherever it runs (``engine_core_ms``: wall, the time in ``schedule`` and
``update_from_output``, and the hand-off between them, where the engine core passes the step to the model and waits
for an output; `jetrl.rollout.engine_timing`): whether the scheduler's host work paces the step.
``--engines N`` (with ``--multiprocess``) starts N engines of each mode on the one device and splits every decode's
batch between them (`jetrl.rollout.group.EngineGroup`): N engine cores, each pacing its own steps in a process of
its own, against one.

CPU (``--tiny``): the same flow on the tiny Qwen3 (`jetrl.tiny`) with the emulated GEMM backend, plus
the log-prob mismatch per recipe; stock FP8 is reported as unavailable (vLLM's CPU block-FP8 path needs
Intel AMX). Writes scripts/results/rollout-<cpu|gpu>.json and prints a table.

    python scripts/bench_rollout.py --tiny
    python scripts/bench_rollout.py            # on the H200
    python scripts/bench_rollout.py --layers 8 --shapes 256:16:2048 --profile --modes bf16 jetrl_fp8
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import benchmeta
from profiling import profile_cuda, profile_host, profile_worker, worker_profiler_config
from shape_model import reusable_model_dir

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")

ARG_DEFAULTS = {"multiprocess": False, "executor": "uni", "engines": 1}
"""Engine settings a result JSON from before the option existed ran with (``--merge`` compares them)."""

LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}
"""Llama-3.1-8B's published architecture (no weights)."""

MODES = {
    "bf16": ("bf16", "jetrl"),
    "jetrl_fp8": ("jetrl-unified", "jetrl"),
    "stock_fp8": ("jetrl-unified", "stock"),
    "naive_fp8": ("naive-fp8-rollout", "jetrl"),
    "stock_naive_fp8": ("naive-fp8-rollout", "stock"),
    "bf16_hf_ops": ("bf16", "jetrl"),
    "jetrl_fp8_hf_ops": ("jetrl-unified", "jetrl"),
    "jetrl_fp8_fused_ops": ("jetrl-unified", "jetrl"),
}
"""mode -> (recipe, rollout). naive_fp8 is jetrl's emulation (CPU); stock_naive_fp8 is vLLM's own online
per-tensor FP8 (GPU)."""
ENGINE_OPS = {"bf16_hf_ops": "hf", "jetrl_fp8_hf_ops": "hf", "jetrl_fp8_fused_ops": "fused"}
"""Modes on `jetrl.rollout.vllm_model`'s trainer-matched model (the cost of the trainer's ops in the engine);
the others run vLLM's own model."""
DEFAULT_MODES = {"cpu": ["bf16", "jetrl_fp8", "naive_fp8", "stock_fp8"], "gpu": ["bf16", "jetrl_fp8", "stock_fp8"]}


def _prompts(batch: int, in_len: int, vocab: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, in_len), generator=g).tolist()


def _decode(engine, shape: tuple[int, int, int], vocab: int, seed: int, repeats: int, mode: str) -> dict:
    """Median decode throughput over `repeats` timed runs (after one warm-up) of ``shape = (batch, input_len,
    output_len)`` random prompts. Each run's figure is printed as it ends, so a call cut short by its time
    limit (the JSON is written once the mode ends) still leaves them in its log."""
    import statistics

    from jetrl.rollout.engine_timing import recorded

    batch, in_len, out_len = shape
    prompts = _prompts(batch, in_len, vocab, seed)
    kw = {"seed": seed, "ignore_eos": True}
    engine.generate(prompts, max_tokens=min(out_len, 8), **kw)  # warm-up at this batch
    runs, cores = [], []
    for _ in range(repeats):
        start, t0 = time.time(), time.perf_counter()
        samples = engine.generate(prompts, max_tokens=out_len, **kw)
        dt = time.perf_counter() - t0
        runs.append(sum(len(s.response_ids) for s in samples) / dt)
        core = recorded(start, time.time())  # vLLM's engine core in this run, per step (`run` has it record)
        if core is not None:
            cores.append(core["per_step_ms"])
        print(
            f"[{mode}] batch {batch} x ({in_len} + {out_len}): run {len(runs)}/{repeats} {runs[-1]:.1f} tok/s "
            f"in {dt:.2f} s"
            + (
                f"; engine core {cores[-1]['wall']:.2f} ms/step, schedule + update "
                f"{cores[-1]['schedule'] + cores[-1]['update']:.2f}, hand-off {cores[-1]['handoff']:.2f}"
                if cores
                else ""
            ),
            flush=True,
        )
    return {
        "batch": batch,
        "input_len": in_len,
        "output_len": out_len,
        "tok_s": statistics.median(runs),
        "tok_s_runs": runs,
        # per engine step, the median over the runs: wall, schedule, update
        **({"engine_core_ms": {k: statistics.median(c[k] for c in cores) for k in cores[0]}} if cores else {}),
    }


def _model_config(args) -> dict:
    """`LLAMA_8B` with ``--layers`` decoder layers."""
    return {**LLAMA_8B, "num_hidden_layers": args.layers}


def _model_dir(args, tmp: Path) -> tuple[Path, int]:
    if args.tiny:
        from jetrl.tiny import save_tiny_checkpoint

        return save_tiny_checkpoint(tmp / "tiny", seed=0), 78
    config = json.dumps(_model_config(args), indent=2)
    d = reusable_model_dir(f"llama-8b-shape-l{args.layers}", lambda d: (d / "config.json").write_text(config))
    return d, LLAMA_8B["vocab_size"]


def _profile(
    engine, batch: int, in_len: int, tokens: int, vocab: int, host: bool = False, trace_dir: Path | None = None
) -> dict:
    """`profiling.profile_cuda` (`host`: `profiling.profile_host`) of one generate of `batch` prompts x `tokens`
    output tokens, after a warm-up at the same shape. With `trace_dir` the model runs in another process
    (`profiling.profile_worker`)."""
    prompts = _prompts(batch, in_len, vocab, 1)

    def generate():
        return engine.generate(prompts, max_tokens=tokens, seed=1, ignore_eos=True)

    generate()
    if trace_dir is not None:
        summary = profile_worker(engine, generate, tokens, trace_dir)
    else:
        summary = (profile_host if host else profile_cuda)(generate, steps=tokens)
    return {"batch": batch, "input_len": in_len, **summary}


def _trainer(args, recipe):
    import torch

    from jetrl.convert import convert_model

    if args.tiny:
        from jetrl.tiny import build_tiny_model

        model = build_tiny_model(1)
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        with torch.device("cuda"):
            model = LlamaForCausalLM(LlamaConfig(**_model_config(args))).to(torch.bfloat16)
    if recipe.train_fp8:
        convert_model(model, recipe, backend=args.backend)
    return model.eval()


def _run_mode(args, mode, recipe, rollout, path, vocab, shapes, result) -> None:
    from jetrl.rollout.adapter import create_engine
    from jetrl.rollout.group import start_engines

    kw = {"load_format": "dummy"} if not args.tiny else {}
    if args.tiny:
        kw["kv_cache_memory_bytes"] = 64 << 20
    else:
        kw["gpu_memory_utilization"] = args.gpu_memory_utilization
        kw["skip_tokenizer_init"] = True
        if not args.enforce_eager and args.capture_sizes:
            kw["compilation_config"] = {"cudagraph_capture_sizes": args.capture_sizes}
    if args.executor != "uni":
        kw["distributed_executor_backend"] = args.executor
    trace_dir = None
    if args.profile and _out_of_process(args):  # vLLM's profiler records the model's process
        trace_dir = Path(tempfile.mkdtemp(prefix=f"jetrl-trace-{mode}-"))
        kw["profiler_config"] = worker_profiler_config(trace_dir, python=args.profile_python)
    start = functools.partial(
        create_engine,
        path,
        recipe,
        seed=0,
        max_model_len=args.max_model_len,
        enforce_eager=args.enforce_eager,
        rollout=rollout,
        backend=args.backend,
        in_process=not args.multiprocess,
        engine_ops=ENGINE_OPS.get(mode, "vllm"),
        **kw,
    )
    try:
        engine = start_engines(start, args.engines)
        try:
            _measure(args, mode, recipe, engine, vocab, shapes, result, trace_dir)
        finally:
            engine.close()
    finally:
        if trace_dir is not None:
            shutil.rmtree(trace_dir, ignore_errors=True)


def _out_of_process(args) -> bool:
    """Whether the model runs in another process than this one (``--multiprocess`` or ``--executor mp``)."""
    return args.multiprocess or args.executor != "uni"


def _measure(args, mode, recipe, engine, vocab, shapes, result, trace_dir: Path | None = None) -> None:
    import torch

    from jetrl.rollout.sync import sync_weights

    result["engine_start_s"][mode] = engine.start_seconds
    result["kv_cache_tokens"][mode] = kv = engine.kv_cache_tokens
    print(f"[{mode}] engine start {engine.start_seconds:.1f} s ({engine.quantization}), KV {kv} tokens", flush=True)
    for b, i, o in shapes:
        if kv is not None and b * (i + o) > kv:
            print(f"[{mode}] batch {b} x ({i} + {o}) tokens exceeds the KV cache: vLLM preempts requests", flush=True)
    result["decode"][mode] = [_decode(engine, shape, vocab, 0, args.repeats, mode) for shape in shapes]
    b, i, _ = shapes[-1]
    if args.profile:
        result["profile"][mode] = _profile(engine, b, i, args.profile_tokens, vocab, trace_dir=trace_dir)
    if args.host_profile:
        result["host_profile"][mode] = _profile(engine, b, i, args.profile_tokens, vocab, host=True)
    if mode in args.sync_modes:
        trainer = _trainer(args, recipe)
        reports = [sync_weights(trainer, engine, recipe).to_dict() for _ in range(2)]
        with torch.no_grad():  # what an optimizer step does: new values, version counters bumped
            for prm in trainer.parameters():
                prm.mul_(1.0 - 2.0**-6)
        after = sync_weights(trainer, engine, recipe).to_dict()
        result["sync"][mode] = {"first": reports[0], "steady": reports[1], "after_update": after}
        if args.tiny:
            from jetrl.rollout.parity import logprob_mismatch
            from jetrl.tiny import CharTokenizer

            tok = CharTokenizer()
            prompts = [tok.encode(p) for p in ("12+7=", "3*4=", "100-1=", "7*8=", "hello ", "9+9+9=")]
            samples = engine.generate(prompts, n=4, max_tokens=32, seed=1234)
            result.setdefault("logprob_mismatch", {})[recipe.name] = logprob_mismatch(trainer, samples)
        del trainer


def _run_child(mode: str, tmp: Path, result: dict) -> None:
    """Run one mode in a fresh process (an in-process vLLM engine does not give all its GPU memory back
    when closed) and merge its per-mode entries into `result`."""
    import subprocess

    child_out = tmp / f"{mode}.json"
    argv, skip = [], False
    for a in sys.argv[1:]:  # drop --out / --out=X / --modes ... (replaced below)
        if a.startswith("--"):
            skip = a in ("--out", "--modes")
            if a.startswith(("--out", "--modes")):
                continue
        elif skip:
            continue
        argv.append(a)
    cmd = [sys.executable, __file__, *argv, "--modes", mode, "--no-isolate", f"--out={child_out}"]
    proc = subprocess.run(cmd, env=os.environ.copy())
    if not child_out.exists():
        raise RuntimeError(f"bench_rollout child for {mode} exited {proc.returncode} without results")
    child = json.loads(child_out.read_text())
    for key in _PER_MODE:
        result.setdefault(key, {}).update(child.get(key, {}))
    if proc.returncode != 0 and mode not in result["errors"]:
        result["errors"][mode] = f"child exited {proc.returncode}"


_PER_MODE = (
    "decode",
    "engine_start_s",
    "kv_cache_tokens",
    "sync",
    "unavailable",
    "errors",
    "logprob_mismatch",
    "profile",
    "host_profile",
)


def summarize(result: dict) -> dict:
    """Decode tok/s ratios between modes per batch size (the issue's goals: jetrl_fp8 within 5% of
    stock_fp8 and >= 1.2x bf16 at batch 256) and the jetrl_fp8 sync seconds, from `result`."""
    tok = {mode: {str(r["batch"]): r["tok_s"] for r in rows} for mode, rows in result["decode"].items()}
    out: dict = {}
    pairs = [("jetrl_fp8", "stock_fp8"), ("jetrl_fp8", "bf16"), ("stock_fp8", "bf16")]
    pairs += [("bf16_hf_ops", "bf16"), ("jetrl_fp8_hf_ops", "jetrl_fp8"), ("jetrl_fp8_fused_ops", "jetrl_fp8")]
    pairs += [("jetrl_fp8_fused_ops", "bf16"), ("jetrl_fp8_hf_ops", "bf16")]
    for a, b in pairs:
        if a in tok and b in tok:
            out[f"{a}_over_{b}"] = {k: tok[a][k] / tok[b][k] for k in tok[a] if k in tok[b]}
    for kind, r in result["sync"].get("jetrl_fp8", {}).items():
        out[f"sync_jetrl_fp8_{kind}_s"] = r["seconds"]
    return out


def merge(result: dict, earlier: dict) -> list[str]:
    """Fold the per-mode entries of an earlier run's JSON into `result` for the modes this run did not
    measure (e.g. a mode run alone because one invocation hit a time limit); returns those modes."""
    mine = {m for key in _PER_MODE for m in result.get(key, {})}
    taken = sorted({m for key in _PER_MODE for m in earlier.get(key, {})} - mine)
    for key in _PER_MODE:
        for mode in taken:
            if mode in earlier.get(key, {}):
                result.setdefault(key, {})[mode] = earlier[key][mode]
    return taken


def _save(result: dict, out: Path | None) -> None:
    result["summary"] = summarize(result)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")


@contextlib.contextmanager
def _engine_core_timing(tmp: Path):
    """The engines started inside record their engine core's steps (`jetrl.rollout.engine_timing`) under `tmp`,
    unless the environment names a folder already (a parent's run: the isolated children inherit it)."""
    from jetrl.rollout.engine_timing import ENV

    prior = os.environ.get(ENV)
    os.environ[ENV] = prior or str(tmp / "engine-core")
    try:
        yield
    finally:
        if prior is None:
            del os.environ[ENV]


def run(args, out: Path | None = None) -> dict:
    """Run every mode; the JSON at `out` is rewritten after each one, so a run cut short keeps what it
    measured. A mode that raises is recorded under ``errors`` (the others still run)."""
    import traceback

    import torch

    from jetrl.recipe import Recipe
    from jetrl.rollout.adapter import stock_block_fp8_unavailable_reason

    shapes = args.shapes or ([(8, 32, 32), (16, 32, 32)] if args.tiny else [(64, 256, 256), (256, 256, 512)])
    result = {
        "benchmark": "rollout",
        **benchmeta.meta(args.commit),
        "model": "tiny-qwen3 (jetrl.tiny)"
        if args.tiny
        else f"Llama-3.1-8B shape, {args.layers} of 32 decoder layers, random weights",
        "backend": args.backend,
        "enforce_eager": args.enforce_eager,
        "multiprocess": args.multiprocess,
        "executor": args.executor,
        "engines": args.engines,
        "cudagraph_capture_sizes": None if args.enforce_eager else args.capture_sizes,
        "repeats": args.repeats,
        "tok_s_note": "median of repeats; decode = prompts of input_len random ids, output_len tokens, ignore_eos",
        "decode": {},
        "engine_start_s": {},
        "kv_cache_tokens": {},
        "sync": {},
        "unavailable": {},
        "errors": {},
        "profile": {},
        "host_profile": {},
    }
    with tempfile.TemporaryDirectory() as tmp, _engine_core_timing(Path(tmp)):
        path, vocab = _model_dir(args, Path(tmp))
        for mode in args.modes:
            recipe_name, rollout = MODES[mode]
            recipe = Recipe.from_name(recipe_name)
            if rollout == "stock" and (reason := stock_block_fp8_unavailable_reason()) is not None:
                result["unavailable"][mode] = reason
                print(f"[{mode}] skipped: {reason}", flush=True)
                continue
            try:
                if args.isolate:
                    _run_child(mode, Path(tmp), result)
                else:
                    _run_mode(args, mode, recipe, rollout, path, vocab, shapes, result)
            except Exception:
                result["errors"][mode] = traceback.format_exc()
                print(f"[{mode}] FAILED:\n{result['errors'][mode]}", flush=True)
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            _save(result, out)
    return result


def _table(result: dict) -> str:
    engines = result.get("engines", 1)
    per_mode = f", {engines} engines per mode" if engines > 1 else ""
    lines = [f"rollout benchmark on {result['device']} ({result['model']}{per_mode})", ""]
    lines.append(f"{'mode':10s} {'batch':>5s} {'in':>5s} {'out':>5s} {'tok/s':>10s}")
    for mode, rows in result["decode"].items():
        for r in rows:
            lines.append(f"{mode:10s} {r['batch']:5d} {r['input_len']:5d} {r['output_len']:5d} {r['tok_s']:10.1f}")
    for mode, reason in result["unavailable"].items():
        lines.append(f"{mode:10s} unavailable: {reason}")
    lines.append("")
    for mode, s in result["sync"].items():
        for k, r in s.items():
            lines.append(
                f"sync {mode} ({k}): {r['bytes'] / 1e6:.2f} MB in {r['seconds']:.3f} s "
                f"(export {r['export_seconds']:.3f}, copy {r['copy_seconds']:.3f}, "
                f"verify {r['verify_seconds']:.3f}; {r['n_digests']} digests equal)"
            )
    for name, m in result.get("logprob_mismatch", {}).items():
        lines.append(f"|dlogp| {name:18s} mean {m['mean_abs']:.5f} max {m['max_abs']:.5f} ({m['tokens']} tokens)")
    for mode, pr in result.get("profile", {}).items():
        head = ", ".join(f"{k['name'][:40]} {k['share']:.0%}" for k in pr["top_kernels"][:3])
        launches = pr.get("launches_per_step")
        launched = f", {launches['graph']:.1f} graph / {launches['kernel']:.1f} kernel launches" if launches else ""
        lines.append(
            f"profile {mode} (batch {pr['batch']}): {pr['wall_ms_per_step']:.2f} ms/step wall, "
            f"{pr['gpu_busy_ms_per_step']:.2f} GPU-busy{launched}; top: {head}"
        )
        if pr.get("top_host_calls"):
            calls = ", ".join(f"{c['name']} {c['host_us_per_step'] / 1e3:.2f}" for c in pr["top_host_calls"][:3])
            busy = pr.get("host_busy_ms_per_step")
            busy = f"; busiest host thread active {busy:.2f} ms/step" if busy is not None else ""
            lines.append(f"  host CUDA calls, ms/step: {calls}{busy}")
        if pr.get("top_host_self"):
            calls = ", ".join(f"{c['name'][:60]} {c['self_us_per_step'] / 1e3:.2f}" for c in pr["top_host_self"][:4])
            lines.append(f"  host self time, ms/step: {calls}")
    for mode, hp in result.get("host_profile", {}).items():
        head = ", ".join(f"{f['function'][:48]} {f['share']:.0%}" for f in hp["top_functions"][:4])
        lines.append(
            f"host {mode} (batch {hp['batch']}): {hp['wall_ms_per_step']:.2f} ms/step "
            f"({hp['profiled_wall_ms_per_step']:.2f} profiled); top: {head}"
        )
    lines.append("engine start s: " + ", ".join(f"{k} {v:.1f}" for k, v in result["engine_start_s"].items()))
    if result.get("kv_cache_tokens"):
        lines.append("KV cache tokens: " + ", ".join(f"{k} {v}" for k, v in result["kv_cache_tokens"].items()))
    return "\n".join(lines)


def _shapes(value: str) -> list[tuple[int, int, int]]:
    """``"256:16:2048,64:256:256"`` -> ``[(256, 16, 2048), (64, 256, 256)]`` (argparse type: a bad item is named)."""
    out = []
    for item in value.split(","):
        parts = item.split(":")
        if len(parts) != 3 or not all(x.isdigit() and int(x) > 0 for x in parts):
            raise argparse.ArgumentTypeError(f"{item!r} is not batch:input_len:output_len (positive integers)")
        out.append(tuple(int(x) for x in parts))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny Qwen3 on CPU (emulated GEMM) instead of 8B on a GPU")
    p.add_argument("--modes", nargs="+", default=None, choices=list(MODES))
    p.add_argument("--sync-modes", nargs="*", default=None, help="modes whose engine receives a timed weight sync")
    p.add_argument("--backend", default=None, help="jetrl.gemm backend (default: emulated with --tiny, else auto)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs / torch.compile (always on CPU)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.45)
    p.add_argument(
        "--capture-sizes",
        type=lambda v: [int(x) for x in v.split(",") if x],
        default=[1, 2, 4, 8, 16, 32, 64, 128, 256],
        help="decode batch sizes vLLM captures CUDA graphs for (comma list; '' = vLLM's default list)",
    )
    p.add_argument("--repeats", type=int, default=3, help="timed decode runs per shape (median reported)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--layers", type=int, default=32, help="decoder layers of the Llama-3.1-8B shape (GPU)")
    p.add_argument(
        "--shapes",
        type=_shapes,
        default=None,
        help="decode shapes batch:input_len:output_len, comma-separated (default 64:256:256,256:256:512)",
    )
    p.add_argument("--profile", action="store_true", help="profile one generate per mode at the last shape (GPU)")
    p.add_argument("--profile-tokens", type=int, default=64, help="output tokens of the profiled generate")
    p.add_argument(
        "--profile-python",
        action="store_true",
        help="with --profile of a model in another process: record its Python calls too (the worker's functions "
        "by self time, e.g. waiting on vLLM's message queue; slows the profiled generate)",
    )
    p.add_argument(
        "--host-profile",
        action="store_true",
        help="one more generate at the last shape under cProfile: the Python functions spending host time",
    )
    p.add_argument(
        "--multiprocess",
        action="store_true",
        help="vLLM's engine core in its own process (VLLM_ENABLE_V1_MULTIPROCESSING=1, as verl's rollout servers "
        "run it): its scheduling overlaps this process's output processing; no --host-profile (it needs the model in "
        "this process; --profile uses vLLM's profiler); weight syncs only for the --sync-modes named (IPC parcels)",
    )
    p.add_argument(
        "--executor",
        choices=("uni", "mp"),
        default="uni",
        help="vLLM's executor (distributed_executor_backend): 'uni' runs the model in the engine core's process "
        "(vLLM's default for one GPU); 'mp' in a worker process of its own, as verl's rollout servers start it; no "
        "--host-profile with 'mp' (--profile uses vLLM's profiler); weight syncs only for the --sync-modes named",
    )
    p.add_argument(
        "--isolate",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run every mode in this process (default on CPU; on a GPU each mode gets its own process)",
    )
    p.add_argument(
        "--engines",
        type=int,
        default=1,
        help="engines per mode on the one device, each with its own engine core process (needs --multiprocess) "
        "and --gpu-memory-utilization of its own; a decode splits the batch between them: whether two schedulers "
        "side by side beat one (no --profile, --host-profile or --sync-modes)",
    )
    p.add_argument("--commit", help="the checkout's commit, recorded (the device machine has no git)")
    p.add_argument("--out", default=None, help="JSON path (default scripts/results/rollout-<cpu|gpu>.json)")
    p.add_argument(
        "--merge",
        default=None,
        help="an earlier run's JSON whose modes this run did not measure are folded into the output "
        "(recorded under merged_from)",
    )
    args = p.parse_args(argv)
    if args.tiny and (args.profile or args.layers != 32):
        p.error("--profile and --layers are for the GPU's Llama-3.1-8B shape, not --tiny")
    if not 1 <= args.layers <= 32:
        p.error(f"--layers {args.layers}: the Llama-3.1-8B shape has 1 to 32 decoder layers")
    if args.profile_python and not (args.profile and (args.multiprocess or args.executor != "uni")):
        p.error("--profile-python is for --profile with --executor mp or --multiprocess (vLLM's profiler)")
    if args.profile_tokens < 1:
        p.error(f"--profile-tokens {args.profile_tokens} must be >= 1")
    if args.engines < 1:
        p.error(f"--engines {args.engines} must be >= 1")
    if args.engines > 1 and not args.multiprocess:
        p.error("--engines > 1 needs --multiprocess: engine cores in this process would share its interpreter lock")
    if args.engines > 1 and (args.profile or args.host_profile or args.sync_modes):
        p.error("--engines > 1 times decodes only: no --profile, --host-profile or --sync-modes")
    if args.backend is None:
        args.backend = "emulated" if args.tiny else "auto"
    if args.tiny:
        args.enforce_eager = True
    if args.modes is None:
        args.modes = DEFAULT_MODES["cpu" if args.tiny else "gpu"]
    out_of_process = _out_of_process(args)
    if out_of_process and args.host_profile:
        p.error("--multiprocess and --executor mp run the model in another process: no --host-profile "
                "(--profile records that process with vLLM's profiler)")  # fmt: skip
    if args.sync_modes is None:
        args.sync_modes = [] if out_of_process else ["bf16", "jetrl_fp8", "naive_fp8"] if args.tiny else ["jetrl_fp8"]
    earlier = json.loads(Path(args.merge).read_text()) if args.merge else None
    for key, value in (("multiprocess", args.multiprocess), ("executor", args.executor), ("engines", args.engines)):
        theirs = earlier.get(key, ARG_DEFAULTS[key]) if earlier is not None else value
        if theirs != value:
            p.error(f"--merge {args.merge}: its engines ran with {key}={theirs}, this run with {value}; their decode "
                    "speeds do not compare")  # fmt: skip
    if args.isolate is None:
        args.isolate = not args.tiny and len(args.modes) > 1
    need = max((i + o for _, i, o in args.shapes or []), default=0)
    if args.max_model_len is None:
        args.max_model_len = max(128 if args.tiny else 1024, need)
    elif args.max_model_len < need:
        p.error(f"--max-model-len {args.max_model_len} is shorter than a --shapes prompt + output ({need} tokens)")
    out = Path(args.out or Path(__file__).parent / "results" / f"rollout-{'cpu' if args.tiny else 'gpu'}.json")
    result = run(args, out)
    if earlier is not None:
        taken = merge(result, earlier)
        result["merged_from"] = {"path": args.merge, "date": earlier.get("date"), "modes": taken}
    _save(result, out)
    print(_table(result))
    print(f"wrote {out}")
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
