"""`lint(...)`: build both graphs, normalize, check, optionally compare numerically; return a LintReport."""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from jetrl.lint.builders import LintEnvError, TrainingCapture, capture_jetrl_vllm, capture_training, probe_ids
from jetrl.lint.check import check
from jetrl.lint.ir import Graph, iter_linear_sites
from jetrl.lint.normalize import normalize
from jetrl.lint.report import Finding, LintReport, Severity, group_findings
from jetrl.lint.stock_vllm import StockVllmSettings, build_stock_rollout_graph
from jetrl.recipe import Recipe

__all__ = ["lint", "ROLLOUTS", "LintEnvError"]

ROLLOUTS = ("jetrl-vllm", "stock-vllm")


def _summary(g: Graph) -> dict[str, Any]:
    sites = list(iter_linear_sites(g))
    quantized = [n for n in sites if g.inputs(n.id)["w"].precision.quantized]
    return {
        "source": g.source,
        "n_nodes": len(g.nodes),
        "n_edges": len(g.edges),
        "n_linears": len(sites),
        "n_quantized_linears": len(quantized),
    }


def _declared_findings(g: Graph) -> list[Finding]:
    out = []
    for key, msg in g.meta.get("declared_vs_observed", {}).items():
        module, _, tensor = key.rpartition(":")
        out.append(
            Finding(
                Severity.ERROR,
                "declared-vs-observed",
                f"{g.side}: {msg}",
                rollout_module=module if g.side == "rollout" else "",
                training_module=module if g.side == "training" else "",
                tensor=tensor,
                fix="the code path ignores the recipe's spec: fix the recipe to what the ops compute, or the ops",
            )
        )
    return out


def lint(
    model_path: str | Path,
    recipe: Recipe | str,
    rollout: str = "jetrl-vllm",
    numeric: bool = False,
    *,
    rollout_recipe: Recipe | str | None = None,
    train_name_filter: Callable[[str], bool] | str | None = None,
    stock: StockVllmSettings | None = None,
    engine: Any = None,
    probe: list[int] | None = None,
    backend: str = "auto",
    max_model_len: int = 256,
    training: TrainingCapture | None = None,
    served_path: str | Path | None = None,
    engine_kwargs: dict[str, Any] | None = None,
) -> LintReport:
    """Prove (or refute) G_rollout ⊆ G_train_fwd for the checkpoint at `model_path`.

    - `recipe`: the training recipe (the trainer converts its model with it). `rollout_recipe`: the
      rollout engine's recipe when it differs (default: `recipe`).
    - `rollout`: ``"jetrl-vllm"`` (a live vLLM engine with jetrl's method, captured; pass `engine` to
      reuse a started `jetrl.rollout.adapter.Engine`) or ``"stock-vllm"`` (derived from `stock`,
      default `StockVllmSettings.from_environment(model_path)`; no engine is started).
    - `numeric`: also run the probe through both sides and compare per layer (jetrl-vllm only).
    - `train_name_filter`: forwarded to `jetrl.convert.convert_model` (which Linears the trainer converts).
    - `training`: a `capture_training` result to reuse (same recipe and probe; with tensors for `numeric`).
    - `served_path`: the checkpoint the rollout serves when it is not `model_path` (e.g. the trainer's FP8
      export, `jetrl.rollout.checkpoint.save_fp8_checkpoint`): the jetrl-vllm engine loads it, the
      stock-vllm settings read its ``quantization_config`` (unless `stock` is given). `model_path` is
      always the trainer's BF16 checkpoint.

    `engine_kwargs` go to `jetrl.rollout.adapter.create_engine` when the lint starts the engine itself
    (e.g. ``kv_cache_dtype``).

    Without `engine`, a jetrl-vllm lint starts an in-process engine and closes it at the end; closing an
    in-process vLLM engine tears down vLLM's global parallel state, so pass `engine` when the process
    keeps using another live engine (the trainer does).

    Raises `LintEnvError` when the lint cannot run here (the CLI's exit code 2).
    """
    if rollout not in ROLLOUTS:
        raise ValueError(f"rollout={rollout!r}: choose one of {ROLLOUTS}")
    recipe = Recipe.from_name(recipe) if isinstance(recipe, str) else recipe
    if engine is not None:
        if rollout != "jetrl-vllm":
            raise ValueError("engine= is only used with rollout='jetrl-vllm'")
        if rollout_recipe is not None and _name(rollout_recipe) != engine.recipe.name:
            raise ValueError(f"rollout_recipe {_name(rollout_recipe)!r} but the engine runs {engine.recipe.name!r}")
        r_recipe = engine.recipe
    else:
        r_recipe = recipe if rollout_recipe is None else rollout_recipe
        r_recipe = Recipe.from_name(r_recipe) if isinstance(r_recipe, str) else r_recipe
    if numeric and rollout == "stock-vllm":
        raise LintEnvError(
            "numeric mode needs a live engine; the stock-vllm rollout is derived from its settings (stock vLLM "
            "block FP8 runs on sm_90 GPUs only); run --numeric with --rollout jetrl-vllm"
        )
    model_path = Path(model_path)
    probe = probe if probe is not None else probe_ids(model_path)

    if training is None:
        train = capture_training(
            model_path, recipe, probe=probe, name_filter=train_name_filter, backend=backend, keep_tensors=numeric
        )
    else:
        if training.graph.meta.get("recipe") != recipe.name:
            raise ValueError(
                f"training capture was made with recipe {training.graph.meta.get('recipe')!r}, not {recipe.name!r}"
            )
        if numeric and not training.trace.tensors:
            raise ValueError("numeric=True needs a training capture made with keep_tensors=True")
        train = training
    r_trace = None
    if torch.cuda.is_available():  # the capture's CUDA model is garbage now: give its memory back for the engine
        gc.collect()
        torch.cuda.empty_cache()
    if rollout == "stock-vllm":
        served = Path(served_path) if served_path is not None else model_path
        settings = stock if stock is not None else StockVllmSettings.from_environment(served)
        r_graph = build_stock_rollout_graph(model_path, settings)
    else:
        own = engine is None
        if own:
            served = Path(served_path) if served_path is not None else model_path
            engine = _start_engine(served, r_recipe, backend, max_model_len, engine_kwargs or {})
        try:
            r_graph, r_trace = capture_jetrl_vllm(engine, probe=probe, keep_tensors=numeric)
        finally:
            if own:
                engine.close()

    t_norm, t_find, t_rules = normalize(train.graph)
    r_norm, r_find, r_rules = normalize(r_graph)
    findings = group_findings(t_find + r_find + _declared_findings(train.graph) + _declared_findings(r_graph))
    findings += check(t_norm, r_norm)
    report = LintReport(
        model=str(model_path),
        recipe=_recipe_label(recipe, r_recipe if rollout == "jetrl-vllm" else recipe),
        rollout=rollout,
        findings=findings,
        training_summary=_summary(t_norm),
        rollout_summary=_summary(r_norm),
        normalizations=[f"training: {r}" for r in t_rules] + [f"rollout: {r}" for r in r_rules],
        graphs={"training": t_norm.to_dict(), "rollout": r_norm.to_dict(), "rollout_raw": r_graph.to_dict()},
    )
    if numeric:
        from jetrl.lint.numeric import compare_numeric

        report.numeric, num_findings = compare_numeric(train.trace, r_trace, probe_len=len(probe))
        report.findings.extend(num_findings)
    report.findings.sort(key=lambda f: f.severity != Severity.ERROR)  # errors first, each group in graph order
    return report


