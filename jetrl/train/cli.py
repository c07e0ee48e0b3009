"""`jetrl train CONFIG [key=value ...]` and `python -m jetrl.train CONFIG`: run the local trainer."""

from __future__ import annotations

import argparse
import json
import sys

from .config import ConfigError, load_config
from .trainer import Trainer, TrainError

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jetrl train",
        description="Single-process GRPO/DAPO with vLLM rollouts, FP8 training and a byte-verified weight sync.",
    )
    p.add_argument("config", help="YAML (.yaml/.yml) or JSON (.json) config file")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="override config fields (YAML values)")
    p.add_argument("--resume", action="store_true", help="continue the run from its newest checkpoint")
    p.add_argument("--overwrite", action="store_true", help="replace an existing run directory")
    p.add_argument(
        "--dry-run", action="store_true", help="check the config and this machine, print the resolved config, exit"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_intermixed_args(argv)
    if args.resume and args.overwrite:
        print("jetrl train: --resume and --overwrite exclude each other", file=sys.stderr)
        return 2
    try:
        cfg = load_config(args.config, args.overrides)
        if args.dry_run:
            from .checks import check_environment

            check_environment(cfg)
            print(json.dumps(cfg.to_dict(), indent=2))
            print(f"dry run: config OK for this machine; outputs would go to {cfg.run_dir}")
            return 0
        trainer = Trainer(cfg, resume=args.resume, overwrite=args.overwrite)
    except ConfigError as e:
        print(f"jetrl train: bad config: {e}", file=sys.stderr)
        return 2
    except TrainError as e:
        print(f"jetrl train: {e}", file=sys.stderr)
        return 1
    try:
        summary = trainer.run()
    except TrainError as e:
        print(f"jetrl train: {e}", file=sys.stderr)
        return 1
    finally:
        trainer.close()
    print(json.dumps(summary, indent=2))
    return 0
