"""The graph builders: the training forward (captured), the jetrl-vLLM rollout (captured in the
live engine) and the stock-vLLM rollout (derived from settings, `jetrl.lint.stock_vllm`).

Both captures run the same probe: a fixed prompt of token ids (`probe_ids`). The trainer runs one
forward on it; the engine runs one greedy generate step, whose prefill processes exactly the same
tokens, and the recorder keeps each module's first call (that prefill). The numeric mode compares
the tensors of those two calls.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from jetrl.lint.capture import ModelTrace, Recorder, graph_from_trace, trace_model
from jetrl.lint.ir import Graph
from jetrl.recipe import Recipe

__all__ = [
    "LintEnvError",
    "probe_ids",
    "load_training_model",
    "TrainingCapture",
    "capture_training",
    "capture_converted",
    "capture_jetrl_vllm",
]


class LintEnvError(RuntimeError):
    """The lint cannot run here (missing checkpoint, vLLM absent, an engine that does not start)."""


def probe_ids(model_path: str | Path, length: int = 40, seed: int = 0) -> list[int]:
    """A deterministic probe prompt: BOS (if the config has one) then `length` ids drawn uniformly from the
    non-special vocabulary (every id below ``vocab_size`` but the config's pad/bos/eos ids and the special
    added tokens of the checkpoint's ``tokenizer.json``, if it has one)."""
    path = Path(model_path)
    cfg = json.loads((path / "config.json").read_text())
    vocab = int(cfg["vocab_size"])
    specials = {int(cfg[k]) for k in ("pad_token_id", "bos_token_id", "eos_token_id") if cfg.get(k) is not None}
    tok_file = path / "tokenizer.json"
    if tok_file.is_file():
        added = json.loads(tok_file.read_text()).get("added_tokens") or []
        specials |= {int(t["id"]) for t in added if t.get("special")}
    candidates = torch.tensor([i for i in range(vocab) if i not in specials])
    if not len(candidates):
        raise LintEnvError(f"{model_path}: no non-special token ids below vocab_size={vocab}")
    g = torch.Generator().manual_seed(seed)
    ids = candidates[torch.randint(0, len(candidates), (length,), generator=g)].tolist()
    bos = cfg.get("bos_token_id")
    return ([int(bos)] if bos is not None else []) + ids


def load_training_model(model_path: str | Path):
    """The trainer's HF model from a BF16 checkpoint (a ``quantization_config`` in config.json, which
    only describes how the rollout serves it, is ignored for the training side)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(model_path)
    if not (path / "config.json").is_file():
        raise LintEnvError(f"--model {model_path}: not an HF checkpoint directory (no config.json)")
    cfg = AutoConfig.from_pretrained(path)
    if getattr(cfg, "quantization_config", None) is not None:
        del cfg.quantization_config
    try:
        model = AutoModelForCausalLM.from_pretrained(path, config=cfg, dtype=torch.bfloat16)
    except Exception as e:  # noqa: BLE001 - re-raised with the reason the lint needs a BF16 checkpoint
        raise LintEnvError(
            f"cannot load {model_path} as the trainer's BF16 HF model ({type(e).__name__}: {e}); the training "
            "graph is captured from the trainer's BF16 checkpoint (give an FP8 export with --served: "
            "jetrl export RUN_DIR --fp8 writes both)"
        ) from e
    bad = [n for n, p in model.named_parameters() if p.is_floating_point() and p.dtype != torch.bfloat16]
    if bad:
        raise LintEnvError(f"{model_path}: parameters {bad[:3]} are not bf16; the trainer's checkpoint is BF16")
    return model.eval()


@dataclass
class TrainingCapture:
    graph: Graph
    trace: ModelTrace
    conversion: Any
    """jetrl.convert.ConversionReport of the conversion the graph was captured from."""


def capture_training(
    model_path: str | Path,
    recipe: Recipe,
    *,
    probe: list[int],
    name_filter: Callable[[str], bool] | str | None = None,
    backend: str = "auto",
    keep_tensors: bool = False,
) -> TrainingCapture:
    """Convert the trainer's model with `recipe` (`jetrl.convert.convert_model`) and capture its
    forward on `probe` (batch of one)."""
    from jetrl.convert import convert_model
    from jetrl.gemm import get_backend

    model = load_training_model(model_path)
    if recipe.train_fp8 and get_backend(backend).device_type == "cuda":
        model = model.cuda()  # the GPU backends take CUDA operands; the trace keeps CPU copies
    report = convert_model(model, recipe, backend=backend, name_filter=name_filter)
    return capture_converted(model, report, recipe, probe=probe, keep_tensors=keep_tensors)


def capture_converted(
    model, report, recipe: Recipe, *, probe: list[int], keep_tensors: bool = False
) -> TrainingCapture:
    """Capture the forward of an already converted trainer model (`report`: its ConversionReport) on
    `probe`. For models whose modules were changed after conversion (e.g. fused norm+quantize)."""
    reasons = {e.name: e.reason for e in report.entries}
    ids = torch.tensor([probe], dtype=torch.long, device=next(model.parameters()).device)
    with torch.no_grad(), Recorder(model, keep_tensors=keep_tensors) as rec:
        model(input_ids=ids)
    n_fp8 = len(report.converted_names())
    source = (
        f"captured: {type(model).__name__} converted with recipe {recipe.name!r} "
        f"({n_fp8}/{len(report.entries)} Linears FP8), probe of {len(probe)} tokens"
    )
    trace = trace_model(model, rec, side="training", source=source, conversion=reasons)
    graph = graph_from_trace(trace)
    graph.meta.update({"recipe": recipe.name, "conversion": report.to_dict()})
    return TrainingCapture(graph, trace, report)


_LIVE_RECORDERS: dict[str, Recorder] = {}
"""Recorders `capture_jetrl_vllm` installed, in the process that holds the engine's model (this one, or vLLM's
worker), by key until their trace is collected."""


def _install_recorder(model, key: str, keep_tensors: bool) -> bool:
    rec = Recorder(model, keep_tensors=keep_tensors)
    rec.__enter__()
    _LIVE_RECORDERS[key] = rec
    return True


def _collect_trace(model, key: str, source: str) -> ModelTrace:
    rec = _LIVE_RECORDERS.pop(key)
    rec.__exit__(None, None, None)
    return trace_model(model, rec, side="rollout", source=source)


def capture_jetrl_vllm(engine, *, probe: list[int], keep_tensors: bool = False) -> tuple[Graph, ModelTrace]:
    """Capture the rollout graph inside a live engine (`jetrl.rollout.adapter.Engine`, its model in this process
    or in vLLM's worker): install a `Recorder` on the model, run one greedy generate step on `probe`, collect
    (module-level functions through `Engine.apply`, so they reach a worker process too)."""
    key = uuid.uuid4().hex
    q = getattr(engine, "quantization", None)
    src = f"captured in a live vLLM engine (quantization={q}, recipe {engine.recipe.name!r}), probe prefill"
    engine.reset_prefix_cache()  # a cached prefix would skip the probe's prefill
    engine.apply(partial(_install_recorder, key=key, keep_tensors=keep_tensors))
    try:
        engine.generate([probe], max_tokens=1, temperature=0.0, seed=0)
    finally:
        traces = engine.apply(partial(_collect_trace, key=key, source=src))
    if len(traces) != 1:
        raise LintEnvError(f"capture_jetrl_vllm: expected one worker, got {len(traces)} (tensor parallel capture)")
    trace = traces[0]
    graph = graph_from_trace(trace)
    graph.meta.update({"engine": "jetrl-vllm", "recipe": engine.recipe.name, "quantization": engine.quantization})
    return graph, trace
