"""Dataset preparation: source rows (HF hub or files on disk) -> verl's ``{train,test}.parquet``.

Sources. Online, `read_hub` reads a split with the ``datasets`` library (``load_dataset(path, name,
split=...)``). Offline, `read_local` reads the files the user already downloaded under ``--local-dir``
(an HF snapshot such as ``main/train-00000-of-00001.parquet`` or ``data/test-*.parquet``, a
``train.jsonl``, or the original Hendrycks tree ``train/<subject>/<n>.json``): a file belongs to
split ``s`` when its name starts with ``s`` followed by ``-``/``_``/``.``, or one of its folders is
named ``s``. Parquet is read with pyarrow, JSON / JSONL with the standard library.

Rows. Each source row goes through its dataset's ``make_row(raw, index, split, where=...)``; a
malformed row raises `jetrl.tasks.rows.DataError` naming the file (or dataset split) and row number.
`build_split` collects every malformed row of a split and raises one error listing the count and the
first of them, unless ``skip_malformed``: then they are left out and their locations returned, and the
drivers print the count -- never a silent drop.

Held-out split. A dataset with no test split of its own (DeepMath-103K has only ``train``) gets a
test split of ``test_size`` rows drawn by a seeded permutation of the source rows; the rest is
``train``. ``extra_info.index`` is the row's position in its output split; ``extra_info.source``
where it came from (file or dataset, split and row number).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jetrl.tasks import gsm8k
from jetrl.tasks import math as math_task
from jetrl.tasks.rows import DataError

__all__ = [
    "DatasetSpec",
    "DATASETS",
    "split_files",
    "read_local",
    "read_hub",
    "build_split",
    "write_parquet",
    "read_parquet",
    "prepare",
    "default_out_dir",
    "main",
]

Record = tuple[str, dict[str, Any]]
"""(location of the row for error messages, the source row)."""


@dataclass(frozen=True)
class DatasetSpec:
    name: str
    """Output folder name under ``$DATA_DIR`` (``gsm8k``, ``math``, ``deepmath``)."""
    hf_path: str
    """HF dataset id read online."""
    hf_name: str | None
    """HF dataset config (``main`` for GSM8K), or None."""
    source_splits: tuple[str, ...]
    """Splits the source has: ``("train", "test")``, or ``("train",)`` (then test is held out)."""
    make_row: Callable[..., dict[str, Any]]
    """``make_row(raw, index, split, where=...) -> verl row``."""


DATASETS: dict[str, DatasetSpec] = {
    "gsm8k": DatasetSpec("gsm8k", "openai/gsm8k", "main", ("train", "test"), gsm8k.make_row),
    "math": DatasetSpec("math", "DigitalLearningGmbH/MATH-lighteval", None, ("train", "test"), math_task.make_math_row),
    "deepmath": DatasetSpec("deepmath", "zwhe99/DeepMath-103K", None, ("train",), math_task.make_deepmath_row),
}
"""The datasets ``scripts/data/*.py`` prepare (MATH: the lighteval release of Hendrycks MATH, 7500 + 5000)."""

_SUFFIXES = (".parquet", ".jsonl", ".json")


def split_files(local_dir: str | Path, split: str) -> list[Path]:
    """Data files of `split` under `local_dir` (see the module docstring), sorted; raises
    `DataError` naming the folder and the files seen when there is none."""
    root = Path(local_dir)
    if not root.is_dir():
        raise DataError(f"--local-dir {root}: not a directory")
    found = []
    for p in sorted(root.rglob("*")):
        if not p.is_file() or p.suffix not in _SUFFIXES:
            continue
        rel = p.relative_to(root)
        in_folder = split in rel.parts[:-1]
        by_name = any(p.name.startswith(split + sep) for sep in "-_.")
        if in_folder or by_name:
            found.append(p)
    if not found:
        seen = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.suffix in _SUFFIXES)[:10]
        raise DataError(
            f"--local-dir {root}: no {'/'.join(_SUFFIXES)} file for split {split!r} (expected e.g. "
            f"{split}-00000-of-00001.parquet, {split}.jsonl or {split}/<subject>/<n>.json); data files seen: {seen}"
        )
    return found


def _rows_of(path: Path) -> Iterator[dict[str, Any]]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        yield from pq.read_table(path).to_pylist()
    elif path.suffix == ".jsonl":
        with path.open() as f:
            for n, line in enumerate(f):
                if line.strip():
                    try:
                        yield json.loads(line)
                    except json.JSONDecodeError as e:
                        raise DataError(f"{path} line {n + 1}: not JSON ({e})") from None
    else:
        data = json.loads(path.read_text())
        yield from data if isinstance(data, list) else [data]


def read_local(local_dir: str | Path, split: str) -> list[Record]:
    """Every row of `split` from the files under `local_dir`, each with its location."""
    out: list[Record] = []
    root = Path(local_dir)
    for path in split_files(root, split):
        rel = path.relative_to(root)
        for n, raw in enumerate(_rows_of(path)):
            if not isinstance(raw, dict):
                raise DataError(f"{rel} row {n}: expected an object, got {type(raw).__name__}")
            out.append((f"{rel} row {n}", raw))
    return out


def read_hub(spec: DatasetSpec, split: str) -> list[Record]:
    """Every row of `split` of `spec` read with ``datasets.load_dataset`` (needs the network or HF's cache)."""
    import datasets

    try:
        ds = datasets.load_dataset(spec.hf_path, spec.hf_name, split=split)
    except (ConnectionError, OSError) as e:  # no network and no HF cache: say what to do instead
        raise DataError(
            f"{spec.hf_path}: cannot read split {split!r} from the HF hub ({type(e).__name__}: {e}); without "
            "network access, download the dataset files and pass --local-dir"
        ) from e
    return [(f"{spec.hf_path} {split} row {n}", dict(raw)) for n, raw in enumerate(ds)]


def build_split(
    spec: DatasetSpec, records: list[Record], split: str, *, skip_malformed: bool = False
) -> tuple[list[dict[str, Any]], list[str]]:
    """verl rows of `records` (output split `split`) and the errors of the rows left out (only with
    `skip_malformed`; otherwise any malformed row raises `DataError` with the count and the first ones)."""
    rows: list[dict[str, Any]] = []
    bad: list[str] = []
    for where, raw in records:
        try:
            row = spec.make_row(raw, len(rows), split, where=where)
        except DataError as e:
            bad.append(str(e))
            continue
        row["extra_info"]["source"] = where
        rows.append(row)
    if bad and not skip_malformed:
        shown = "\n  ".join(bad[:5])
        more = f"\n  ... and {len(bad) - 5} more" if len(bad) > 5 else ""
        raise DataError(
            f"{spec.name} {split}: {len(bad)} malformed row(s) of {len(records)} (pass --skip-malformed to leave "
            f"them out, counted):\n  {shown}{more}"
        )
    return rows, bad


def write_parquet(rows: list[dict[str, Any]], path: str | Path) -> Path:
    """Write verl rows to `path` (parent folders created). Refuses an empty split."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    if not rows:
        raise DataError(f"{path}: no rows to write")
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def read_parquet(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a verl parquet file, each checked against the schema (`DataError` names the row)."""
    import pyarrow.parquet as pq

    from jetrl.tasks.rows import check_row

    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such parquet file")
    rows = pq.read_table(path).to_pylist()
    for n, row in enumerate(rows):
        check_row(row, where=f"{path} row {n}")
    return rows


def prepare(
    spec: DatasetSpec,
    out_dir: str | Path,
    *,
    local_dir: str | Path | None = None,
    skip_malformed: bool = False,
    test_size: int = 500,
    seed: int = 0,
    max_rows: int | None = None,
    reader: Callable[[DatasetSpec, str], list[Record]] | None = None,
) -> dict[str, Any]:
    """Write ``out_dir/{train,test}.parquet`` for `spec`; returns a summary (rows and skipped rows per
    split). `max_rows` keeps the first rows of each source split (a quick trial; the summary says so)."""
    if reader is None:
        reader = (lambda s, split: read_local(local_dir, split)) if local_dir is not None else read_hub
    sources = {split: reader(spec, split) for split in spec.source_splits}
    if max_rows is not None:
        sources = {k: v[:max_rows] for k, v in sources.items()}
    if "test" not in sources:
        train = sources.pop("train")
        if not 0 < test_size < len(train):
            raise DataError(f"{spec.name}: --test-size {test_size} must be in (0, {len(train)}) (the train rows)")
        order = list(range(len(train)))
        random.Random(seed).shuffle(order)
        held = set(order[:test_size])
        sources = {
            "train": [r for i, r in enumerate(train) if i not in held],
            "test": [r for i, r in enumerate(train) if i in held],
        }
    summary: dict[str, Any] = {"dataset": spec.name, "out_dir": str(out_dir), "max_rows": max_rows, "splits": {}}
    for split, records in sources.items():
        rows, bad = build_split(spec, records, split, skip_malformed=skip_malformed)
        path = write_parquet(rows, Path(out_dir) / f"{split}.parquet")
        summary["splits"][split] = {"rows": len(rows), "skipped": len(bad), "skipped_rows": bad, "path": str(path)}
    return summary


def default_out_dir(name: str) -> Path:
    """``$DATA_DIR/<name>`` (``DATA_DIR`` defaults to ``~/data/jetrl``, as in the recipes)."""
    return Path(os.environ.get("DATA_DIR") or Path.home() / "data" / "jetrl") / name


def main(name: str, argv: list[str] | None = None) -> int:
    """The ``scripts/data/<name>.py`` command line: prepare one dataset of `DATASETS`."""
    spec = DATASETS[name]
    p = argparse.ArgumentParser(
        prog=f"scripts/data/{name}.py",
        description=f"Write verl parquet ({{train,test}}.parquet) for {spec.hf_path}.",
    )
    p.add_argument("--local-dir", help="read files already downloaded here instead of the HF hub")
    p.add_argument("--out-dir", help=f"output folder (default $DATA_DIR/{name}, DATA_DIR defaulting to ~/data/jetrl)")
    p.add_argument(
        "--skip-malformed", action="store_true", help="leave malformed rows out (counted) instead of failing"
    )
    if "test" not in spec.source_splits:
        p.add_argument("--test-size", type=int, default=500, help="rows held out as the test split (default 500)")
        p.add_argument("--seed", type=int, default=0, help="seed of the held-out draw (default 0)")
    p.add_argument("--max-rows", type=int, help="keep only the first N rows of each source split (a quick trial)")
    args = p.parse_args(argv)
    out_dir = Path(args.out_dir) if args.out_dir else default_out_dir(name)
    try:
        summary = prepare(
            spec,
            out_dir,
            local_dir=args.local_dir,
            skip_malformed=args.skip_malformed,
            test_size=getattr(args, "test_size", 500),
            seed=getattr(args, "seed", 0),
            max_rows=args.max_rows,
        )
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for split, s in summary["splits"].items():
        print(
            f"{name} {split}: {s['rows']} rows -> {s['path']}"
            + (f" ({s['skipped']} malformed rows left out)" if s["skipped"] else "")
        )
        for msg in s["skipped_rows"]:
            print(f"  skipped: {msg}", file=sys.stderr)
    return 0
