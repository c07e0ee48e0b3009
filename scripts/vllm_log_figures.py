"""The start-up and JIT figures of a vLLM engine's log (a ``bench_rollout.py`` / ``bench_e2e.py`` run's stdout and
stderr), kept as JSON: what the benchmark's own JSON does not hold, and all that is left of a call cut short by
its time limit before the benchmark wrote its JSON.

    python scripts/vllm_log_figures.py RUN.log [RUN2.log ...] --device "NVIDIA H200" --commit SHA \\
        --date 2026-12-05 --note "what the run was" --out scripts/results/<name>.json

Per log: jetrl's ``engine start`` seconds per mode, vLLM's model-loading seconds (jetrl's DeepGEMM warm-up runs
inside it), its CUDA-graph capture (each kind's final progress bar and the total), ``init engine`` seconds,
the kernels vLLM's JIT monitor saw compile during inference (with the log's time), the timed decode runs
``bench_rollout.py`` printed, and every matched line verbatim with its time, so a figure derived from two
lines' times can be checked. Progress bars redraw with carriage returns; each redraw counts as a line.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import benchmeta

# vLLM's log prefix: "INFO 12-05 17:37:54 [file.py:12] ..." (a worker's lines start with "(Worker pid=N) ")
_TIME = re.compile(r"\b(?:DEBUG|INFO|WARNING|ERROR) \d\d-\d\d (\d\d:\d\d:\d\d) \[")
_PATTERNS = {
    "engine_start": re.compile(r"\[(?P<mode>\w+)\] engine start (?P<s>[\d.]+) s"),
    "model_loading": re.compile(r"Model loading took (?P<gib>[\d.]+) GiB (?:and|in) (?P<s>[\d.]+) seconds"),
    "graph_capture": re.compile(r"Graph capturing finished in (?P<s>\d+) secs"),
    "init_engine": re.compile(r"init engine \(.*\) took (?P<s>[\d.]+) s(?: \(compilation: (?P<c>[\d.]+) s\))?"),
    "capture_bar": re.compile(r"Capturing CUDA graphs \((?P<kind>\w+)\): +100%.*?(?P<n>\d+)/(?P=n) \[(?P<t>[\d:]+)<"),
    "jit_during_inference": re.compile(r"JIT compilation during inference: (?P<kernel>\w+)"),
    "decode_run": re.compile(
        r"\[(?P<mode>\w+)\] batch (?P<b>\d+) x \((?P<i>\d+) \+ (?P<o>\d+)\): run (?P<r>\d+)/\d+ (?P<tok>[\d.]+) tok/s"
    ),
    "profiler_start": re.compile(r"Torch profiling enabled"),
}

__all__ = ["figures", "main"]


def _seconds(clock: str) -> int:
    """``"01:08"`` or ``"1:01:08"`` (a progress bar's elapsed time) -> seconds."""
    out = 0
    for part in clock.split(":"):
        out = out * 60 + int(part)
    return out


def figures(text: str) -> dict:
    """The figures of one log's `text` (see the module docstring)."""
    out: dict = {
        "engine_start_s": {},
        "model_loading_s": [],
        "graph_capture_s": [],
        "capture_bars": [],
        "init_engine": [],
        "jit_during_inference": [],
        "decode_runs": [],
        "lines": [],
    }
    for line in re.split(r"[\r\n]+", text):
        for key, pat in _PATTERNS.items():
            m = pat.search(line)
            if m is None:
                continue
            bar = (m.group("kind"), m.group("t")) if key == "capture_bar" else None
            if bar and out["capture_bars"] and bar == tuple(out["capture_bars"][-1][k] for k in ("kind", "elapsed")):
                continue  # a 100% bar is drawn twice (the last step, then the close): keep it once
            t = _TIME.search(line)
            out["lines"].append({"time": t.group(1) if t else None, "text": line.strip()[:400]})
            if key == "engine_start":
                out["engine_start_s"].setdefault(m.group("mode"), []).append(float(m.group("s")))
            elif key == "model_loading":
                out["model_loading_s"].append(float(m.group("s")))
            elif key == "graph_capture":
                out["graph_capture_s"].append(int(m.group("s")))
            elif key == "capture_bar":
                n, elapsed = int(m.group("n")), m.group("t")
                out["capture_bars"].append(
                    {"kind": m.group("kind"), "sizes": n, "elapsed": elapsed, "elapsed_s": _seconds(elapsed)}
                )
            elif key == "init_engine":
                c = m.group("c")
                out["init_engine"].append({"s": float(m.group("s")), "compilation_s": float(c) if c else None})
            elif key == "jit_during_inference":
                out["jit_during_inference"].append({"kernel": m.group("kernel"), "time": t.group(1) if t else None})
            elif key == "decode_run":
                out["decode_runs"].append(
                    {
                        "mode": m.group("mode"),
                        "batch": int(m.group("b")),
                        "input_len": int(m.group("i")),
                        "output_len": int(m.group("o")),
                        "run": int(m.group("r")),
                        "tok_s": float(m.group("tok")),
                    }
                )
            break
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("logs", nargs="+", type=Path)
    p.add_argument("--device", required=True, help="the GPU the logs came from (the device machine's name for it)")
    p.add_argument("--commit", required=True, help="the commit the logged run was made from")
    p.add_argument("--date", required=True, help="the day the logged run was made (the log's times omit the year)")
    p.add_argument("--note", required=True, help="what the runs were (their command, what cut them short)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    missing = [str(log) for log in args.logs if not log.is_file()]
    if missing:
        p.error(f"no such log: {', '.join(missing)}")
    result = {
        "benchmark": "vllm_log_figures",
        "device": args.device,
        "date": args.date,
        "commit": args.commit,
        "command": benchmeta.command(),
        "note": args.note,
        "logs": {log.name: figures(log.read_text(errors="replace")) for log in args.logs},
    }
    empty = [name for name, f in result["logs"].items() if not f["lines"]]
    if empty:
        p.error(f"no vLLM start-up or decode line in {', '.join(empty)} (not a vLLM engine's log?)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for name, f in result["logs"].items():
        bars = ", ".join(f"{b['kind']} {b['sizes']} sizes {b['elapsed']}" for b in f["capture_bars"])
        print(
            f"{name}: engine start {f['engine_start_s']}, model loading {f['model_loading_s']} s, "
            f"capture [{bars}], JIT during inference {[j['kernel'] for j in f['jit_during_inference']]}, "
            f"{len(f['decode_runs'])} decode runs"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
