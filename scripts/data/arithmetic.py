"""Write $DATA_DIR/arithmetic/{train,test}.parquet: the tiny arithmetic task (`jetrl.tasks.arithmetic`) as
verl RL rows (``data_source = jetrl/arithmetic``), for a verl run on the task of the embedded default.

``train`` holds the task's RL stream, ``test`` its evaluation stream; same seed, same rows.
"""

import os
import sys

# This folder holds math.py: as the script's folder it comes first on sys.path and would shadow the stdlib
# `math` for every import below (`python -P` avoids that too); drop it before importing anything else.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import argparse  # noqa: E402
from pathlib import Path  # noqa: E402

from jetrl.tasks.arithmetic import ArithmeticTask, verl_rows  # noqa: E402
from jetrl.tasks.parquet import default_out_dir, write_parquet  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/data/arithmetic.py", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--out-dir", help="output folder (default $DATA_DIR/arithmetic, DATA_DIR defaulting to ~/data/jetrl)"
    )
    p.add_argument("--train-rows", type=int, default=8192)
    p.add_argument("--test-rows", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-operand", type=int, default=0)
    p.add_argument("--max-operand", type=int, default=99)
    p.add_argument("--ops", default="+", help="operators drawn, e.g. '+-*' (default '+')")
    args = p.parse_args(argv)
    try:
        task = ArithmeticTask(args.seed, args.min_operand, args.max_operand, tuple(args.ops))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    out_dir = Path(args.out_dir) if args.out_dir else default_out_dir("arithmetic")
    for split, n in (("train", args.train_rows), ("test", args.test_rows)):
        path = write_parquet(verl_rows(task, split, n), out_dir / f"{split}.parquet")
        print(f"arithmetic {split}: {n} rows -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
