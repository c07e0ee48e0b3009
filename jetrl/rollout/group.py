"""Several vLLM engines of one policy on one device, driven as one `Engine`.

At batch 256 the GPU is busy for less than half of a decode step of an 8B-class model on one Hopper GPU
(`scripts/results/rollout-llama3.1-8b-l8-mp-nvidia-h200.json`); the worker waits on vLLM's engine core, whose
scheduler spends Python time per request per step (`jetrl.rollout.engine_timing` records it). With each engine core
in a process of its own (``in_process=False``), N engines on the device split every batch N ways and schedule side
by side: N schedulers of 256/N requests each instead of one of 256. `EngineGroup` has the surface the trainer,
`jetrl.rollout.sync` and `jetrl.lint` use of an `Engine` (not sleep mode): a generate splits the prompts into N
contiguous shares decoded at once (one thread each, waiting on its engine core's process), prompt i keeping the
seed ``seed + i`` it has on one engine; `apply` runs on every worker of every engine (so a weight sync installs and
verifies the same bytes in each); the rest goes to each engine, or reads the first where all are configured alike.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from jetrl.rollout.adapter import Engine, Sample, collector_paused

__all__ = ["EngineGroup", "start_engines"]


class EngineGroup:
    """`engines` (started alike with `jetrl.rollout.adapter.create_engine`) behind one `Engine`'s surface."""

    def __init__(self, engines: Sequence[Engine]) -> None:
        if len(engines) < 2:
            raise ValueError(f"EngineGroup: {len(engines)} engine(s); a group is two or more (use the Engine itself)")
        first = engines[0]
        for k, e in enumerate(engines[1:], 1):
            theirs = (e.recipe.name, e.rollout, e.in_process, e.quantization)
            mine = (first.recipe.name, first.rollout, first.in_process, first.quantization)
            if theirs != mine:
                raise ValueError(
                    f"EngineGroup: engine {k} runs (recipe, rollout, in_process, quantization) {theirs}, engine 0 "
                    f"{mine}; a group's engines sample one policy alike"
                )
        if first.in_process:
            raise ValueError(
                "EngineGroup: in-process engines share this process's interpreter lock (and vLLM's process-wide "
                "parallel state); start each with in_process=False"
            )
        self.engines = list(engines)
        self.recipe = first.recipe
        self.rollout = first.rollout
        self.in_process = False

    @property
    def start_seconds(self) -> float:
        """Wall seconds the engines took to start, one after another."""
        return sum(e.start_seconds for e in self.engines)

    @property
    def kv_cache_tokens(self) -> int | None:
        """Tokens all the engines' KV caches hold together (a share of the batch lives in each)."""
        kv = [e.kv_cache_tokens for e in self.engines]
        return None if None in kv else sum(kv)

    @property
    def quantization(self) -> str | None:
        return self.engines[0].quantization

    def shares(self, count: int) -> list[tuple[int, int]]:
        """The contiguous ``[lo, hi)`` prompt ranges of `count` prompts, one per engine (sizes differ by at most 1)."""
        n = len(self.engines)
        bounds = [count * k // n for k in range(n + 1)]
        return list(zip(bounds, bounds[1:], strict=False))

    def generate(
        self,
        prompt_token_ids: list[list[int]],
        *,
        max_tokens: int | Sequence[int],
        seed: int | None = None,
        **kw: Any,
    ) -> list[Sample]:
        """`Engine.generate` over the group: engine k decodes the k-th share of the prompts, all at once; the samples
        come back prompt-major as from one engine. Python's collector stays paused until every share is done (each
        engine's own pause would re-enable it as the first share ends)."""
        if not isinstance(max_tokens, int) and len(max_tokens) != len(prompt_token_ids):
            raise ValueError(f"EngineGroup.generate: {len(max_tokens)} max_tokens for {len(prompt_token_ids)} prompts")
        jobs = []
        for e, (lo, hi) in zip(self.engines, self.shares(len(prompt_token_ids)), strict=True):
            if lo == hi:
                continue
            budget = max_tokens if isinstance(max_tokens, int) else list(max_tokens[lo:hi])
            share_seed = None if seed is None else seed + lo
            jobs.append((e, prompt_token_ids[lo:hi], budget, share_seed))
        with collector_paused(), ThreadPoolExecutor(max(len(jobs), 1)) as pool:
            futures = [pool.submit(e.generate, p, max_tokens=b, seed=s, **kw) for e, p, b, s in jobs]
            return [s for f in futures for s in f.result()]

    def apply(self, fn: Callable[[Any], Any]) -> list[Any]:
        """``fn(model)`` on every worker of every engine: engine 0's workers' results first."""
        return [r for e in self.engines for r in e.apply(fn)]

    def check_nonfinite(self) -> None:
        from jetrl.quant import NonFiniteError

        bad = []
        for k, e in enumerate(self.engines):
            try:
                e.check_nonfinite()
            except NonFiniteError as err:
                bad.append(f"engine {k}: {err}")
        if bad:
            raise NonFiniteError("; ".join(bad))

    def cpu_attention_isas(self) -> set[str]:
        return set().union(*(e.cpu_attention_isas() for e in self.engines))

    def param_info(self):
        return self.engines[0].param_info()

    def packed_modules_mapping(self) -> dict[str, list[str]]:
        return self.engines[0].packed_modules_mapping()

    def finalize_weight_update(self) -> int:
        return sum(e.finalize_weight_update() for e in self.engines)

    def reset_prefix_cache(self) -> None:
        for e in self.engines:
            e.reset_prefix_cache()

    def close(self) -> None:
        for e in reversed(self.engines):
            e.close()


def start_engines(start: Callable[[], Engine], count: int) -> Engine | EngineGroup:
    """``start()`` (e.g. a `functools.partial` of `create_engine`) `count` times, one engine after another: the
    engine itself for one, an `EngineGroup` of them for more. When one fails to start, those already started are
    closed before the error propagates."""
    if count < 1:
        raise ValueError(f"start_engines: count {count}; at least one engine")
    engines: list[Engine] = []
    try:
        for _ in range(count):
            engines.append(start())
    except BaseException:
        for e in reversed(engines):
            e.close()
        raise
    return engines[0] if count == 1 else EngineGroup(engines)
