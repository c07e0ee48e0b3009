"""`jetrl lint`: prove the rollout precision graph is a subgraph of the training forward graph.

    jetrl lint --model PATH --recipe NAME --rollout {jetrl-vllm,stock-vllm} [--numeric] [--json]

Exit status: 0 consistent (warnings allowed), 1 violations, 2 usage or environment errors.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import traceback

from jetrl.recipe import RECIPE_NAMES, RecipeError

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jetrl lint",
        description="Check that every rollout op and tensor precision maps onto the training forward graph.",
    )
    p.add_argument("--model", required=True, help="the trainer's HF checkpoint directory (BF16)")
    p.add_argument("--recipe", required=True, choices=RECIPE_NAMES, help="the training recipe")
    p.add_argument("--rollout", choices=("jetrl-vllm", "stock-vllm"), default="jetrl-vllm", help="the rollout engine")
    p.add_argument("--numeric", action="store_true", help="also compare both sides numerically on a probe")
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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as e:  # argparse: --help exits 0, usage errors 2
        return int(e.code or 0)
    if args.rollout == "jetrl-vllm":
        stock_only = {
            "--quantization": args.quantization is not None,
            "--tensor-parallel-size": args.tensor_parallel_size != 1,
            "--quant-op": args.quant_op != "cuda",
        }
        bad = [flag for flag, given in stock_only.items() if given]
        if bad:
            print(f"jetrl lint: error: {', '.join(bad)} only apply to --rollout stock-vllm", file=sys.stderr)
            return 2
    from jetrl.lint.api import LintEnvError, lint
    from jetrl.lint.layout import LayoutError
    from jetrl.lint.stock_vllm import StockConfigError, StockVllmSettings

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
            report = lint(
                args.model,
                args.recipe,
                args.rollout,
                args.numeric,
                stock=stock,
                backend=args.backend,
                served_path=args.served,
                engine_kwargs={"kv_cache_dtype": args.kv_cache_dtype} if args.rollout == "jetrl-vllm" else None,
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
