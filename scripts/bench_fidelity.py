"""On-policy fidelity: how far the rollout engine's log-probs are from the trainer's, per recipe.

For each mode -- ``bf16``, ``naive_fp8`` (jetrl's ``jetrl_fp8_naive``), ``jetrl_fp8`` (jetrl-unified through
jetrl's vLLM method) and ``stock_fp8`` (vLLM's own block FP8 with `jetrl.rollout.adapter.stock_vllm_settings`)
-- a vLLM engine (CUDA graphs on, unless ``--enforce-eager``) is started on the same warmed-up checkpoint,
the trainer (the HF model on the same device, converted per recipe) is synced into it with
`jetrl.rollout.sync.sync_weights` (byte digests verified), the same prompts are sampled with the same
seeds, and the trainer scores the very tokens sampled (`jetrl.rollout.parity.token_mismatch`). Reported
per mode: mean, p99 and max |dlogp|, the IS ratio ``exp(logp_trainer - logp_rollout)``'s mean and max,
the trainer's entropy at the sampled positions (the distribution must be peaked for the mismatch to
show), all over every response token and over the tokens up to each response's first EOS, and
|dlogp| per token-position bin. Responses run to ``--max-tokens`` (``ignore_eos``).

The ``*_hf_ops`` / ``*_fused_ops`` modes (``--modes``; not in the default set) start the engine on
`jetrl.rollout.vllm_model`'s trainer-matched model (``engine_ops``): vLLM with the trainer's own ops between
the Linears (norms, residual adds, RoPE, SiLU-and-mul; ``fused``: through the trainer's fused producer
kernels, and the trainer converted with them), leaving attention and lm_head as vLLM computes them. The
``*_strict`` modes (CUDA) add `jetrl.rollout.engine_strict`: the engine in vLLM's batch-invariant mode and
the trainer attending through vLLM's FlashAttention forward and scoring with its sampler's log-prob kernel.

Model: the tiny Qwen3 (`jetrl.tiny`, ``--model-overrides`` JSON to change its shape) after jetrl's
supervised warm-up on the arithmetic task (`jetrl.train.warmup.supervised_warmup`, on the CPU as `jetrl train` runs it).

    python scripts/bench_fidelity.py --out scripts/results/fidelity-nvidia-h200.json   # H200, vLLM 0.26
    python scripts/bench_fidelity.py --enforce-eager --max-tokens 48 --prompts 4 --warmup-steps 30  # CPU smoke
    python scripts/bench_fidelity.py --plot-only scripts/results/fidelity-nvidia-h200.json

Each mode runs in its own process on a GPU (an in-process vLLM engine does not give all its memory back).
The JSON is rewritten after each mode; a PNG plot (``--plot``, default: the JSON path with .png) is drawn
from the JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import benchmeta

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")

MODES = {
    "bf16": ("bf16", "jetrl"),
    "naive_fp8": ("naive-fp8-rollout", "jetrl"),
    "jetrl_fp8": ("jetrl-unified", "jetrl"),
    "stock_fp8": ("jetrl-unified", "stock"),
    "bf16_hf_ops": ("bf16", "jetrl"),
    "jetrl_fp8_hf_ops": ("jetrl-unified", "jetrl"),
    "jetrl_fp8_fused_ops": ("jetrl-unified", "jetrl"),
    "bf16_strict": ("bf16", "jetrl"),
    "jetrl_fp8_strict": ("jetrl-unified", "jetrl"),
}
"""mode -> (recipe, rollout), as `jetrl.rollout.adapter.create_engine` takes them."""
ENGINE_OPS = {
    "bf16_hf_ops": "hf",
    "jetrl_fp8_hf_ops": "hf",
    "jetrl_fp8_fused_ops": "fused",
    "bf16_strict": "hf",
    "jetrl_fp8_strict": "hf",
}
"""Modes whose engine runs the trainer's ops between the Linears (`jetrl.rollout.vllm_model`; the others:
vLLM's own model). ``fused``: the trainer runs its fused producers too (``model.fuse_producers``)."""
STRICT = ("bf16_strict", "jetrl_fp8_strict")
"""Modes with strict numerics (`jetrl.rollout.engine_strict`): the engine in vLLM's batch-invariant mode, the
trainer with vLLM's FlashAttention forward and sampler log-probs (CUDA only)."""
DEFAULT_MODES = ("bf16", "naive_fp8", "jetrl_fp8", "stock_fp8")
STAT_KEYS = ("tokens", "mean_abs", "p99_abs", "max_abs", "is_ratio_mean", "is_ratio_max", "entropy_mean", "nll_mean")
EXACT_KEYS = ("frac_equal", "frac_le_1e-6")
"""Added at 9141a2e+ (not required of older results): the share of tokens whose two log-probs are the same
fp32 number, and within 1e-6 (equal logits; the two sides' fp32 log-softmax may round apart)."""
SCHEMA_VERSION = 1


