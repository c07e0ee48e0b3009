"""`jetrl lint`: prove the rollout precision graph is a subgraph of the training forward graph.

    jetrl lint --model PATH --recipe NAME --rollout {jetrl-vllm,stock-vllm} [--numeric] [--json]

``--model`` is the trainer's BF16 HF checkpoint: ``jetrl export RUN_DIR`` writes one for a run
(``RUN_DIR/export/step_N/hf``, with a ``jetrl.json`` naming the run's recipe and numerics). ``--numeric``
captures the trainer with the run's own numerics between the Linears (``--numerics auto``: the export's
``jetrl.json``; without one, 'vllm-cpu' when the engine runs on CPU, as ``jetrl train`` does there, else 'hf').
'strict' (CUDA, ``--engine-ops hf``) puts this process in vLLM's batch-invariant mode before its first GEMM and
starts the engine strict, as ``jetrl train`` with ``model.numerics: strict`` runs both sides.

Exit status: 0 consistent (warnings allowed), 1 violations, 2 usage or environment errors.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import traceback
from pathlib import Path

from jetrl.recipe import RECIPE_NAMES, RecipeError

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jetrl lint",
        description="Check that every rollout op and tensor precision maps onto the training forward graph.",
    )
    p.add_argument(
        "--model",
        required=True,
        help="the trainer's HF checkpoint directory (BF16), e.g. what `jetrl export RUN_DIR` writes",
    )
    p.add_argument("--recipe", required=True, choices=RECIPE_NAMES, help="the training recipe")
    p.add_argument("--rollout", choices=("jetrl-vllm", "stock-vllm"), default="jetrl-vllm", help="the rollout engine")
    p.add_argument("--numeric", action="store_true", help="also compare both sides numerically on a probe")
    p.add_argument(
        "--numerics",
        choices=("auto", "hf", "vllm-cpu", "strict"),
        default="auto",
        help="--numeric: the trainer's ops between the Linears (auto: the export's jetrl.json, else vllm-cpu on a "
        "CPU engine, hf on GPU; strict: CUDA, both sides batch-invariant, with --engine-ops hf)",
    )
    p.add_argument(
        "--engine-ops",
        choices=("auto", "vllm", "hf"),
        default="auto",
        help="jetrl-vllm: the engine's ops between the Linears (rollout.engine_ops; auto: the export's jetrl.json, "
        "else vllm)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--backend", default="auto", help="jetrl.gemm backend of the trainer and the jetrl_fp8 engine")
    p.add_argument(
        "--served",
        help="the checkpoint the rollout serves, e.g. the trainer's FP8 export (default: --model); stock-vllm "
        "reads its quantization_config, jetrl-vllm starts the engine from it",
    )
    stock = p.add_argument_group("stock-vllm settings (the environment's VLLM_* variables are read too)")
    stock.add_argument("--quantization", choices=("fp8_per_tensor", "fp8_per_block"), help="online --quantization")
    p.add_argument("--kv-cache-dtype", default="auto", help="vLLM kv_cache_dtype (auto, fp8, fp8_e4m3, ...)")
    stock.add_argument("--tensor-parallel-size", type=int, default=1, help="vLLM tensor_parallel_size")
    stock.add_argument(
        "--quant-op", choices=("cuda", "native"), default="cuda", help="vLLM QuantFP8 implementation (custom op or not)"
    )
    return p


def _export_info(model: str) -> tuple[Path, dict | None]:
    """(path, content) of the export's ``jetrl.json`` (content None when there is none); a file that is not
    a JSON object raises ValueError naming it."""
    meta = Path(model) / "jetrl.json"
    if not meta.is_file():
        return meta, None
    try:
        info = json.loads(meta.read_text())
    except ValueError:
        info = None
    if not isinstance(info, dict):
        raise ValueError(f"{meta}: not a JSON object (what `jetrl export` writes)")
    return meta, info


def resolve_numerics(choice: str, model: str, rollout: str) -> str:
    """The trainer numerics of `--numerics` (see the module doc)."""
    if choice != "auto":
        return choice
    meta, info = _export_info(model)
    if info is not None:
        if not isinstance(info.get("numerics"), str):
            raise ValueError(f"{meta}: no readable 'numerics' entry; pass --numerics hf|vllm-cpu|strict")
        return info["numerics"]
    import torch

    return "vllm-cpu" if rollout == "jetrl-vllm" and not torch.cuda.is_available() else "hf"


def resolve_engine_ops(choice: str, model: str) -> str:
    """The engine ops of `--engine-ops` (auto: the export's ``jetrl.json``, else 'vllm')."""
    if choice != "auto":
        return choice
    meta, info = _export_info(model)
    ops = (info or {}).get("engine_ops", "vllm")
    if ops == "fused":
        raise ValueError(
            f"{meta}: the run's engine ran engine_ops 'fused'; the lint captures the trainer unfused, so pass "
            "--engine-ops hf (the same formulas through transformers' modules)"
        )
    return ops


def check_strict(rollout: str, engine_ops: str) -> None:
    """``--numerics strict`` needs jetrl's engine with the trainer's ops, on CUDA (ValueError naming the flag)."""
    import torch

    if rollout != "jetrl-vllm":
        raise ValueError("--numerics strict compares with a live strict engine: use --rollout jetrl-vllm")
    if engine_ops != "hf":
        raise ValueError(
            f"--numerics strict needs the trainer's norms, RoPE and SiLU-and-mul in the engine: --engine-ops hf "
            f"(resolved: {engine_ops})"
        )
    if not torch.cuda.is_available():
        raise ValueError("--numerics strict runs vLLM's CUDA kernels on both sides: it needs a GPU")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as e:  # argparse: --help exits 0, usage errors 2
        return int(e.code or 0)
    if args.rollout == "jetrl-vllm":
        misplaced = {
            "--quantization": args.quantization is not None,
            "--tensor-parallel-size": args.tensor_parallel_size != 1,
            "--quant-op": args.quant_op != "cuda",
        }
        where = "stock-vllm"
    else:
        misplaced, where = {"--engine-ops": args.engine_ops not in ("auto", "vllm")}, "jetrl-vllm"
    bad = [flag for flag, given in misplaced.items() if given]
    if bad:
        print(f"jetrl lint: error: {', '.join(bad)} only apply to --rollout {where}", file=sys.stderr)
        return 2
    from jetrl.lint.api import LintEnvError, lint
    from jetrl.lint.layout import LayoutError
    from jetrl.lint.stock_vllm import StockConfigError, StockVllmSettings

    try:
        numerics = resolve_numerics(args.numerics, args.model, args.rollout) if args.numeric else None
        engine_ops = resolve_engine_ops(args.engine_ops, args.model) if args.rollout == "jetrl-vllm" else "vllm"
        if engine_ops != "vllm" and numerics == "vllm-cpu":
            raise ValueError(f"--engine-ops {engine_ops} runs the trainer's ops in the engine; use --numerics hf")
        if numerics == "strict":
            check_strict(args.rollout, engine_ops)
    except ValueError as e:
        print(f"jetrl lint: error: {e}", file=sys.stderr)
        return 2
    if numerics == "strict":  # before this process's first GEMM: cuBLAS reads its limits then
        from jetrl.rollout.adapter import enable_batch_invariance

        enable_batch_invariance()
    try:
        stock = None
        if args.rollout == "stock-vllm":
            stock = StockVllmSettings.from_environment(
                args.served or args.model,
                quantization=args.quantization,
                kv_cache_dtype=args.kv_cache_dtype,
                tensor_parallel_size=args.tensor_parallel_size,
                quant_op=args.quant_op,
            )
        # vLLM logs to stdout (its handler binds sys.stdout when vllm is first imported, inside this
        # block): send it to stderr so stdout carries only the report (--json must stay parseable)
        with contextlib.redirect_stdout(sys.stderr):
            training = probe = None
            if numerics in ("vllm-cpu", "strict") and args.rollout == "jetrl-vllm":
                from jetrl.lint.builders import probe_ids
                from jetrl.lint.numeric import capture_training_numerics
                from jetrl.recipe import Recipe

                probe = probe_ids(Path(args.model))
                training = capture_training_numerics(
                    args.model, Recipe.from_name(args.recipe), numerics=numerics, probe=probe, backend=args.backend
                )
            report = lint(
                args.model,
                args.recipe,
                args.rollout,
                args.numeric,
                stock=stock,
                backend=args.backend,
                served_path=args.served,
                engine_kwargs=(
                    {"kv_cache_dtype": args.kv_cache_dtype, "engine_ops": engine_ops, "strict": numerics == "strict"}
                    if args.rollout == "jetrl-vllm"
                    else None
                ),
                training=training,
                probe=probe,
            )
    except (LintEnvError, LayoutError, StockConfigError, RecipeError, FileNotFoundError) as e:
        print(f"jetrl lint: error: {e}", file=sys.stderr)
        return 2
    except Exception:  # noqa: BLE001 - a crash must not read as "violations" (exit 1): report it, exit 2
        traceback.print_exc()
        print("jetrl lint: error: the lint itself failed (traceback above)", file=sys.stderr)
        return 2
    print(report.to_json() if args.json else report.table())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
