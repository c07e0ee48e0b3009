"""A real ``python -m jetrl.verl`` run per recipe on this GPU, on Ray: `recipes/tiny-arith-verl.sh` (the tiny
ChatML Qwen3 after jetrl's warm-up, GRPO on the arithmetic task as verl parquet, actor and rollout colocated:
FSDP2 world size 1, vLLM TP 1), same seed for every recipe, each in its own process.

    python scripts/bench_verl.py --out scripts/results/verl-nvidia-h200.json   # every run below, in turn
    python scripts/bench_verl.py --recipes jetrl-unified --steps 2 --out /tmp/v.json -- trainer.test_freq=-1

Runs: ``jetrl-unified`` (with ``ENGINE_OPS=vllm``: vLLM's own model, the recipe's default before
``jetrl.engine_ops: auto``), ``jetrl-unified-hf-ops`` (``ENGINE_OPS=hf``, what ``auto`` picks for jetrl-unified:
the rollout engine runs the actor's norms, RoPE and SiLU-and-mul), ``jetrl-unified-fused-ops`` (``ENGINE_OPS=fused``:
the same through jetrl's fused producer kernels, in the actor too), ``jetrl-unified-strict`` (``ENGINE_OPS=hf
NUMERICS=strict``: the actor's attention and log-probs through vLLM's kernels, both sides batch-invariant;
its ``mismatch/logp_equal_share`` is the share of bit-equal tokens), ``naive-fp8-rollout``, ``bf16`` (``auto``
gives them vLLM's own model).

Per step it keeps, from verl's file logger (``trainer.logger`` gains ``file``): the reward
(``critic/score/mean``), jetrl's ``mismatch/*`` and ``sync/*`` (digest counts, ``sync/digests_equal``), verl's
``training/rollout_probs_diff_*`` and the step time split rollout (``timing_s/gen``) / old-logp
(``timing_s/old_log_prob``) / update (``timing_s/update_actor``) / sync (``timing_s/update_weights``); every
other numeric metric of the step is kept under ``metrics``. A recipe whose run fails is recorded with its exit
code and the tail of its log (the other recipes still run); the exit code is then 1. A run stopped before it
ends (``--recipe-timeout``, or SIGTERM from a device call's time limit, which also ends the benchmark) keeps the
steps it logged, and the JSON is written. Prints a table last.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import benchmeta

from jetrl.verl.metrics import METRIC_KEYS, is_metric_key

ROOT = Path(__file__).resolve().parent.parent
RECIPE_SCRIPT = ROOT / "recipes" / "tiny-arith-verl.sh"
RECIPES = (
    "jetrl-unified",
    "jetrl-unified-hf-ops",
    "jetrl-unified-fused-ops",
    "jetrl-unified-strict",
    "naive-fp8-rollout",
    "bf16",
)
"""Runs by name; each is a jetrl recipe, `ENGINE_OPS` / `NUMERICS` below say which engine model it rolls out with
and which numerics its actor runs."""
ENGINE_OPS = {"jetrl-unified-hf-ops": "hf", "jetrl-unified-fused-ops": "fused", "jetrl-unified-strict": "hf"}
"""Runs whose rollout engine runs the actor's ops between the Linears (``jetrl.engine_ops``,
`jetrl.rollout.vllm_model`): ``jetrl-unified-hf-ops`` is jetrl-unified with ``ENGINE_OPS=hf``,
``jetrl-unified-fused-ops`` with ``ENGINE_OPS=fused`` (the actor and the engine through jetrl's fused producers)."""
NUMERICS = {"jetrl-unified-strict": "strict"}
"""Runs with ``jetrl.numerics=strict`` (`jetrl.verl.engine`); the others run 'hf'."""
PHASES = {
    "rollout": "timing_s/gen",
    "old_logp": "timing_s/old_log_prob",
    "update": "timing_s/update_actor",
    "sync": "timing_s/update_weights",
    "step": "timing_s/step",
}
"""Step-time split: our name -> verl 0.9.1's timer (V1 trainer)."""
STEP_KEYS = ("critic/score/mean", *METRIC_KEYS, "training/rollout_probs_diff_mean", "training/rollout_probs_diff_max")
"""Kept per step: verl's reward, jetrl's ``mismatch/*`` and ``sync/*`` (`jetrl.verl.metrics`), verl's own mismatch."""
LOG_TAIL = 80
"""Lines of a failed run's log kept in the JSON."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="result JSON (its folder gets <recipe>.log / .jsonl)")
    p.add_argument("--recipes", default=",".join(RECIPES), help=f"comma-separated, from {RECIPES}")
    p.add_argument("--steps", type=int, default=5, help="GRPO steps per recipe (default 5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--commit", help="git commit of the tree (recorded; default: git rev-parse HEAD)")
    p.add_argument(
        "--merge",
        nargs="+",
        type=Path,
        metavar="JSON",
        help="run nothing: combine the runs of these result files (later files win per recipe) into --out, e.g. "
        "recipes run in separate device calls",
    )
    p.add_argument(
        "--note",
        help="recorded as the result's `note`: what did not run and why (e.g. a recipe cut by the device's budget)",
    )
    p.add_argument(
        "--recipe-timeout",
        type=float,
        metavar="S",
        help="stop a recipe's run after S seconds and keep the steps it logged (SIGTERM does the same and ends "
        "the benchmark: set S below the device call's limit)",
    )
    p.add_argument("overrides", nargs="*", help="hydra overrides forwarded to every run (after --)")
    args = p.parse_args(argv)
    args.recipes = comma_list(p, args.recipes, RECIPES, "--recipes")
    if args.steps <= 0:
        p.error(f"--steps must be > 0, got {args.steps}")
    return args


def read_steps(jsonl: Path) -> list[dict]:
    """verl's file-logger lines ``{"step": int, "data": {metric: value}}`` -> one dict per training step (a
    validation-only line before training, step 0, is kept under its step number too)."""
    rows: dict[int, dict] = {}
    for i, line in enumerate(jsonl.read_text().splitlines()):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            step, data = int(rec["step"]), rec["data"]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{jsonl}:{i + 1}: not a verl file-logger line ({e}): {line[:200]}") from e
        rows.setdefault(step, {}).update({k: v for k, v in data.items() if isinstance(v, int | float)})
    return [{"step": s, "metrics": rows[s]} for s in sorted(rows)]


def step_record(row: dict) -> dict:
    m = row["metrics"]
    rec = {"step": row["step"], **{k: m[k] for k in STEP_KEYS if k in m}}
    rec.update({k: v for k, v in m.items() if is_metric_key(k)})  # with the per-rank sync/tp<r>/... under TP
    rec["time_s"] = {phase: m[key] for phase, key in PHASES.items() if key in m}
    val = {k: v for k, v in m.items() if k.startswith("val-core/")}
    if val:
        rec["val"] = val
    return rec


def summarize(steps: list[dict]) -> dict:
    train = [s for s in steps if "critic/score/mean" in s]

    def col(key):
        return [s[key] for s in train if key in s]

    def med(phase):
        vals = [s["time_s"][phase] for s in train if phase in s["time_s"]]
        return statistics.median(vals) if vals else None

    out = {
        "steps": len(train),
        "reward_first": train[0]["critic/score/mean"] if train else None,
        "reward_last": train[-1]["critic/score/mean"] if train else None,
        "median_time_s": {p: med(p) for p in PHASES},
    }
    for key in ("mismatch/logp_abs_diff_mean", "mismatch/is_ratio_mean", "training/rollout_probs_diff_mean"):
        v = col(key)
        out[key + " (mean over steps)"] = statistics.fmean(v) if v else None
    for key in ("mismatch/logp_abs_diff_max", "mismatch/is_ratio_max"):
        v = col(key)
        out[key + " (max over steps)"] = max(v) if v else None
    both = [s for s in train if "mismatch/logp_equal_share" in s and "mismatch/tokens" in s]
    tokens = sum(s["mismatch/tokens"] for s in both)
    out[EQUAL_KEY] = (
        sum(s["mismatch/logp_equal_share"] * s["mismatch/tokens"] for s in both) / tokens if tokens else None
    )
    eq = col("sync/digests_equal")
    out["syncs_digest_checked"] = len(eq)
    out["digests_equal_every_sync"] = bool(eq) and all(v == 1.0 for v in eq)
    out["digests_compared_total"] = sum(col("sync/digests")) + sum(col("sync/arrival_digests"))
    vals = [v for s in steps for k, v in s.get("val", {}).items() if k.endswith("/mean@1")]
    out["val_reward"] = vals
    return out


STOP_GRACE_S = 5
"""Seconds between SIGTERM and SIGKILL to a stopped recipe's process group (a device call's limit is near)."""
POLL_S = 0.2
"""How often a running recipe is checked for its end, a SIGTERM to the benchmark and --recipe-timeout."""


class _SigTerm:
    noted = False
    """A SIGTERM came (the device call's limit): the running recipe is stopped, the benchmark writes and ends."""


def _note_sigterm(signum, frame):
    _SigTerm.noted = True  # only noted: an exception raised here could land anywhere (inside Popen, the write)


@contextlib.contextmanager
def _sigterm_stops():
    """Inside, SIGTERM stops the running recipe (`run_child` returns why) instead of killing the benchmark."""
    _SigTerm.noted = False
    previous = signal.signal(signal.SIGTERM, _note_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_each(names: list[str], run_one, result: dict, out: Path) -> None:
    """``result["runs"].append(run_one(name))`` for each name, `out` rewritten after each; a SIGTERM (during a
    run or while one is stopped) ends the loop after that run is written."""
    with _sigterm_stops():
        for name in names:
            result["runs"].append(run_one(name))
            out.write_text(json.dumps(result, indent=1))
            if _SigTerm.noted:
                break


def comma_list(p: argparse.ArgumentParser, raw: str, allowed, option: str) -> list[str]:
    """The non-empty items of a comma-separated `option`, each one of `allowed` (else `p.error` naming them)."""
    items = [x for x in raw.split(",") if x]
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        p.error(f"{option}: unknown {bad}; choose from {tuple(allowed)}")
    return items


NAIVE_OVERRIDES = (
    # the baseline is off-policy by construction: the lint reports it (kept in the log) and the run goes on
    "jetrl.proceed_on_lint_violation=true",
    # stock vLLM's block-FP8 Linears on DeepGEMM JIT-compile kernels per M: 3 min 10 s of warm-up before serving
    # on the H200, then the first 512-prompt generation had finished none of its requests after 2 min (unified
    # and bf16: under 1 min; likely more JIT for the M values the warm-up skipped) and the run outlasted the
    # device call. vLLM's ahead-of-time CUTLASS block-FP8 GEMM instead (no JIT): the same re-quantization of the
    # BF16 weights in vLLM (what makes this baseline off-policy), with fp32 scales where DeepGEMM's path rounds
    # them to powers of two (jetrl.lint.stock_vllm), i.e. a smaller rollout error than vLLM's default: a
    # conservative baseline (`-- "++ray_kwargs.ray_init.runtime_env.env_vars.VLLM_USE_DEEP_GEMM='1'"` restores
    # the default). The lint sees the same variable. Quoted: Ray takes string env values only
    "++ray_kwargs.ray_init.runtime_env.env_vars.VLLM_USE_DEEP_GEMM='0'",
)


def recipe_command(args, recipe: str, jsonl: Path) -> tuple[list[str], dict[str, str], str]:
    """The recipe's argv, its environment, and the command line as recorded."""
    argv = [
        "bash",
        str(RECIPE_SCRIPT),
        'trainer.logger=["console","file"]',
        "++ray_kwargs.ray_init.include_dashboard=False",
        f"++ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH={jsonl}",
        *(NAIVE_OVERRIDES if recipe == "naive-fp8-rollout" else ()),
        *args.overrides,
    ]
    base = "jetrl-unified" if recipe.startswith("jetrl-unified") else recipe
    shown = {"RECIPE": base, "STEPS": str(args.steps), "SEED": str(args.seed)}
    if recipe in ENGINE_OPS:
        shown["ENGINE_OPS"] = ENGINE_OPS[recipe]
    if recipe in NUMERICS:
        shown["NUMERICS"] = NUMERICS[recipe]
    env = {
        **os.environ,
        "ENGINE_OPS": "vllm",
        "NUMERICS": "hf",
        **shown,
        "PYTHON": sys.executable,
        "VERL_FILE_LOGGER_PATH": str(jsonl),
    }
    return argv, env, " ".join(f"{k}={v}" for k, v in shown.items()) + " " + shlex.join(argv)


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the recipe's process group (bash, python -m jetrl.verl, Ray's local instance), SIGKILL after
    `STOP_GRACE_S`."""
    for sig, wait_s in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def run_child(argv: list[str], env: dict, log: Path, limit_s: float | None) -> tuple[int | None, str | None]:
    """Run the recipe into `log`: (exit code, None), or (None, why) when it was stopped before it ended (a
    SIGTERM noted by `_sigterm_stops`, whenever it came, or `limit_s`)."""
    with log.open("w") as f:
        proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        t0 = time.monotonic()
        why = None
        while (rc := proc.poll()) is None and why is None:
            if _SigTerm.noted:
                why = "stopped by SIGTERM"
            elif limit_s is not None and time.monotonic() - t0 > limit_s:
                why = f"stopped by --recipe-timeout {limit_s:g} s"
            else:
                time.sleep(POLL_S)
        if why is None:
            return rc, None
        _stop_group(proc)
        return None, why


def record(name: str, command: str, rc: int | None, stopped: str | None, wall_s, logdir: Path, want: int) -> dict:
    """A run's result from the file logger's lines (``logdir/<name>.jsonl``) and its log (``<name>.log``),
    whether or not the run ended by itself; `want` steps were asked for."""
    jsonl, log = logdir / f"{name}.jsonl", logdir / f"{name}.log"
    res: dict = {"command": command, "returncode": rc, "wall_s": wall_s}
    rows = read_steps(jsonl) if jsonl.exists() else []
    steps = [step_record(r) for r in rows]
    res["steps"] = steps
    res["summary"] = summarize(steps)
    res["metrics"] = rows
    logged = f"{res['summary']['steps']} of {want} steps logged"
    if stopped:
        res["error"] = f"{stopped}, {logged}"
    elif rc != 0 or res["summary"]["steps"] < want:
        res["error"] = f"exit code {rc}, {logged}"
    if "error" in res and log.exists():
        res["log_tail"] = log.read_text(errors="replace").splitlines()[-LOG_TAIL:]
    return res


def run_recipe(args, recipe: str, logdir: Path) -> dict:
    jsonl = logdir / f"{recipe}.jsonl"
    jsonl.unlink(missing_ok=True)
    argv, env, command = recipe_command(args, recipe, jsonl)
    print(f"== {recipe}: {command}", flush=True)
    t0 = time.perf_counter()
    rc, stopped = run_child(argv, env, logdir / f"{recipe}.log", args.recipe_timeout)
    wall = round(time.perf_counter() - t0, 1)
    return {"recipe": recipe, **record(recipe, command, rc, stopped, wall, logdir, args.steps)}


def _fmt(v, spec=".3g") -> str:
    return "-" if v is None else format(v, spec)


EQUAL_KEY = "mismatch/logp_equal_share (over all steps' tokens)"
"""Absent from results written before the metric existed (the table shows '-')."""


def table(result: dict) -> str:
    head = (
        f"{'recipe':<21}{'steps':>6}{'reward 1st->last':>18}{'mean|dlogp|':>13}{'max|dlogp|':>12}{'equal':>8}"
        f"{'IS max':>8}{'digests ok':>11}{'rollout/logp/update/sync s (median)':>38}"
    )
    lines = [head, "-" * len(head)]
    for r in result["runs"]:
        s = r["summary"]
        t = s["median_time_s"]
        split = "/".join(_fmt(t.get(p), ".2f") for p in ("rollout", "old_logp", "update", "sync"))
        ok = f"{s['syncs_digest_checked']}/{s['steps']}" if s["syncs_digest_checked"] else "n/a"
        reward = _fmt(s["reward_first"], ".3f") + "->" + _fmt(s["reward_last"], ".3f")
        lines.append(
            f"{r['recipe']:<21}{s['steps']:>6}{reward:>18}"
            f"{_fmt(s['mismatch/logp_abs_diff_mean (mean over steps)']):>13}"
            f"{_fmt(s['mismatch/logp_abs_diff_max (max over steps)']):>12}"
            f"{_fmt(s.get(EQUAL_KEY), '.3f'):>8}"
            f"{_fmt(s['mismatch/is_ratio_max (max over steps)']):>8}{ok:>11}{split:>38}"
            + (f"   FAILED: {r['error']}" if "error" in r else "")
        )
    return "\n".join(lines)


META_KEYS = ("device", "versions", "date", "commit", "command")
"""`benchmeta.meta`'s keys: a merged run keeps those of the file it came from under ``meta``."""


CALL_KEYS = ("what", "steps_per_recipe", "seed")
"""A call's settings in a result's header: a merge keeps one only where every kept run's call had the same
value (otherwise each run's ``summary`` and ``meta.command`` say)."""


def merge(paths: list[Path], key: str = "recipe", order=RECIPES) -> dict:
    """One result from several (each run keeps its own ``meta`` of where and from what commit it ran); a later
    file's run of the same `key` (a recipe, a shape) replaces an earlier one; runs are listed in `order`."""
    runs: dict[str, dict] = {}
    calls: dict[str, dict] = {}
    result: dict = {}
    for path in paths:
        part = json.loads(path.read_text())
        result = {**part, "runs": []}
        for r in part["runs"]:
            meta = r.get("meta") or {k: part[k] for k in META_KEYS if k in part}
            runs[r[key]] = {**r, "meta": meta}
            calls[r[key]] = {k: part.get(k) for k in CALL_KEYS}
    result["runs"] = [runs[r] for r in order if r in runs]
    for k in CALL_KEYS:
        if len({calls[r][k] for r in runs}) > 1:
            result.pop(k, None)
    result["merged_from"] = [str(p) for p in paths]
    result["command"] = benchmeta.command()  # the merge's; each run's own is in its ``meta``
    return result


RATIOS = {
    ("jetrl-unified", "naive-fp8-rollout"): ("unified_over_naive_mean_dlogp", "unified / naive"),
    ("jetrl-unified", "bf16"): ("unified_over_bf16_mean_dlogp", "unified / bf16"),
    ("jetrl-unified-hf-ops", "naive-fp8-rollout"): ("unified_hf_ops_over_naive_mean_dlogp", "unified-hf-ops / naive"),
    ("jetrl-unified-hf-ops", "bf16"): ("unified_hf_ops_over_bf16_mean_dlogp", "unified-hf-ops / bf16"),
    ("jetrl-unified-fused-ops", "naive-fp8-rollout"): (
        "unified_fused_ops_over_naive_mean_dlogp",
        "unified-fused-ops / naive",
    ),
    ("jetrl-unified-fused-ops", "bf16"): ("unified_fused_ops_over_bf16_mean_dlogp", "unified-fused-ops / bf16"),
}
"""(run, baseline) -> (result key, printed name) of the run's mean |dlogp| over the baseline's."""


def finish(result: dict, out: Path, note: str | None = None) -> None:
    runs = {r["recipe"]: r["summary"] for r in result["runs"]}
    key = "mismatch/logp_abs_diff_mean (mean over steps)"
    ratios = {}
    for (run, base), (name, shown) in RATIOS.items():
        result.pop(name, None)  # a merged file's ratio may be stale
        if runs.get(run, {}).get(key) and runs.get(base, {}).get(key):
            result[name] = ratios[shown] = runs[run][key] / runs[base][key]
    if note:
        result["note"] = note
    out.write_text(json.dumps(result, indent=1))
    print(table(result))
    for shown, ratio in ratios.items():
        print(f"{shown} mean |dlogp|: {ratio:.3g}")
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.merge:
        result = merge(args.merge)
        finish(result, args.out, args.note)
        return 1 if any("error" in r for r in result["runs"]) else 0
    logdir = args.out.parent / (args.out.stem + "-logs")
    logdir.mkdir(exist_ok=True)
    result = {
        **benchmeta.meta(args.commit, extra_versions=("verl", "ray")),
        "what": "python -m jetrl.verl on Ray, recipes/tiny-arith-verl.sh per recipe (GRPO, arithmetic task, "
        "tiny ChatML Qwen3 after jetrl warmup), FSDP2 world size 1 + vLLM TP 1 colocated on one GPU",
        "steps_per_recipe": args.steps,
        "seed": args.seed,
        "runs": [],
    }
    run_each(args.recipes, lambda recipe: run_recipe(args, recipe, logdir), result, args.out)
    finish(result, args.out, args.note)
    print(f"logs in {logdir}")
    return 1 if any("error" in r for r in result["runs"]) else 0


if __name__ == "__main__":
    sys.exit(main())