# -- configuration ---------------------------------------------------------------------------------


def _json_dict(text: str) -> dict:
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"--model-overrides: not JSON ({e})") from None
    if not isinstance(d, dict):
        raise argparse.ArgumentTypeError(f"--model-overrides: expected a JSON object, got {type(d).__name__}")
    return d


def _positive(text: str) -> int:
    v = int(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return v


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", nargs="+", default=list(DEFAULT_MODES), choices=list(MODES))
    p.add_argument("--max-tokens", type=_positive, default=8192, help="response tokens per sample (ignore_eos)")
    p.add_argument("--prompts", type=_positive, default=16, help="arithmetic prompts (one sample each)")
    p.add_argument("--samples", type=_positive, default=1, help="samples per prompt")
    p.add_argument("--seed", type=int, default=0, help="model init, warm-up, prompts and sampling seed")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--bins", type=_positive, default=16, help="token-position bins of equal width")
    p.add_argument("--warmup-steps", type=int, default=300, help="supervised warm-up steps (jetrl.train.warmup)")
    p.add_argument("--warmup-batch", type=_positive, default=64)
    p.add_argument("--warmup-lr", type=float, default=3e-3)
    p.add_argument("--model-overrides", type=_json_dict, default={}, help="JSON: tiny Qwen3 config fields")
    p.add_argument("--backend", default="auto", help="jetrl.gemm backend of the trainer and jetrl_fp8")
    p.add_argument("--enforce-eager", action="store_true", help="no torch.compile / CUDA graphs (CPU always)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                   help="one process per mode (default on a GPU)")  # fmt: skip
    p.add_argument("--checkpoint", default=None, help="(internal) the warmed-up checkpoint to use")
    p.add_argument("--out", default=None, help="JSON path (default scripts/results/fidelity-<device>.json)")
    p.add_argument("--plot", default=None, help="PNG path (default: the JSON path with .png; 'none' skips)")
    p.add_argument("--plot-only", default=None, metavar="JSON", help="draw the plot of an existing JSON and exit")
    p.add_argument("--commit", default=None, help="git commit measured (default: git rev-parse HEAD)")
    p.add_argument(
        "--merge",
        nargs="+",
        default=None,
        metavar="JSON",
        help="no run: one result (to --out) from JSONs of separate calls, same settings and model",
    )
    args = p.parse_args(argv)
    if not 0 < args.temperature:
        p.error(f"--temperature must be > 0, got {args.temperature}")
    if args.bins > args.max_tokens:
        p.error(f"--bins {args.bins} exceeds --max-tokens {args.max_tokens}")
    if args.warmup_steps < 0:
        p.error(f"--warmup-steps must be >= 0, got {args.warmup_steps}")
    return args


# -- statistics (CPU, tested) ------------------------------------------------------------------------


def stats(rollout, trainer, entropy) -> dict:
    """The fidelity figures of aligned fp32 token tensors (engine log-probs, trainer log-probs, trainer
    entropies): |dlogp| mean / p99 / max, IS ratio exp(trainer - rollout) mean / max, entropy and NLL means,
    the shares of tokens with |dlogp| == 0 and <= 1e-6."""
    import torch

    if not (rollout.shape == trainer.shape == entropy.shape) or rollout.dim() != 1:
        raise ValueError(
            f"stats: rollout {tuple(rollout.shape)}, trainer {tuple(trainer.shape)} and entropy "
            f"{tuple(entropy.shape)} must be equal 1-D shapes"
        )
    n = int(rollout.numel())
    if n == 0:
        return {"tokens": 0, **{k: None for k in STAT_KEYS[1:] + EXACT_KEYS}}
    d = (trainer - rollout).double()
    a = d.abs()
    ratio = d.exp()
    return {
        "tokens": n,
        "mean_abs": float(a.mean()),
        "p99_abs": float(torch.quantile(a, 0.99)) if n > 1 else float(a[0]),
        "max_abs": float(a.max()),
        "is_ratio_mean": float(ratio.mean()),
        "is_ratio_max": float(ratio.max()),
        "entropy_mean": float(entropy.double().mean()),
        "nll_mean": float(-trainer.double().mean()),
        "frac_equal": float((a == 0).double().mean()),
        "frac_le_1e-6": float((a <= 1e-6).double().mean()),
    }


def bin_edges(max_tokens: int, bins: int) -> list[int]:
    """``bins + 1`` integer edges splitting positions ``[0, max_tokens)`` into bins of (nearly) equal width."""
    if bins <= 0 or max_tokens <= 0 or bins > max_tokens:
        raise ValueError(f"bin_edges: need 0 < bins <= max_tokens, got bins={bins}, max_tokens={max_tokens}")
    return [round(i * max_tokens / bins) for i in range(bins + 1)]


def by_position(per_sample: list[dict], edges: list[int]) -> list[dict]:
    """`stats` of the tokens whose response position falls in each ``[edges[i], edges[i+1])``."""
    import torch

    out = []
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        parts = {k: [r[k][lo:hi] for r in per_sample] for k in ("rollout", "trainer", "entropy")}
        cat = {k: torch.cat(v) if v else torch.empty(0) for k, v in parts.items()}
        out.append({"start": lo, "end": hi, **stats(cat["rollout"], cat["trainer"], cat["entropy"])})
    return out


def up_to_eos(per_sample: list[dict], response_ids: list[list[int]], eos_id: int) -> list[dict]:
    """Each sample's tokens up to and including its first EOS (all of them if it has none)."""
    out = []
    for r, ids in zip(per_sample, response_ids, strict=True):
        end = ids.index(eos_id) + 1 if eos_id in ids else len(ids)
        out.append({k: v[:end] for k, v in r.items()})
    return out


def summarize(per_sample: list[dict], response_ids: list[list[int]], eos_id: int, edges: list[int]) -> dict:
    import torch

    def _all(rows):
        return stats(*(torch.cat([r[k] for r in rows]) for k in ("rollout", "trainer", "entropy")))

    eos_rows = up_to_eos(per_sample, response_ids, eos_id)
    return {
        "overall": _all(per_sample),
        "to_first_eos": _all(eos_rows),
        "samples_with_eos": sum(eos_id in ids for ids in response_ids),
        "response_tokens_max": max(len(ids) for ids in response_ids),
        "by_position": by_position(per_sample, edges),
    }


def ratios(modes: dict) -> dict:
    """Mean |dlogp| of each FP8 mode over bf16's (the BF16 pair's floor; the trainer-matched modes also over
    bf16_hf_ops's) and naive over each unified mode."""
    mean = {m: r["overall"]["mean_abs"] for m, r in modes.items() if r.get("overall")}
    out = {}
    unified = ("jetrl_fp8", "jetrl_fp8_hf_ops", "jetrl_fp8_fused_ops", "jetrl_fp8_strict")
    for m in ("naive_fp8", "stock_fp8", *unified):
        if m in mean and "bf16" in mean and mean["bf16"]:
            out[f"{m}_over_bf16"] = mean[m] / mean["bf16"]
    for m, floor in (("jetrl_fp8_hf_ops", "bf16_hf_ops"), ("jetrl_fp8_fused_ops", "bf16_hf_ops"),
                     ("jetrl_fp8_strict", "bf16_strict")):  # fmt: skip
        if m in mean and mean.get(floor):
            out[f"{m}_over_{floor}"] = mean[m] / mean[floor]
    for m in unified:
        if "naive_fp8" in mean and mean.get(m):
            out[f"naive_fp8_over_{m}"] = mean["naive_fp8"] / mean[m]
    return out


def validate(result: dict) -> None:
    """Raise ValueError naming the first missing/ill-typed field of a fidelity JSON."""

    def need(d, key, types, where):
        if key not in d:
            raise ValueError(f"fidelity JSON: {where} lacks {key!r}")
        if not isinstance(d[key], types):
            raise ValueError(f"fidelity JSON: {where}.{key} is {type(d[key]).__name__}, want {types}")
        return d[key]

    if need(result, "benchmark", str, "top level") != "fidelity":
        raise ValueError(f"fidelity JSON: benchmark={result['benchmark']!r}, want 'fidelity'")
    for key, t in (("schema", int), ("device", str), ("versions", dict), ("date", str), ("commit", str),
                   ("command", str), ("model", dict), ("settings", dict), ("modes", dict), ("errors", dict),
                   ("unavailable", dict), ("summary", dict)):  # fmt: skip
        need(result, key, t, "top level")
    settings = result["settings"]
    for key in ("max_tokens", "prompts", "samples", "seed", "bin_edges", "enforce_eager"):
        need(settings, key, (int, list, bool), "settings")
    for mode, r in result["modes"].items():
        if mode not in MODES:
            raise ValueError(f"fidelity JSON: unknown mode {mode!r}; known {list(MODES)}")
        for key in ("recipe", "rollout"):
            need(r, key, str, f"modes.{mode}")
        for part in ("overall", "to_first_eos"):
            block = need(r, part, dict, f"modes.{mode}")
            for k in STAT_KEYS:
                need(block, k, (int, float), f"modes.{mode}.{part}")
        rows = need(r, "by_position", list, f"modes.{mode}")
        if len(rows) != len(settings["bin_edges"]) - 1:
            raise ValueError(f"fidelity JSON: modes.{mode}.by_position has {len(rows)} bins, edges say "
                             f"{len(settings['bin_edges']) - 1}")  # fmt: skip
        for i, row in enumerate(rows):
            for k in ("start", "end", *STAT_KEYS):
                need(row, k, (int, float, type(None)), f"modes.{mode}.by_position[{i}]")


# -- plot (CPU, tested) ----------------------------------------------------------------------------


def plot(result: dict, path: Path) -> Path:
    """PNG: mean and max |dlogp| per position bin (log y), one line per mode, with the overall means
    and the entropy in the legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    validate(result)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for mode, r in result["modes"].items():
        rows = [row for row in r["by_position"] if row["tokens"]]
        mid = [(row["start"] + row["end"]) / 2 for row in rows]
        o = r["overall"]
        label = f"{mode} (mean {o['mean_abs']:.2e}, H {o['entropy_mean']:.2f} nats)"
        axes[0].plot(mid, [max(row["mean_abs"], 1e-9) for row in rows], marker="o", label=label)
        axes[1].plot(mid, [max(row["max_abs"], 1e-9) for row in rows], marker="o", label=mode)
    for ax, what in zip(axes, ("mean", "max"), strict=True):
        ax.set_yscale("log")
        ax.set_xlabel("response token position")
        ax.set_ylabel(f"{what} |logp_trainer - logp_rollout| (0 drawn at 1e-9)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    axes[1].legend(fontsize=8)
    m = result["model"]
    fig.suptitle(
        f"rollout vs trainer log-prob mismatch on {result['device']} - {m.get('name', 'model')}, "
        f"{result['settings']['prompts'] * result['settings']['samples']} samples x "
        f"{result['settings']['max_tokens']} tokens",
        fontsize=10,
    )
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# -- the run (needs vLLM) --------------------------------------------------------------------------


def _model_overrides(args) -> dict:
    need = args.max_tokens + 64
    over = dict(args.model_overrides)
    over["max_position_embeddings"] = max(int(over.get("max_position_embeddings", 0)), need)
    return over


def make_checkpoint(args, root: Path) -> tuple[Path, dict]:
    """The tiny Qwen3 of `args.seed` after jetrl's supervised warm-up on the arithmetic task (float32,
    on the CPU), saved in BF16 as the checkpoint every mode starts from."""
    import torch

    from jetrl.tiny import CharTokenizer, build_tiny_model, save_checkpoint
    from jetrl.train.task import ArithmeticTask
    from jetrl.train.warmup import supervised_warmup

    over = _model_overrides(args)
    tok = CharTokenizer()
    model = build_tiny_model(args.seed, **over).float()  # the warm-up's batches are CPU tensors, as in jetrl train
    task = ArithmeticTask(args.seed, 0, 99, ("+",))
    info = {"steps": args.warmup_steps, "batch_size": args.warmup_batch, "lr": args.warmup_lr}
    if args.warmup_steps:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(args.seed)
            info.update(
                supervised_warmup(
                    model, tok, task, steps=args.warmup_steps, batch_size=args.warmup_batch, lr=args.warmup_lr
                )
            )
    n_params = sum(p.numel() for p in model.parameters())
    path = save_checkpoint(model.to(torch.bfloat16).cpu(), tok, root / "warmed")
    return path, {"name": "tiny Qwen3 (jetrl.tiny) after jetrl's arithmetic warm-up", "overrides": over,
                  "parameters": n_params, "warmup": info, "task": "arithmetic a+b, operands 0..99"}  # fmt: skip


def prompts(args) -> list[list[int]]:
    """The arithmetic eval prompts every mode samples (BOS + ``a+b=``), same for every recipe."""
    from jetrl.tiny import CharTokenizer
    from jetrl.train.task import ArithmeticTask, Stream

    tok = CharTokenizer()
    task = ArithmeticTask(args.seed, 0, 99, ("+",))
    return [tok.encode(p.prompt, add_bos=True) for p in task.problems(Stream.EVAL, 0, args.prompts)]


def _trainer(path: Path, recipe, backend: str, fuse: bool = False, strict: bool = False):
    import torch
    from transformers import AutoModelForCausalLM

    from jetrl.convert import convert_model

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device)
    if strict:
        from jetrl.rollout.engine_strict import match_vllm_strict

        match_vllm_strict(model)
    if recipe.train_fp8:
        convert_model(model, recipe, backend=backend if device == "cuda" else "emulated", fuse=fuse)
    return model.eval()


def run_mode(args, mode: str, path: Path) -> dict:
    """Start the engine of `mode`, sync the trainer into it, sample, score; the mode's JSON entry."""
    import torch

    from jetrl.recipe import Recipe
    from jetrl.rollout.adapter import create_engine
    from jetrl.rollout.parity import token_mismatch
    from jetrl.rollout.sync import sync_weights
    from jetrl.tiny import CharTokenizer

    recipe_name, rollout = MODES[mode]
    recipe = Recipe.from_name(recipe_name)
    cuda = torch.cuda.is_available()
    strict = mode in STRICT
    if strict:
        if not cuda:
            raise RuntimeError(f"{mode}: strict numerics run vLLM's CUDA kernels; no GPU here")
        from jetrl.rollout.adapter import enable_batch_invariance

        enable_batch_invariance()  # before this process's first GEMM
    ps = prompts(args)
    kw: dict = {}
    if rollout == "stock":
        kw["load_format"] = "dummy"  # filled by the byte-verified sync below
    if cuda:
        kw["gpu_memory_utilization"] = args.gpu_memory_utilization
        if not args.enforce_eager:
            sizes = sorted({1, 2, 4, 8, len(ps) * args.samples})
            kw["compilation_config"] = {"cudagraph_capture_sizes": sizes}
    else:
        kw["kv_cache_memory_bytes"] = 64 << 20
    backend = args.backend if cuda else "emulated"
    engine = create_engine(
        path,
        recipe,
        seed=args.seed,
        max_model_len=max(len(p) for p in ps) + args.max_tokens + 8,
        enforce_eager=args.enforce_eager or not cuda,
        rollout=rollout,
        backend=backend,
        engine_ops=ENGINE_OPS.get(mode, "vllm"),
        strict=strict,
        **kw,
    )
    try:
        trainer = _trainer(path, recipe, args.backend, fuse=ENGINE_OPS.get(mode) == "fused", strict=strict)
        sync = sync_weights(trainer, engine, recipe).to_dict()
        t0 = time.perf_counter()
        samples = engine.generate(
            ps, n=args.samples, temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed,
            ignore_eos=True,
        )  # fmt: skip
        gen_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        per_sample = token_mismatch(trainer, samples)
        score_s = time.perf_counter() - t0
        ids = [s.response_ids for s in samples if s.response_ids]
        res = summarize(per_sample, ids, CharTokenizer().eos_id, bin_edges(args.max_tokens, args.bins))
        cc = engine.llm.llm_engine.vllm_config.compilation_config
        return {
            "recipe": recipe_name,
            "rollout": rollout,
            "engine_ops": ENGINE_OPS.get(mode, "vllm"),
            "strict": strict,
            "quantization": engine.quantization,
            "engine_start_s": engine.start_seconds,
            "cudagraph_capture_sizes": None if (args.enforce_eager or not cuda) else list(cc.cudagraph_capture_sizes),
            "sync": {k: sync[k] for k in ("bytes", "seconds", "n_digests") if k in sync},
            "generate_s": gen_s,
            "score_s": score_s,
            **res,
        }
    finally:
        engine.close()


def _base_result(args, model_info: dict) -> dict:
    return {
        "benchmark": "fidelity",
        "schema": SCHEMA_VERSION,
        "device": benchmeta.device_name(),
        "versions": benchmeta.versions(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": benchmeta.commit(args.commit),
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "model": model_info,
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(("VLLM_", "CUDA_VISIBLE"))},
        "settings": {
            "max_tokens": args.max_tokens,
            "prompts": args.prompts,
            "samples": args.samples,
            "seed": args.seed,
            "temperature": args.temperature,
            "ignore_eos": True,
            "bin_edges": bin_edges(args.max_tokens, args.bins),
            "enforce_eager": bool(args.enforce_eager),
            "backend": args.backend,
            "trainer": "HF model (transformers) in BF16 on the same device, converted per recipe (jetrl.convert)",
        },
        "notes": (
            "|dlogp| = |logp_trainer - logp_rollout| of each sampled response token; IS ratio = "
            "exp(logp_trainer - logp_rollout); entropy_mean = the trainer's next-token entropy (nats) at the "
            "sampled positions, nll_mean = mean -logp_trainer of the sampled tokens; to_first_eos = each "
            "response up to its first EOS (the model's own answer), overall = all max_tokens (ignore_eos)"
        ),
        "modes": {},
        "unavailable": {},
        "errors": {},
        "summary": {},
    }


def _untimed(d):
    """`d` without its ``seconds`` entries (the warm-up's duration differs between equal runs)."""
    if isinstance(d, dict):
        return {k: _untimed(v) for k, v in d.items() if k != "seconds"}
    return d


def merge(paths: list[Path]) -> dict:
    """One result from runs of separate calls (a device call fits only a few modes): their modes, errors
    and unavailable entries side by side. Refuses runs of other settings or another model (the warm-up's
    figures included, so every mode scored the same checkpoint) and a mode measured twice, naming the file."""
    results = [json.loads(Path(p).read_text()) for p in paths]
    for r, p in zip(results, paths, strict=True):
        validate(r)
        for key in ("settings", "model", "device"):
            if _untimed(r[key]) != _untimed(results[0][key]):
                raise ValueError(f"--merge: {p} has another {key} than {paths[0]}: {r[key]} != {results[0][key]}")
    out = {**results[0], "modes": {}, "unavailable": {}, "errors": {}}
    out["merged_from"] = [{"file": str(p), **{k: r[k] for k in ("commit", "date", "command")}}
                          for r, p in zip(results, paths, strict=True)]  # fmt: skip
    for r, p in zip(results, paths, strict=True):
        for part in ("modes", "unavailable", "errors"):
            for mode, v in r[part].items():
                if mode in out["modes"] or mode in out["unavailable"] or mode in out["errors"]:
                    raise ValueError(f"--merge: {p} measures mode {mode!r} again")
                out[part][mode] = v
    commits = {r["commit"] for r in results}
    out["commit"] = ",".join(sorted(commits))
    out["summary"] = ratios(out["modes"])
    return out


def _save(result: dict, out: Path) -> None:
    result["summary"] = ratios(result["modes"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")


def _child(args, mode: str, path: Path, tmp: Path) -> tuple[dict | None, str | None]:
    out = tmp / f"{mode}.json"
    cmd = [sys.executable, __file__, *_child_argv(sys.argv[1:]), "--modes", mode, "--no-isolate",
           f"--checkpoint={path}", f"--out={out}", "--plot=none"]  # fmt: skip
    proc = subprocess.run(cmd, env=os.environ.copy())
    if not out.exists():
        return None, f"child for {mode} exited {proc.returncode} without results"
    child = json.loads(out.read_text())
    return child["modes"].get(mode), child["errors"].get(mode) or child["unavailable"].get(mode)


def _child_argv(argv: list[str]) -> list[str]:
    """`argv` without the options the parent sets for its children (--modes, --out, --plot, --isolate, --checkpoint)."""
    drop = ("--modes", "--out", "--plot", "--checkpoint")
    kept, skip = [], False
    for a in argv:
        if a.startswith("--"):
            skip = a in drop
            if a.startswith(drop) or a in ("--isolate", "--no-isolate"):
                continue
        elif skip:
            continue
        kept.append(a)
    return kept


def run(args, out: Path) -> dict:
    import torch

    from jetrl.rollout.adapter import stock_block_fp8_unavailable_reason

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.checkpoint:
            path, model_info = Path(args.checkpoint), {"name": f"checkpoint {args.checkpoint}"}
        else:
            path, model_info = make_checkpoint(args, tmp)
        result = _base_result(args, model_info)
        isolate = args.isolate if args.isolate is not None else (torch.cuda.is_available() and len(args.modes) > 1)
        for mode in args.modes:
            if MODES[mode][1] == "stock" and (reason := stock_block_fp8_unavailable_reason()) is not None:
                result["unavailable"][mode] = reason
                print(f"[{mode}] unavailable: {reason}", flush=True)
                _save(result, out)
                continue
            print(f"[{mode}] starting", flush=True)
            try:
                if isolate:
                    entry, err = _child(args, mode, path, tmp)
                    if entry is not None:
                        result["modes"][mode] = entry
                    if err:
                        result["errors"][mode] = err
                else:
                    result["modes"][mode] = run_mode(args, mode, path)
            except Exception:
                result["errors"][mode] = traceback.format_exc()
                print(f"[{mode}] FAILED:\n{result['errors'][mode]}", flush=True)
            if mode in result["modes"]:
                o = result["modes"][mode]["overall"]
                print(f"[{mode}] mean |dlogp| {o['mean_abs']:.5f}, p99 {o['p99_abs']:.5f}, max {o['max_abs']:.4f}, "
                      f"IS mean {o['is_ratio_mean']:.4f} max {o['is_ratio_max']:.3f}, H {o['entropy_mean']:.3f} "
                      f"({o['tokens']} tokens)", flush=True)  # fmt: skip
            _save(result, out)
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.merge:
        if not args.out:
            raise SystemExit("--merge needs --out")
        result = merge([Path(m) for m in args.merge])
        _save(result, Path(args.out))
        if args.plot != "none":
            plot(result, Path(args.plot) if args.plot else Path(args.out).with_suffix(".png"))
        print(f"wrote {args.out}: modes {sorted(result['modes'])}, summary {result['summary']}")
        return 0
    if args.plot_only:
        src = Path(args.plot_only)
        result = json.loads(src.read_text())
        png = plot(result, Path(args.plot) if args.plot else src.with_suffix(".png"))
        print(f"wrote {png}")
        return 0
    import torch

    kind = "nvidia-h200" if torch.cuda.is_available() and "H200" in torch.cuda.get_device_name(0) else (
        "gpu" if torch.cuda.is_available() else "cpu")  # fmt: skip
    out = Path(args.out or Path(__file__).parent / "results" / f"fidelity-{kind}.json")
    result = run(args, out)
    validate(result)
    if args.plot != "none" and result["modes"]:
        print(f"wrote {plot(result, Path(args.plot) if args.plot else out.with_suffix('.png'))}")
    print(f"wrote {out}")
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