def _recipe_label(train: Recipe, roll: Recipe) -> str:
    if train == roll:
        return train.name
    diff = [f.name for f in dataclasses.fields(Recipe) if getattr(train, f.name) != getattr(roll, f.name)]
    return f"{train.name} (rollout recipe {roll.name} differs in {', '.join(diff)})"


def _name(r: Recipe | str) -> str:
    return r if isinstance(r, str) else r.name


LINT_KV_CACHE_BYTES = 256 << 20
"""KV cache of the lint's own engine (one probe prefill), unless `engine_kwargs` size it: vLLM's default
gpu_memory_utilization (0.9) would hold ~126 GB of an H200 in the lint's process, which ``python -m jetrl.verl``
runs just before verl starts its own engines on the same GPU."""


def _start_engine(model_path: Path, recipe: Recipe, backend: str, max_model_len: int, kw: dict[str, Any]):
    try:
        from jetrl.rollout.adapter import create_engine
    except ImportError as e:
        raise LintEnvError(f"--rollout jetrl-vllm needs vLLM and jetrl.rollout.adapter: {e}") from e
    if "gpu_memory_utilization" not in kw and "kv_cache_memory_bytes" not in kw:
        kw = {**kw, "kv_cache_memory_bytes": LINT_KV_CACHE_BYTES}
        if torch.cuda.is_available():
            # vLLM refuses to start unless gpu_memory_utilization x total is free, even with a fixed KV cache:
            # ask for what is free now (the training capture's model was released above)
            free, total = torch.cuda.mem_get_info()
            kw["gpu_memory_utilization"] = max(0.01, round(free / total - 0.02, 2))
    try:
        return create_engine(model_path, recipe, seed=0, max_model_len=max_model_len, backend=backend, **kw)
    except Exception as e:  # noqa: BLE001 - any engine start failure is an environment error for the CLI
        raise LintEnvError(f"the vLLM engine did not start for {model_path} ({type(e).__name__}: {e})") from e
