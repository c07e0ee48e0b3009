"""`jetrl export-verl CKPT`: the actor of a verl checkpoint as an HF checkpoint and, for an FP8 recipe, as the
vLLM block-FP8 checkpoint of the bytes its rollout was sent.

    jetrl export-verl CKPT [--out DIR] [--recipe NAME] [--fp8] [--overwrite]

``CKPT`` is one saved step of a verl run: ``<trainer.default_local_dir>/global_step_<N>`` or its ``actor``
folder, where verl's ``save_checkpoint`` put the FSDP shards (``model_world_size_<W>_rank_<r>.pt``) and
``huggingface/`` (config, tokenizer). Writes

- ``<out>/hf/``: verl's own model merger (`jetrl.verl.adapter.merge_fsdp_checkpoint`, what ``python -m
  verl.model_merger merge --backend fsdp`` runs): one HF checkpoint, every tensor the BF16 cast of its fp32
  master, the tokenizer, and ``jetrl.json`` (source, step, recipe);
- with ``--fp8``, ``<out>/fp8-block128/``: that policy converted with the run's recipe and written as a stock
  vLLM 128x128 block-FP8 checkpoint (`jetrl.rollout.checkpoint.write_fp8_export`). jetrl's verl engine
  quantizes each weight from FSDP's BF16 cast of the same master, in the forward and in the stream it sends
  the rollout, so these are the bytes and scales the rollout ran after that step's sync.

The recipe is the one ``jetrl.json`` beside the shards names (written by `jetrl.verl.engine.JetrlFSDPEngine`);
a checkpoint of stock verl (the ``bf16`` and ``naive-fp8-rollout`` recipes) has none: pass ``--recipe``. An FP8
export is refused for a recipe that trains BF16 Linears and for an actor that quantized from another dtype
than BF16 (the merger writes BF16). ``<out>`` defaults to ``<trainer.default_local_dir>/export/global_step_<N>``,
beside the step folders (verl's ``max_actor_ckpt_to_keep`` deletes those whole). Each directory is written
beside its place and renamed in. Exit status: 0 written, 2 bad arguments or checkpoint (one line naming it).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from jetrl.rollout.checkpoint import FP8_DIR, HF_DIR

__all__ = ["main", "build_parser", "export_checkpoint", "find_actor_dir", "ExportError", "HF_DIR", "FP8_DIR"]

_STEP_DIR = re.compile(r"global_step_(\d+)")


class ExportError(ValueError):
    """The checkpoint, its files or the arguments cannot give an export; the message names them."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jetrl export-verl",
        description="Write a verl checkpoint's actor as an HF checkpoint (and the vLLM block FP8 its rollout ran).",
    )
    p.add_argument("ckpt", metavar="CKPT", help="a verl checkpoint step: global_step_<N> or its actor folder")
    p.add_argument("--out", help="output directory (default: <run's checkpoint dir>/export/global_step_<N>)")
    p.add_argument("--recipe", help="the run's jetrl recipe (default: the one jetrl.json beside the shards names)")
    p.add_argument(
        "--fp8",
        action="store_true",
        help=f"also write <out>/{FP8_DIR}/, vLLM's 128x128 block-FP8 checkpoint of the actor's FP8 weights",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    return p


def find_actor_dir(ckpt: str | Path) -> Path:
    """The folder holding the actor's shards: `ckpt` itself or its ``actor`` subfolder."""
    p = Path(ckpt)
    if not p.is_dir():
        raise ExportError(f"{p}: no such directory")
    actor = p / "actor" if (p / "actor").is_dir() else p
    if not any(actor.glob("model_world_size_*_rank_0.pt")):
        raise ExportError(f"{actor}: no model_world_size_<W>_rank_0.pt (not a verl FSDP actor checkpoint)")
    if not (actor / "huggingface" / "config.json").is_file():
        raise ExportError(f"{actor / 'huggingface' / 'config.json'}: missing (verl writes it with the shards)")
    return actor


def _step_dir(actor: Path) -> Path | None:
    for p in (actor, actor.parent):
        if _STEP_DIR.fullmatch(p.name):
            return p
    return None


def _trained_with(actor: Path, recipe_name: str | None) -> dict:
    """What the actor trained with: ``jetrl.json`` beside the shards, with `recipe_name` checked against it."""
    from jetrl.recipe import RECIPE_NAMES
    from jetrl.verl.engine import CHECKPOINT_INFO

    path = actor / CHECKPOINT_INFO
    info: dict = {}
    if path.is_file():
        try:
            info = json.loads(path.read_text())
        except ValueError as e:
            raise ExportError(f"{path}: {e}") from None
        if not isinstance(info, dict) or not isinstance(info.get("recipe"), str):
            raise ExportError(f"{path}: no recipe in it")
    if recipe_name is not None and info and recipe_name != info["recipe"]:
        raise ExportError(f"--recipe {recipe_name}: the actor trained with {info['recipe']!r} ({path})")
    if recipe_name is None and not info:
        raise ExportError(
            f"{path}: missing (a checkpoint of stock verl, not of jetrl's engine): pass --recipe, one of {RECIPE_NAMES}"
        )
    return {"recipe": recipe_name, **info}


def export_checkpoint(
    ckpt: str | Path,
    *,
    out: str | Path | None = None,
    recipe: str | None = None,
    fp8: bool = False,
    overwrite: bool = False,
    log=print,
) -> dict[str, Path]:
    """Export the checkpoint (see the module doc); returns ``{"hf": path, "fp8": path}`` of what was written."""
    from jetrl.recipe import Recipe

    actor = find_actor_dir(ckpt)
    trained = _trained_with(actor, recipe)
    try:
        rec = Recipe.from_name(trained["recipe"])
    except ValueError as e:
        raise ExportError(f"recipe {trained['recipe']!r}: {e}") from None
    if fp8 and not rec.train_fp8:
        raise ExportError(
            f"--fp8: the actor trained with recipe {rec.name!r} (BF16 Linears); there are no trainer FP8 weights "
            "to export"
        )
    if fp8 and trained.get("param_dtype", "bfloat16") != "bfloat16":
        raise ExportError(
            f"--fp8: the actor quantized its weights from {trained['param_dtype']} (FSDP param_dtype), verl's merger "
            "writes BF16: the export would not be the bytes it trained with"
        )
    step_dir = _step_dir(actor)
    if out is None and step_dir is None:
        raise ExportError(f"{actor}: not inside a global_step_<N> folder; pass --out")
    root = Path(out) if out is not None else step_dir.parent / "export" / step_dir.name
    targets = {"hf": root / HF_DIR, **({"fp8": root / FP8_DIR} if fp8 else {})}
    taken = [str(p) for p in targets.values() if p.exists()]
    if taken and not overwrite:
        raise ExportError(f"{taken[0]} exists; pass --overwrite to replace it, or --out another directory")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from jetrl.rollout.checkpoint import write_export_dir, write_fp8_export
    from jetrl.verl.adapter import merge_fsdp_checkpoint

    step = trained.pop("global_step", None)
    if step_dir is not None:
        step = int(_STEP_DIR.fullmatch(step_dir.name).group(1))
    info = {"verl_checkpoint": str(actor), "step": step, **trained, "recipe": rec.name}
    written = {"hf": write_export_dir(targets["hf"], info, "hf-bf16", lambda tmp: merge_fsdp_checkpoint(actor, tmp))}
    log(f"export-verl: {actor} -> {targets['hf']} (HF, BF16 safetensors + tokenizer, verl's model merger)")
    if fp8:
        model = AutoModelForCausalLM.from_pretrained(targets["hf"], dtype=torch.bfloat16).eval()
        tok = AutoTokenizer.from_pretrained(targets["hf"])
        written["fp8"] = write_fp8_export(model, tok, rec, targets["fp8"], info)
        log(f"export-verl: -> {targets['fp8']} (vLLM 128x128 block FP8, the actor's weight bytes and scales)")
    return written


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    try:
        import jetrl.verl.adapter  # noqa: F401
    except ImportError as e:
        print(f"jetrl export-verl: verl is not importable ({e}); install verl 0.9.1 (the gpu extra)", file=sys.stderr)
        return 2
    try:
        export_checkpoint(args.ckpt, out=args.out, recipe=args.recipe, fp8=args.fp8, overwrite=args.overwrite)
    except ExportError as e:
        print(f"jetrl export-verl: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
