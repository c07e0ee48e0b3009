"""`jetrl` command line: a thin dispatcher to the subcommands' own `main(argv)` functions."""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module with main(argv) -> int, one-line help)
SUBCOMMANDS = {
    "lint": ("jetrl.lint.cli", "prove the rollout precision graph is a subgraph of the training forward graph"),
    "train": ("jetrl.train.cli", "run the local GRPO/DAPO trainer from a config file"),
    "warmup": ("jetrl.train.warmup", "write the tiny model after the supervised warm-up as an HF checkpoint"),
    "export": ("jetrl.train.export", "write a run's trained policy as an HF checkpoint (and vLLM block FP8)"),
    "export-verl": ("jetrl.verl.export", "write a verl checkpoint's actor as HF (and the vLLM block FP8 it ran)"),
}


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("jetrl")
    except PackageNotFoundError:  # a source tree on sys.path without an install
        return "unknown (not installed)"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-V", "--version"):
        print(f"jetrl {version()}")
        return 0
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: jetrl [--version] {" + ",".join(SUBCOMMANDS) + "} ...\n")
        for name, (_, help_) in SUBCOMMANDS.items():
            print(f"  {name:<13}{help_}")
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd not in SUBCOMMANDS:
        print(f"jetrl: unknown command {cmd!r}; choose one of {sorted(SUBCOMMANDS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[cmd][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
