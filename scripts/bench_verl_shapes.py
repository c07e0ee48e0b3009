"""One ``python -m jetrl.verl`` GRPO step per 8B-class model shape on this GPU, through each model's own recipe.

For every ``--shapes`` entry (the models of ``recipes/models/``): a random-weight checkpoint of the shipped
config with ``--layers`` decoder layers (`shape_model.write_shape_model`, ChatML character tokenizer padded to
the model's vocabulary: no weights or tokenizer are downloaded), a small dataset in the recipe's source format
(arithmetic questions written as GSM8K / MATH rows) put through the recipe's own data script
(``scripts/data/<dataset>.py --local-dir``), then the model's recipe with ``--ngpus`` GPUs (FSDP2 world size;
default 1), vLLM TP ``--tp`` (default 1) and a short response length for ``--steps`` steps (default 1), read
back from verl's file logger like bench_verl.py. The entrypoint refuses, before Ray starts, a TP whose slices
of a shape's Linears do not fall on 128 boundaries.

    python scripts/bench_verl_shapes.py --out scripts/results/verl-shapes-nvidia-h200.json
    python scripts/bench_verl_shapes.py --shapes qwen2.5-7b --layers 4 --out /tmp/s.json --recipe-timeout 540
    python scripts/bench_verl_shapes.py --dry-run --out /tmp/s.json    # CPU: config + tokenizer, DRY_RUN=1
    python scripts/bench_verl_shapes.py --shapes llama3.1-8b --ngpus 2 --tp 2 --steps 3 --out /tmp/x2.json

Random weights score 0 on every prompt, so the step's advantages are 0: the step runs every FP8 GEMM, the lint,
the weight sync and its digests, not learning. DAPO recipes run with ``algorithm.filter_groups.enable=False``
(group filtering would drop every all-zero group and never fill a batch) and an overlong buffer of a quarter of
the response length. ``--dry-run`` writes the config and
tokenizer only (no weights) and runs the recipes with ``DRY_RUN=1``. Prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import benchmeta
from bench_verl import LOG_TAIL, comma_list, merge, record, run_child, run_each
from shape_model import DEFAULT_LAYERS, shape_config, tokenizer_for, write_shape_model

ROOT = Path(__file__).resolve().parent.parent
SHAPE_RECIPES = {
    "llama3.1-8b": "llama3.1-8b_gsm8k.sh",
    "qwen2.5-7b": "qwen2.5-7b_gsm8k.sh",
    "qwen3-8b-base": "qwen3-8b-base_math.sh",
}
"""The recipe each shape runs (Qwen3-8B-Base has MATH and DeepMATH recipes only)."""
DATASETS = {"llama3.1-8b_gsm8k.sh": "gsm8k", "qwen2.5-7b_gsm8k.sh": "gsm8k", "qwen3-8b-base_math.sh": "math"}
ROWS = {"train": 64, "test": 16}


def raw_row(dataset: str, a: int, b: int) -> dict:
    """An arithmetic question as a row of the dataset's source release (what its data script reads)."""
    if dataset == "gsm8k":
        return {"question": f"What is {a} plus {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}
    return {"problem": f"Compute ${a} + {b}$.", "solution": f"${a} + {b} = \\boxed{{{a + b}}}$"}


def make_data(dataset: str, work: Path) -> Path:
    """``work/data/<dataset>/{train,test}.parquet`` through ``scripts/data/<dataset>.py`` (made once)."""
    out = work / "data" / dataset
    if (out / "train.parquet").is_file() and (out / "test.parquet").is_file():
        return out
    raw = work / "raw" / dataset
    raw.mkdir(parents=True, exist_ok=True)
    for split, n in ROWS.items():
        rows = [raw_row(dataset, i % 10, (7 * i + (split == "test")) % 10) for i in range(n)]
        (raw / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    script = ROOT / "scripts" / "data" / f"{dataset}.py"
    cmd = [sys.executable, str(script), "--local-dir", str(raw), "--out-dir", str(out)]
    subprocess.run(cmd, check=True, cwd=ROOT)
    return out


def make_model(args, shape: str) -> Path:
    """The shape's checkpoint under ``--work`` (made once); with ``--dry-run`` its config and tokenizer only."""
    path = args.work / f"{shape}-L{args.layers}{'-config' if args.dry_run else ''}"
    if (path / "tokenizer.json").is_file():
        return path
    if args.dry_run:
        cfg = shape_config(shape, args.layers, chat=True)
        cfg.save_pretrained(path)
        tokenizer_for(cfg.vocab_size, chat=True).save(path, model_max_length=cfg.max_position_embeddings)
    else:
        write_shape_model(path, shape, args.layers, seed=args.seed, chat=True)
    return path


def shape_command(args, shape: str, model: Path, jsonl: Path) -> tuple[list[str], dict[str, str], str]:
    script = SHAPE_RECIPES[shape]
    dapo = "ALGO=dapo" in (ROOT / "recipes" / script).read_text()
    shown = {
        "MODEL_PATH": str(model),
        "DATA_DIR": str(args.work / "data"),
        "RECIPE": args.recipe,
        "NGPUS": str(args.ngpus),
        "ROLLOUT_TP": str(args.tp),
        "RESPONSE_LEN": str(args.response_len),
        "PROMPT_LEN": "256",
        "TRAIN_BATCH": "8",
        "GEN_BATCH": "8",
        "MINI_BATCH": "8",
        "N_RESP": "2",
        "TOTAL_EPOCHS": "1",
        "TEST_FREQ": "-1",
        "LOGGER": '["console","file"]',
        "DRY_RUN": "1" if args.dry_run else "0",
        # DAPO's overlong buffer (4096 by default) must lie inside the short response length
        **({"OVERLONG_BUFFER": str(args.response_len // 4)} if dapo else {}),
    }
    argv = [
        "bash",
        str(ROOT / "recipes" / script),
        f"trainer.total_training_steps={args.steps}",
        "trainer.val_before_train=False",
        f"actor_rollout_ref.model.use_remove_padding={args.remove_padding}",
        f"+actor_rollout_ref.model.override_config.attn_implementation={args.attn}",
        "actor_rollout_ref.rollout.enforce_eager=True",
        f"actor_rollout_ref.rollout.gpu_memory_utilization={args.gpu_memory_utilization}",
        "actor_rollout_ref.rollout.agent.num_workers=2",
        "reward.num_workers=2",
        "data.dataloader_num_workers=2",
        *(["algorithm.filter_groups.enable=False"] if dapo else []),
        "++ray_kwargs.ray_init.include_dashboard=False",
        f"++ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH={jsonl}",
        *(["jetrl.proceed_on_lint_violation=true"] if args.recipe == "naive-fp8-rollout" else []),
        *args.overrides,
    ]
    env = {**os.environ, **shown, "PYTHON": sys.executable, "VERL_FILE_LOGGER_PATH": str(jsonl)}
    command = " ".join(f"{k}={v!r}" if " " in v or '"' in v else f"{k}={v}" for k, v in shown.items())
    return argv, env, command + " " + " ".join(argv)


def run_shape(args, shape: str, logdir: Path) -> dict:
    dataset = DATASETS[SHAPE_RECIPES[shape]]
    make_data(dataset, args.work)
    model = make_model(args, shape)
    cfg = shape_config(shape, args.layers)
    jsonl = logdir / f"{shape}.jsonl"
    jsonl.unlink(missing_ok=True)
    argv, env, command = shape_command(args, shape, model, jsonl)
    print(f"== {shape} ({args.layers} of {full_layers(shape)} layers): {command}", flush=True)
    t0 = time.perf_counter()
    rc, stopped = run_child(argv, env, logdir / f"{shape}.log", args.recipe_timeout)
    wall = round(time.perf_counter() - t0, 1)
    head = {
        "shape": shape,
        "recipe_script": f"recipes/{SHAPE_RECIPES[shape]}",
        "dataset": dataset,
        "layers": cfg.num_hidden_layers,
        "layers_of_the_model": full_layers(shape),
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
    }
    if args.dry_run:
        log = (logdir / f"{shape}.log").read_text(errors="replace").splitlines()
        res = {**head, "command": command, "returncode": rc, "wall_s": wall, "dry_run": True}
        if rc != 0 or stopped:
            res["error"] = stopped or f"exit code {rc}"
            res["log_tail"] = log[-LOG_TAIL:]
        return res
    return {**head, **record(shape, command, rc, stopped, wall, logdir, args.steps)}


def full_layers(shape: str) -> int:
    """Decoder layers of the shipped model."""
    return json.loads((ROOT / "recipes" / "models" / shape / "config.json").read_text())["num_hidden_layers"]


def table(result: dict) -> str:
    head = f"{'shape':<15}{'layers':>8}{'steps':>6}{'mean|dlogp|':>13}{'digests ok':>11}{'step s':>8}{'wall s':>8}"
    lines = [head, "-" * len(head)]
    for r in result["runs"]:
        s = r.get("summary")
        if s is None:  # dry run
            mean = ok = step = "-"
        else:
            mean = (
                "-"
                if s["mismatch/logp_abs_diff_mean (mean over steps)"] is None
                else (f"{s['mismatch/logp_abs_diff_mean (mean over steps)']:.3g}")
            )
            ok = f"{s['syncs_digest_checked']}/{s['steps']}" if s["syncs_digest_checked"] else "n/a"
            step = "-" if s["median_time_s"]["step"] is None else f"{s['median_time_s']['step']:.1f}"
        steps = "dry" if r.get("dry_run") else s["steps"]
        lines.append(
            f"{r['shape']:<15}{r['layers']:>4}/{r['layers_of_the_model']:<3}{steps:>6}{mean:>13}{ok:>11}{step:>8}"
            f"{r['wall_s']:>8}" + (f"   FAILED: {r['error']}" if "error" in r else "")
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="result JSON (its folder gets <shape>.log / .jsonl)")
    p.add_argument("--shapes", default=",".join(SHAPE_RECIPES), help=f"comma-separated, from {tuple(SHAPE_RECIPES)}")
    p.add_argument("--layers", type=int, default=DEFAULT_LAYERS, help=f"decoder layers (default {DEFAULT_LAYERS})")
    p.add_argument("--recipe", default="jetrl-unified", choices=("jetrl-unified", "naive-fp8-rollout", "bf16"))
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--ngpus", type=int, default=1, help="GPUs of the node: FSDP2 world size (default 1)")
    p.add_argument("--tp", type=int, default=1, help="vLLM tensor-parallel size, dividing --ngpus (default 1)")
    p.add_argument("--response-len", type=int, default=256)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.25, help="vLLM's share of the GPU")
    p.add_argument("--attn", default="sdpa", help="attn_implementation (flash_attention_2 where flash-attn is)")
    p.add_argument("--remove-padding", default="False", choices=("True", "False"))
    p.add_argument("--work", type=Path, default=Path("/tmp/jetrl-shapes"), help="checkpoints and data (kept)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--commit", help="git commit of the tree (recorded; default: git rev-parse HEAD)")
    p.add_argument("--recipe-timeout", type=float, metavar="S", help="stop a shape's run after S s, keep its steps")
    p.add_argument("--dry-run", action="store_true", help="config + tokenizer only, the recipes with DRY_RUN=1")
    p.add_argument(
        "--merge",
        nargs="+",
        type=Path,
        metavar="JSON",
        help="run nothing: combine the runs of these result files (later files win per shape) into --out, e.g. "
        "shapes run in separate device calls",
    )
    p.add_argument("--note", help="recorded as the result's `note`: what did not run or ran differently, and why")
    p.add_argument("overrides", nargs="*", help="hydra overrides forwarded to every run (after --)")
    args = p.parse_args(argv)
    args.shapes = comma_list(p, args.shapes, SHAPE_RECIPES, "--shapes")
    if args.steps <= 0:
        p.error(f"--steps must be > 0, got {args.steps}")
    if args.ngpus < 1 or args.tp < 1 or args.ngpus % args.tp:
        p.error(f"--ngpus {args.ngpus} --tp {args.tp}: both >= 1, and TP groups must tile the GPUs (tp divides ngpus)")
    for shape in args.shapes:
        try:
            shape_config(shape, args.layers)
        except ValueError as e:
            p.error(str(e))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.merge:
        result = merge(args.merge, key="shape", order=SHAPE_RECIPES)
        return finish(result, args.out, args.note)
    logdir = args.out.parent / (args.out.stem + "-logs")
    logdir.mkdir(exist_ok=True)
    result = {
        **benchmeta.meta(args.commit, extra_versions=("verl", "ray")),
        "what": f"python -m jetrl.verl, {args.steps} GRPO step(s) per model shape through its recipe, random "
        f"weights, recipe {args.recipe}, FSDP2 world size {args.ngpus} + vLLM TP {args.tp} colocated on "
        f"{args.ngpus} GPU(s), "
        f"{args.response_len}-token responses",
        "runs": [],
    }
    run_each(args.shapes, lambda shape: run_shape(args, shape, logdir), result, args.out)
    code = finish(result, args.out, args.note)
    print(f"logs in {logdir}")
    return code


def finish(result: dict, out: Path, note: str | None) -> int:
    """Write `result` (with `note`), print its table; the exit code: 1 when a run failed."""
    if note:
        result["note"] = note
    out.write_text(json.dumps(result, indent=1))
    print(table(result))
    print(f"wrote {out}")
    return 1 if any("error" in r for r in result["runs"]) else 0


if __name__ == "__main__":
    sys.exit(main())
