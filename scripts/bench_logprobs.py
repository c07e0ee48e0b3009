"""Host cost of the rollout's per-token log-probs: vLLM's output processor and jetrl's read-out, per container.

Every jetrl rollout asks vLLM for the sampled token's log-prob (``logprobs=0``), and vLLM's output processor
appends it to each request's container on the host at every decode step (`LogprobsProcessor`, 256 calls a
step at batch 256: the H200 host profile of `bench_rollout.py --host-profile` lists it among the top
functions of a decode that vLLM's host loop paces). With the default container each token becomes a dict
and a ``Logprob`` object; ``flat_logprobs=True`` (what `jetrl.rollout.adapter.Engine.generate` asks for)
appends to a few flat lists per request. This script drives vLLM's own `LogprobsProcessor` with the
sampler's per-step rows for `--batch` requests over `--tokens` steps, once per container, and times the
read-out of every completion's log-probs after the generate (`jetrl.rollout.adapter._sampled_logprobs` for
the flat lists; per-token dict lookups, jetrl's read-out before, for the dicts). Pure host work: the CPU it
runs on is what is measured.

    python scripts/bench_logprobs.py [--batch 256] [--tokens 512] [--repeats 3] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import benchmeta
import numpy as np

CONTAINERS = ("dict", "flat")


def _run(container: str, batch: int, tokens: int, seed: int) -> dict:
    from vllm import SamplingParams
    from vllm.v1.engine.logprobs import LogprobsProcessor
    from vllm.v1.outputs import LogprobsLists

    from jetrl.rollout.adapter import _sampled_logprobs

    params = SamplingParams(logprobs=0, flat_logprobs=container == "flat", detokenize=False)
    procs = [LogprobsProcessor.from_new_request(None, SimpleNamespace(sampling_params=params)) for _ in range(batch)]
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 128_000, (tokens, batch, 1))
    lps = -rng.exponential(size=(tokens, batch, 1)).astype(np.float32)
    ranks = rng.integers(1, 100, (tokens, batch))
    t0 = time.perf_counter()
    for t in range(tokens):  # one decode step: each request's row of the sampler's output, as vLLM hands it over
        for b in range(batch):
            procs[b]._update_sample_logprobs(
                LogprobsLists(ids[t, b : b + 1], lps[t, b : b + 1], ranks[t, b : b + 1], None)
            )
    t1 = time.perf_counter()
    completions = [ids[:, b, 0].tolist() for b in range(batch)]
    if container == "flat":
        out = [_sampled_logprobs(p.logprobs, c) for p, c in zip(procs, completions, strict=True)]
    else:
        out = [
            [float(p.logprobs[i][tok].logprob) for i, tok in enumerate(c)]
            for p, c in zip(procs, completions, strict=True)
        ]
    t2 = time.perf_counter()
    want = lps[:, :, 0].T.tolist()
    if out != want:
        raise AssertionError(f"{container}: the read-out log-probs are not the sampler's")
    return {"step_ms": (t1 - t0) / tokens * 1e3, "readout_ms": (t2 - t1) * 1e3}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=256, help="requests decoding together")
    p.add_argument("--tokens", type=int, default=512, help="decode steps (tokens per completion)")
    p.add_argument("--repeats", type=int, default=3, help="runs per container (median reported)")
    p.add_argument("--commit", help="the checkout's commit, recorded")
    p.add_argument("--out", default=None, help="JSON path (default scripts/results/logprobs-<device>.json)")
    args = p.parse_args(argv)
    for name in ("batch", "tokens", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name} {getattr(args, name)} must be >= 1")
    result = {
        "benchmark": "logprobs",
        **benchmeta.meta(args.commit),
        "host": f"{platform.processor() or platform.machine()} x{os.cpu_count()} (what is timed: host work only)",
        "batch": args.batch,
        "tokens": args.tokens,
        "repeats": args.repeats,
        "containers": {},
    }
    for container in CONTAINERS:
        runs = [_run(container, args.batch, args.tokens, seed=r) for r in range(args.repeats)]
        result["containers"][container] = {
            key: statistics.median(r[key] for r in runs) for key in ("step_ms", "readout_ms")
        } | {"runs": runs}
    d, f = result["containers"]["dict"], result["containers"]["flat"]
    result["flat_saves"] = {
        "step_ms": d["step_ms"] - f["step_ms"],
        "readout_ms": d["readout_ms"] - f["readout_ms"],
        "per_generate_ms": (d["step_ms"] - f["step_ms"]) * args.tokens + d["readout_ms"] - f["readout_ms"],
    }
    print(f"per-token log-probs on the host, batch {args.batch} x {args.tokens} tokens ({result['host']})")
    print(f"{'container':10s} {'ms/step':>9s} {'read-out ms':>12s}")
    for container in CONTAINERS:
        r = result["containers"][container]
        print(f"{container:10s} {r['step_ms']:9.3f} {r['readout_ms']:12.1f}")
    print(f"flat saves {result['flat_saves']['per_generate_ms']:.0f} ms of host time per generate")
    tag = benchmeta.device_tag(benchmeta.device_name())
    out = Path(args.out or Path(__file__).parent / "results" / f"logprobs-{tag}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
