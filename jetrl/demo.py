"""The embedded default: on-policy FP8 RL of a tiny Qwen3 on a laptop CPU, in minutes, no downloads.

``python -m jetrl.demo`` (what ``make demo`` runs):

1. builds a tiny Qwen3-architecture model and a character tokenizer from scratch (`jetrl.tiny`);
2. teaches it the answer format with a short supervised warm-up on ``a+b=`` problems (cached);
3. runs GRPO with the ``jetrl-unified`` recipe: vLLM rollouts with jetrl's FP8 method, FP8 training
   through `JetFP8Linear`, a byte-verified weight sync every step, the precision lint at start-up;
4. (``--compare``, on by default) runs the same seed and data order with ``naive-fp8-rollout`` (BF16
   training, vLLM-style per-tensor FP8 rollout) and compares the trainer/rollout mismatch;
5. prints a closing report and writes ``runs/<name>/summary.json``, ``metrics.jsonl`` and plots.

A run directory is never replaced unless ``--overwrite`` asks: when ``runs/<name>/`` (or its
comparison run's directory) exists, the demo writes to the first free ``<name>-2``, ``<name>-3``, ...
and says so. Ctrl-C / SIGTERM end it like ``jetrl train``: one line, engine shut down, exit 130 / 143.

Acceptance (issue 7): reward rises, and the mean per-token ``|logp_rollout - logp_trainer|`` of
``jetrl-unified`` is at most 1/5 of ``naive-fp8-rollout``'s.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_CONFIG", "MISMATCH_RATIO_GOAL", "main", "run_demo", "free_name"]

DEFAULT_CONFIG: dict[str, Any] = {
    "run": {"name": "tiny-arith", "seed": 0, "steps": 60, "recipe": "jetrl-unified", "checkpoint_every": 10},
    "model": {"numerics": "vllm-cpu"},
    "task": {"min_operand": 0, "max_operand": 9, "ops": ["+"]},
    "warmup": {"steps": 40, "batch_size": 64, "lr": 3.0e-3},
    "rollout": {"prompts_per_step": 16, "samples_per_prompt": 8, "max_tokens": 6, "max_model_len": 32},
    "algo": {"name": "grpo", "mini_batches": 2},
    "optim": {"lr": 2.0e-4},
}
"""The default run (also in ``recipes/tiny-arith-cpu.yaml`` for ``jetrl train``; a test keeps them equal)."""

MISMATCH_RATIO_GOAL = 0.2
"""mean |dlogp| of jetrl-unified / naive-fp8-rollout must not exceed this."""

COMPARE_RECIPE = "naive-fp8-rollout"


def _fmt(v: Any, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def closing_report(summaries: list[dict[str, Any]], comparison: dict[str, Any] | None) -> str:
    lines = ["", "jetrl demo: closing report", ""]
    head = (
        f"{'recipe':<20}{'reward start->end':>20}{'greedy acc start->end':>24}{'mean |dlogp|':>14}"
        f"{'max |dlogp|':>13}{'IS ratio':>10}{'rollout/train/sync s':>24}{'wall':>8}"
    )
    lines += [head, "-" * len(head)]
    for s in summaries:
        split = "/".join(_fmt(s[k], ".2f") for k in ("time_rollout_s_mean", "time_train_s_mean", "time_sync_s_mean"))
        lines.append(
            f"{s['recipe']:<20}{_fmt(s['reward_start']) + ' -> ' + _fmt(s['reward_end']):>20}"
            f"{_fmt(s['eval_accuracy_start']) + ' -> ' + _fmt(s['eval_accuracy_end']):>24}"
            f"{_fmt(s['mismatch_logp_abs_diff_mean'], '.2e'):>14}{_fmt(s['mismatch_logp_abs_diff_max'], '.2e'):>13}"
            f"{_fmt(s['mismatch_is_ratio_mean'], '.4f'):>10}{split:>24}{_fmt(s['wall_s'], '.0f') + 's':>8}"
        )
    paths = sorted({s["numerics_path"]["text"] for s in summaries if s.get("numerics_path")})
    lines += ["", *(f"trainer numerics: {p}" for p in paths)] if paths else []
    if comparison is not None:
        ok = "PASS" if comparison["pass"] else "FAIL"
        lines += [
            "",
            f"mismatch: jetrl-unified / {COMPARE_RECIPE} = {comparison['ratio']:.3f} "
            f"(goal <= {MISMATCH_RATIO_GOAL}) {ok}",
        ]
    return "\n".join(lines)


def free_name(out_dir: str | Path, name: str, compare: bool) -> str:
    """`name`, or the first ``<name>-2``, ``<name>-3``, ... whose run directories (the main run's and, with
    `compare`, the comparison run's) do not exist or are empty."""

    def taken(n: str) -> bool:
        dirs = [Path(out_dir) / n] + ([Path(out_dir) / f"{n}-{COMPARE_RECIPE}"] if compare else [])
        return any(d.exists() and any(d.iterdir()) for d in dirs)

    if not taken(name):
        return name
    i = 2
    while taken(f"{name}-{i}"):
        i += 1
    return f"{name}-{i}"


def run_demo(
    *,
    name: str,
    out_dir: str,
    compare: bool,
    overrides: list[str],
    log=print,
    overwrite: bool = False,
    dry_run: bool = False,
    active: list | None = None,
    verbose: bool = True,
) -> dict[str, Any] | None:
    """Run the default (and the comparison); return the combined summary (also in runs/<name>/summary.json).
    An existing run directory is refused (`TrainError`) unless `overwrite`; `active`, when given, receives
    each `Trainer` as it starts (the CLI reports an interrupted run's step from it)."""
    from jetrl.train.config import ConfigError, apply_overrides, config_from_dict
    from jetrl.train.plots import plot_runs
    from jetrl.train.trainer import Trainer

    t0 = time.perf_counter()
    raw = apply_overrides(DEFAULT_CONFIG, [f"run.name={name}", f"run.out_dir={out_dir}", *overrides])
    cfg = config_from_dict(raw)
    plan = [cfg]
    if compare:
        if cfg.run.recipe == COMPARE_RECIPE:
            raise ConfigError(f"run.recipe: --compare runs {COMPARE_RECIPE!r} beside the main recipe; pick another")
        # the naive rollout is off-policy by construction: the lint reports it, and we train anyway to measure it
        plan.append(
            cfg.replace(
                run={"name": f"{cfg.run.name}-{COMPARE_RECIPE}", "recipe": COMPARE_RECIPE},
                lint={"allow_violations": True},
            )
        )
    if dry_run:
        from jetrl.train.checks import check_environment

        for c in plan:
            check_environment(c)
            log(json.dumps(c.to_dict()))
        log(f"dry run: {len(plan)} config(s) OK for this machine; outputs would go to {cfg.run_dir}")
        return None
    summaries = []
    for c in plan:
        log(f"=== {c.run.recipe}: {c.run.steps} RL steps -> {c.run_dir}")
        trainer = Trainer(c, overwrite=overwrite, log=log, verbose=verbose)
        if active is not None:
            active.append(trainer)
        try:
            summaries.append(trainer.run())
        finally:
            trainer.close()
    comparison = None
    if compare:
        main_m, naive_m = summaries[0]["mismatch_logp_abs_diff_mean"], summaries[1]["mismatch_logp_abs_diff_mean"]
        ratio = main_m / naive_m if naive_m else float("inf")
        comparison = {
            "recipes": [cfg.run.recipe, COMPARE_RECIPE],
            "mismatch_logp_abs_diff_mean": {cfg.run.recipe: main_m, COMPARE_RECIPE: naive_m},
            "ratio": ratio,
            "goal": MISMATCH_RATIO_GOAL,
            "pass": ratio <= MISMATCH_RATIO_GOAL,
            "seed": cfg.run.seed,
        }
        plot_runs([p.run_dir for p in plan], cfg.run_dir / "plots" / "compare")
    total = {
        **summaries[0],
        "runs": summaries,
        "comparison": comparison,
        "reward_rose": (summaries[0]["reward_end"] or 0) > (summaries[0]["reward_start"] or 0),
        "demo_wall_s": time.perf_counter() - t0,
    }
    (cfg.run_dir / "summary.json").write_text(json.dumps(total, indent=2))
    report = closing_report(summaries, comparison)
    report += f"\n\ndemo wall time {total['demo_wall_s']:.0f}s; outputs in {cfg.run_dir}/"
    (cfg.run_dir / "report.txt").write_text(report + "\n")
    log(report)
    return total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jetrl.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--name", default=DEFAULT_CONFIG["run"]["name"], help="run name (outputs in <out-dir>/<name>/)")
    p.add_argument("--out-dir", default="runs", help="parent directory of the run directories")
    p.add_argument("--steps", type=int, default=None, help=f"RL steps (default {DEFAULT_CONFIG['run']['steps']})")
    p.add_argument("--seed", type=int, default=None, help="seed of model, data order and sampling")
    cmp_ = p.add_mutually_exclusive_group()
    cmp_.add_argument(
        "--compare",
        dest="compare",
        action="store_true",
        default=True,
        help=f"also run {COMPARE_RECIPE} on the same seed and compare the mismatch (default)",
    )
    cmp_.add_argument("--no-compare", dest="compare", action="store_false", help="run only the main recipe")
    p.add_argument("--dry-run", action="store_true", help="check the configs and this machine, then exit")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace runs/<name>/ if it exists (default: write to the first free <name>-2, <name>-3, ...)",
    )
    p.add_argument("--verbose", action="store_true", help="show vLLM's and transformers' INFO/WARNING logs")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="section.key=value",
        help="override a config field (repeatable), e.g. --set algo.name=dapo",
    )
    args = p.parse_args(argv)
    from jetrl.train.cli import Interrupted, handle_signals, interrupt_line, quiet_engine_logs, user_error

    quiet_engine_logs(args.verbose)  # an explicit VLLM_LOGGING_LEVEL in the environment wins
    overrides = list(args.overrides)
    if args.steps is not None:
        overrides.append(f"run.steps={args.steps}")
    if args.seed is not None:
        overrides.append(f"run.seed={args.seed}")
    from jetrl.train.config import ConfigError
    from jetrl.train.modelfiles import ModelFileError
    from jetrl.train.trainer import TrainError

    name = args.name
    if not args.overwrite:
        name = free_name(args.out_dir, args.name, args.compare)
        if name != args.name:
            mine = [Path(args.out_dir) / args.name, Path(args.out_dir) / f"{args.name}-{COMPARE_RECIPE}"]
            there = " and ".join(str(d) for d in mine[: 2 if args.compare else 1] if d.exists() and any(d.iterdir()))
            print(
                f"jetrl demo: {there} exists; this run goes to {Path(args.out_dir) / name} "
                "(--overwrite replaces it instead)",
                file=sys.stderr,
            )
    active: list = []
    with handle_signals():
        try:
            summary = run_demo(
                name=name,
                out_dir=args.out_dir,
                compare=args.compare,
                overrides=overrides,
                dry_run=args.dry_run,
                overwrite=args.overwrite,
                active=active,
                verbose=args.verbose,
            )
        except (ConfigError, ModelFileError, TrainError) as e:
            return user_error("jetrl demo", e)
        except Interrupted as e:
            trainer = active[-1] if active else None
            if trainer is not None:
                trainer.close()
            hint = f"jetrl train {trainer.run_dir / 'config.json'} --resume" if trainer is not None else None
            print(f"jetrl demo: {interrupt_line(trainer, e.signum, resume=hint)}", file=sys.stderr)
            return 128 + e.signum
    if summary is not None and summary["comparison"] is not None and not summary["comparison"]["pass"]:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
