"""`jetrl export RUN_DIR`: take the trained policy out of a run as an HF checkpoint (and vLLM block FP8).

    jetrl export RUN_DIR [--step N] [--out DIR] [--fp8] [--overwrite]

Reads the run's ``config.json`` and its newest checkpoint that verifies (or ``--step N``), loads the
run's start checkpoint (``model.path``, or the embedded tiny model's cached warm-up, rebuilt if it was
deleted: it is deterministic), puts the checkpoint's fp32 masters into it by parameter name, rounded to
BF16 as the trainer's compute weights are, and writes

- ``<out>/hf/``: ``save_pretrained`` with safetensors, the tokenizer, and ``jetrl.json`` (run, step,
  recipe, ``model.numerics``). This is the ``--model CKPT`` of ``jetrl lint``, which reads ``jetrl.json``
  to capture the trainer with the run's own numerics;
- with ``--fp8``, ``<out>/fp8-block128/``: the same policy converted with the run's recipe and written
  as a stock vLLM 128x128 block-FP8 checkpoint (`jetrl.rollout.checkpoint.save_fp8_checkpoint`: the
  trainer's own FP8 weight bytes and scales), servable by stock vLLM and by ``jetrl lint --served``.

``<out>`` defaults to ``RUN_DIR/export/step_NNNNNN``; an existing one is replaced only with
``--overwrite``. Each directory is written beside its place and renamed in, so a failed export leaves
none. Exit status: 0 written, 1 nothing to export (no checkpoint that verifies), 2 bad arguments, run
directory or files (one line naming them).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from jetrl.rollout.checkpoint import FP8_DIR, HF_DIR

__all__ = ["main", "build_parser", "export_run", "ExportError", "HF_DIR", "FP8_DIR"]


class ExportError(ValueError):
    """The run directory, its files or the arguments cannot give an export; the message names them."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jetrl export", description="Write a run's trained policy as an HF checkpoint (and vLLM block FP8)."
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a `jetrl train` run directory (runs/<name>)")
    p.add_argument("--step", type=int, help="export this checkpoint step (default: the newest that verifies)")
    p.add_argument("--out", help="output directory (default: RUN_DIR/export/step_NNNNNN)")
    p.add_argument(
        "--fp8",
        action="store_true",
        help=f"also write <out>/{FP8_DIR}/, vLLM's 128x128 block-FP8 checkpoint of the trainer's FP8 weights",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    return p


def _load_state(run_dir: Path, step: int | None, log) -> tuple[int, dict[str, Any]]:
    from .checkpoint import load_checkpoint, load_latest

    ckpts = run_dir / "checkpoints"
    if step is not None:
        p = ckpts / f"step_{step:06d}"
        if not p.is_dir():
            raise ExportError(f"--step {step}: {p} does not exist")
        return load_checkpoint(p)
    found = load_latest(ckpts)
    for path, why in found.skipped:
        log(f"export: skipped {path.name}: {why}")
    return found.step, found.state


def _tokenizer(init_path: Path, tiny: bool):
    if tiny:
        from jetrl.tiny import CharTokenizer

        return CharTokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(init_path)


def _save_tokenizer(tok, path: Path) -> None:
    (tok.save if hasattr(tok, "save") else tok.save_pretrained)(path)


def _policy(init_path: Path, state: dict[str, Any]):
    """The start checkpoint's HF model (BF16) with the checkpoint's masters in it, by parameter name."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(init_path, dtype=torch.bfloat16)
    names = state.get("params")
    masters = state.get("optimizer", {}).get("masters")
    if not isinstance(names, list) or not isinstance(masters, list) or len(names) != len(masters):
        raise ExportError("the checkpoint does not name the parameters of its masters (written by an older jetrl?)")
    params = dict(model.named_parameters())
    missing = [n for n in names if n not in params]
    if missing:
        raise ExportError(f"the checkpoint's parameters {missing[:3]} are not in the model of {init_path}")
    with torch.no_grad():
        for name, m in zip(names, masters, strict=True):
            p = params[name]
            if tuple(p.shape) != tuple(m.shape):
                raise ExportError(f"{name}: checkpoint shape {tuple(m.shape)}, model {tuple(p.shape)}")
            p.copy_(m.to(p.dtype))  # the trainer's compute weight: the master rounded to BF16
    return model.eval()


def export_run(
    run_dir: str | Path,
    *,
    step: int | None = None,
    out: str | Path | None = None,
    fp8: bool = False,
    overwrite: bool = False,
    log=print,
) -> dict[str, Path]:
    """Export the run (see the module doc); returns ``{"hf": path, "fp8": path}`` of what was written."""
    from .config import ConfigError, config_from_dict

    run = Path(run_dir)
    cfg_path = run / "config.json"
    if not run.is_dir():
        raise ExportError(f"{run}: no such run directory")
    if not cfg_path.is_file():
        raise ExportError(f"{cfg_path}: missing ({run} is not a jetrl train run directory)")
    try:
        cfg = config_from_dict(json.loads(cfg_path.read_text()))
    except (ValueError, ConfigError) as e:  # json.JSONDecodeError is a ValueError
        raise ExportError(f"{cfg_path}: {e}") from None
    from jetrl.recipe import Recipe

    recipe = Recipe.from_name(cfg.run.recipe)
    if fp8 and not recipe.train_fp8:
        raise ExportError(
            f"--fp8: the run trained with recipe {recipe.name!r} (BF16 Linears); there are no trainer FP8 weights "
            "to export"
        )
    got_step, state = _load_state(run, step, log)
    root = Path(out) if out is not None else run / "export" / f"step_{got_step:06d}"
    targets = {"hf": root / HF_DIR, **({"fp8": root / FP8_DIR} if fp8 else {})}
    taken = [str(p) for p in targets.values() if p.exists()]
    if taken and not overwrite:
        raise ExportError(f"{taken[0]} exists; pass --overwrite to replace it, or --out another directory")

    from .modelfiles import check_model_dir
    from .warmup import prepare_initial_checkpoint

    if cfg.model.path is not None:
        check_model_dir(cfg.model.path)
    init_path = prepare_initial_checkpoint(cfg, log=log)
    model = _policy(init_path, state)
    tok = _tokenizer(init_path, tiny=cfg.model.path is None)
    info = {
        "run_dir": str(run),
        "step": got_step,
        "recipe": recipe.name,
        "numerics": cfg.model.numerics,
        "engine_ops": cfg.rollout.engine_ops,
        "gemm_backend": cfg.run.gemm_backend,
        "start_checkpoint": str(init_path),
    }
    from jetrl.rollout.checkpoint import write_export_dir, write_fp8_export

    def write_hf(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        _save_tokenizer(tok, tmp)

    written = {"hf": write_export_dir(targets["hf"], info, "hf-bf16", write_hf)}
    log(f"export: step {got_step} of {run} -> {targets['hf']} (HF, BF16 safetensors + tokenizer)")
    if fp8:
        written["fp8"] = write_fp8_export(model, tok, recipe, targets["fp8"], info)
        log(f"export: -> {targets['fp8']} (vLLM 128x128 block FP8, the trainer's weight bytes and scales)")
    return written


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    from .cli import quiet_engine_logs

    quiet_engine_logs(verbose=False)
    from .checkpoint import CheckpointError
    from .modelfiles import ModelFileError

    try:
        export_run(args.run_dir, step=args.step, out=args.out, fp8=args.fp8, overwrite=args.overwrite)
    except (ExportError, ModelFileError) as e:
        print(f"jetrl export: {e}", file=sys.stderr)
        return 2
    except CheckpointError as e:
        print(f"jetrl export: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
