"""The single-process on-policy RL loop: vLLM rollout, FP8 (or BF16) training, byte-verified sync.

One step (``t = 1 .. run.steps``)::

    rollout   prompts of step t (same for every recipe with one seed) -> engine.generate (G samples each)
              -> rewards (+ DAPO overlong penalty); DAPO dynamic sampling draws more prompts while groups
              with equal rewards leave the batch short
    train     one no-grad trainer forward over the batch with the weights the engine sampled from:
              old log-probs, entropy, and the trainer/rollout mismatch (|dlogp|, IS ratio);
              group advantages; `algo.epochs` x `algo.mini_batches` optimizer steps of the clipped
              surrogate (micro-batched, fp32 gradient accumulation). Both passes run micro-batches of
              `algo.micro_batch_size` sequences or, with `algo.micro_batch_tokens`, length-sorted
              micro-batches packed to a token budget; each is trimmed to its longest sequence
    sync      `jetrl.rollout.sync.sync_weights`: the trainer's weights (fp8 bytes + scales under
              jetrl-unified) copied into the engine and verified by digest
    log       one metrics.jsonl line; checkpoint every `run.checkpoint_every` steps

The engine and the trainer are in one process (vLLM in-process mode), so the sync is a memory copy.
Start-up: config and environment checks (`jetrl.train.checks`), the cached supervised warm-up (tiny
model), `convert_model` with the recipe, the engine, the precision lint (`jetrl.lint`, once; a
violation refuses to train unless ``lint.allow_violations``), a first sync and a greedy evaluation.

Resume (`Trainer(cfg, resume=True)`) reloads the newest checkpoint that verifies (masters, AdamW
state, step; `jetrl.train.checkpoint`: safetensors + JSON with checksums, never a pickle), says which
newer ones it skipped, re-syncs the engine, truncates metrics.jsonl to the checkpoint's step and
continues the same stream. Prompts and sampling seeds depend only on ``(run.seed, step)``, so the
resumed run draws what the killed run would have drawn.

Nothing is written before the config, the machine, the model's files and the requested loggers are
checked: a run that cannot start leaves no run directory behind (and an existing one untouched).
`current_step` / `last_checkpoint` say where an interrupted run stopped (the CLI's Ctrl-C line).
"""

from __future__ import annotations

import functools
import json
import math
import os
import platform
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from jetrl.linear import refresh_fp8_weights_

from . import algo
from .checkpoint import CheckpointError, load_latest, save_checkpoint
from .checks import check_environment
from .config import TrainConfig
from .loggers import check_loggers, open_loggers
from .metrics import MetricsWriter, read_metrics
from .modelfiles import check_model_dir
from .policy import MixedPrecisionAdamW, TokenBatch, forward_logprobs, make_batch, micro_batches, use_causal_sdpa
from .progress import ProgressBar
from .task import ArithmeticTask, Problem, Stream
from .warmup import prepare_initial_checkpoint

__all__ = ["Trainer", "TrainError", "RESUMABLE_FIELDS"]

RESUMABLE_FIELDS = {
    ("run", "steps"),
    ("run", "progress"),
    ("run", "checkpoint_every"),
    ("run", "keep_checkpoints"),
    ("run", "threads"),
    ("run", "eval_every"),
    ("run", "loggers"),
}
"""Config fields a resumed run may change; any other difference from the saved config is refused."""


class TrainError(RuntimeError):
    """The run cannot start or continue (lint violation, existing run directory, config drift)."""


class _Tokens:
    """The few tokenizer operations the loop needs, for the tiny char tokenizer or an HF tokenizer."""

    def __init__(self, model_path: Path, tiny: bool):
        if tiny:
            from jetrl.tiny import CharTokenizer

            self.tok = CharTokenizer()
            self.pad_id, self.eos_id = self.tok.pad_id, self.tok.eos_id
            self._encode = lambda s: self.tok.encode(s, add_bos=True)
            self._decode = lambda ids: self.tok.decode(ids, skip_special=True)
        else:
            from transformers import AutoTokenizer

            self.tok = AutoTokenizer.from_pretrained(model_path)
            self.eos_id = self.tok.eos_token_id
            self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos_id
            self._encode = lambda s: list(self.tok(s).input_ids)
            self._decode = lambda ids: self.tok.decode(ids, skip_special_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._encode(text)

    def encode_problem(self, p: Problem) -> list[int]:
        """The prompt's ids: chat messages through the tokenizer's chat template (as verl renders them), else
        the text."""
        if p.messages is None:
            return self._encode(p.prompt)
        messages = [{"role": role, "content": content} for role, content in p.messages]
        text = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(self.tok(text, add_special_tokens=False).input_ids)

    def decode(self, ids: list[int]) -> str:
        return self._decode(ids)


@dataclass
class _Rollout:
    problems: list[Problem]
    samples: list[Any]
    rewards: torch.Tensor
    correct: torch.Tensor


def _seed_of(seed: int, step: int, round_: int) -> int:
    return (seed * 1_000_003 + step * 1_009 + round_ * 7_919) % (2**31 - 1)


class Trainer:
    """Owns the model, optimizer, engine and outputs of one run. `run()` trains and returns the summary."""

    def __init__(
        self, cfg: TrainConfig, *, resume: bool = False, overwrite: bool = False, log=print, verbose: bool = True
    ):
        """`verbose=False` (the CLIs without --verbose) also hides the engine's weight-loading progress bar."""
        self.cfg, self.resume, self.log, self.verbose = cfg, resume, log, verbose
        self.run_dir = cfg.run_dir
        if cfg.model.path is not None:
            check_model_dir(cfg.model.path)  # ModelFileError naming the file; before its config.json is read
        self.recipe = check_environment(cfg)  # before any work: raises ConfigError naming the field
        if cfg.model.numerics == "strict":  # before the first GEMM (cuBLAS reads its limits then)
            from jetrl.rollout.adapter import enable_batch_invariance

            enable_batch_invariance()
        check_loggers(cfg)
        self.current_step = 0
        """The step being run (0 during start-up); `last_checkpoint` the newest checkpoint's step."""
        self.last_checkpoint: int | None = None
        self._prepare_run_dir(overwrite)
        if cfg.task.name == "parquet":
            from jetrl.tasks.dataset import ParquetTask

            self.task = ParquetTask(cfg.task.train_file, cfg.task.val_file, seed=cfg.run.seed)
        else:
            self.task = ArithmeticTask(cfg.run.seed, cfg.task.min_operand, cfg.task.max_operand, cfg.task.ops)
        self.device = torch.device(cfg.run.device)
        self.engine = None
        self.graphed = None
        """`jetrl.train.graphs.GraphedLogprobs` with ``algo.cuda_graphs`` (after set-up), else None."""
        self.graph_capture_s: float | None = None
        """Seconds `setup` spent capturing the training CUDA graphs (None without ``algo.cuda_graphs``)."""
        self.state: dict[str, Any] = {}

    # ------------------------------------------------------------------ set-up
    def _prepare_run_dir(self, overwrite: bool) -> None:
        cfg_path = self.run_dir / "config.json"
        if self.resume:
            if not cfg_path.exists():
                raise TrainError(f"--resume: {self.run_dir} has no config.json (nothing to resume)")
            saved = json.loads(cfg_path.read_text())
            now = self.cfg.to_dict()
            diffs = [
                f"{s}.{k}: saved {saved.get(s, {}).get(k)!r}, now {v!r}"
                for s, sec in now.items()
                for k, v in sec.items()
                if (s, k) not in RESUMABLE_FIELDS and saved.get(s, {}).get(k) != v
            ]
            if diffs:
                raise TrainError("--resume: the config differs from the run's saved config:\n  " + "\n  ".join(diffs))
        elif self.run_dir.exists() and any(self.run_dir.iterdir()):
            if self._failed_start():
                self.log(f"{self.run_dir}: replacing an earlier start that completed no step")
            elif not overwrite:
                raise TrainError(
                    f"run directory {self.run_dir} exists; pass --resume to continue it, --overwrite to replace "
                    "it, or choose another run.name"
                )
            shutil.rmtree(self.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        cfg_path.write_text(json.dumps(self.cfg.to_dict(), indent=2))

    _START_FILES = {"config.json", "conversion.json", "lint.json", "host.json", "metrics.jsonl"}

    def _failed_start(self) -> bool:
        """The run directory holds only what a start that failed before its first step writes."""
        names = {p.name for p in self.run_dir.iterdir()}
        if not names <= self._START_FILES:
            return False
        return not read_metrics(self.run_dir / "metrics.jsonl")

    def setup(self) -> None:
        """Warm-up checkpoint, model + conversion, optimizer (+ resume), engine, lint, first sync."""
        if self.engine is not None:
            return
        cfg = self.cfg
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        t0 = time.perf_counter()
        self.init_path = prepare_initial_checkpoint(cfg, log=self.log)
        self.tokens = _Tokens(self.init_path, tiny=cfg.model.path is None)

        from jetrl.convert import convert_model

        self.model = self._load_policy()
        fuse = cfg.model.fuse_producers
        self.conversion = convert_model(self.model, self.recipe, backend=cfg.run.gemm_backend, fuse=fuse)
        self.ref_model = None
        if cfg.algo.kl_coef > 0:
            # the reference policy: the RL start (the warm-up checkpoint, also on --resume), frozen, in the
            # recipe's precision so that KL(policy || reference) compares like with like
            self.ref_model = self._load_policy().requires_grad_(False)
            convert_model(self.ref_model, self.recipe, backend=cfg.run.gemm_backend, fuse=fuse)
        (self.run_dir / "conversion.json").write_text(json.dumps(self.conversion.to_dict(), indent=2))
        o = cfg.optim
        self.opt = MixedPrecisionAdamW(
            self.model,
            lr=o.lr,
            betas=o.betas,
            weight_decay=o.weight_decay,
            grad_clip=o.grad_clip,
            lr_warmup_steps=o.lr_warmup_steps,
        )
        self.start_step = 0
        if self.resume:
            try:
                found = load_latest(self.run_dir / "checkpoints")
            except CheckpointError as e:
                raise TrainError(f"--resume: {e}") from None
            for path, why in found.skipped:
                self.log(f"resume: skipped {path.name}: {why}")
            state = found.state
            names = self._param_names()
            if state.get("params") != names:
                raise TrainError(
                    f"--resume: {found.path} holds masters of {len(state.get('params') or [])} parameters that are "
                    f"not this model's {len(names)} trainable parameters"
                )
            self.opt.load_state_dict(state["optimizer"])
            self.start_step = found.step
            self.state = state["trainer"]
            self.last_checkpoint = found.step
            self.log(f"resumed from step {self.start_step} ({found.path})")
        self.state.setdefault("wall_s_before", 0.0)
        from jetrl.rollout.adapter import create_engine
        from jetrl.rollout.group import start_engines

        r = cfg.rollout
        in_process = r.executor == "uni"  # 'mp': vLLM's engine core and a worker process of their own
        start = functools.partial(
            create_engine,
            self.init_path,
            self.recipe,
            seed=cfg.run.seed,
            gpu_memory_utilization=r.gpu_memory_utilization,
            max_model_len=r.max_model_len,
            backend=cfg.run.gemm_backend,
            engine_ops=r.engine_ops,
            in_process=in_process,
            strict=cfg.model.numerics == "strict",
            cpu_amx=cfg.model.numerics != "vllm-cpu",  # vLLM's AMX kernels are not what the trainer matches
            **({} if in_process else {"distributed_executor_backend": "mp"}),
            **{**({} if self.verbose else {"use_tqdm_on_load": False}), **r.engine_kwargs},
        )
        self.engine = start_engines(start, r.engines)
        where = "in this process" if in_process else "in its own processes (executor mp)"
        what = f"{r.engines} engines" if r.engines > 1 else "engine"
        self.log(f"{what}: {self.engine.quantization or 'bf16'} started {where} in {self.engine.start_seconds:.1f}s")
        self._check_numerics_path()
        if cfg.lint.enabled:
            self._lint()
        rep = self._sync()
        self.log(f"initial sync: {rep.bytes / 2**20:.2f} MiB, {rep.n_params} tensors, digests equal")
        if cfg.algo.cuda_graphs:  # after vLLM took its share of the GPU
            self._capture_graphs()
        self.setup_s = time.perf_counter() - t0

    def _capture_graphs(self) -> None:
        from .graphs import GraphedLogprobs

        a, t0 = self.cfg.algo, time.perf_counter()
        self.graphed = GraphedLogprobs(
            self.model,
            temperature=self.cfg.rollout.temperature,
            pad_id=self.tokens.pad_id,
            max_rows=a.micro_batch_size,
            max_tokens=a.micro_batch_tokens,
            max_width=self.cfg.rollout.max_model_len,
        )
        self.graphed.capture_all()
        self.opt.zero_grad()  # the captures' warm-up iterations accumulated gradients
        shapes = ", ".join(f"{r}x{w}" for r, w in self.graphed.buckets)
        n, self.graph_capture_s = len(self.graphed.buckets), time.perf_counter() - t0
        self.log(f"cuda graphs: {n} buckets ({shapes}) captured in {self.graph_capture_s:.1f}s")

    def _check_numerics_path(self) -> None:
        """``model.numerics: vllm-cpu``: say which vLLM CPU kernels the trainer matches, and say loudly when
        it does not (an engine path jetrl does not reproduce, or an attention ISA other than predicted)."""
        path = getattr(self, "numerics_path", None)
        if path is None:
            return
        live = self.engine.cpu_attention_isas()
        if live and live != {path.attention_isa}:
            why = f"the engine runs attention {sorted(live)}, the trainer matched {path.attention_isa!r}"
            self.numerics_path = path = replace(path, matched=False, reason=why)
        self.log(f"trainer numerics: {path.describe()}")
        if not path.matched:
            self.log(
                "WARNING: model.numerics='vllm-cpu' cannot reproduce this engine's kernels here; trainer and "
                f"rollout log-probs will differ by more than the FP8 recipe's own rounding ({path.reason})"
            )

    def _lint(self) -> None:
        from jetrl.lint.api import lint
        from jetrl.lint.builders import probe_ids

        t0 = time.perf_counter()
        # the probe must fit the engine's context (the lint's default probe is 40 tokens + BOS)
        probe = probe_ids(self.init_path, length=min(40, self.cfg.rollout.max_model_len - 2))
        training = None
        if self.cfg.lint.numeric:  # the numeric table compares what this run computes: its own numerics
            from jetrl.lint.numeric import capture_training_numerics

            training = capture_training_numerics(
                self.init_path,
                self.recipe,
                numerics=self.cfg.model.numerics,
                probe=probe,
                backend=self.cfg.run.gemm_backend,
            )
        report = lint(
            self.init_path,
            self.recipe,
            rollout="jetrl-vllm",
            numeric=self.cfg.lint.numeric,
            engine=getattr(self.engine, "engines", [self.engine])[0],  # a group's engines run alike: its first
            probe=probe,
            backend=self.cfg.run.gemm_backend,
            training=training,
        )
        path = getattr(self, "numerics_path", None)
        if path is not None and not path.matched:
            from jetrl.lint.report import Finding, Severity

            report.findings.append(
                Finding(
                    Severity.WARNING,
                    "numerics-path",
                    f"model.numerics='vllm-cpu' does not reproduce this engine's kernels: {path.reason}",
                    rollout_module="model.layers.*.self_attn.attn",
                    training_module="model.layers.*.self_attn",
                    tensor="attention",
                    expected="vllm-cpu kernels jetrl reproduces (_C / _C_AVX512 / _C_AVX2, attention vec/vec16)",
                    found=path.describe(),
                    fix="run on an x86 CPU without AMX, or expect trainer/rollout drift from the non-Linear ops",
                )
            )
        (self.run_dir / "lint.json").write_text(report.to_json())
        self.log(f"lint ({time.perf_counter() - t0:.1f}s): {'consistent' if report.ok else 'VIOLATIONS'}")
        if not report.ok:
            if not self.cfg.lint.allow_violations:
                raise TrainError(
                    f"the precision lint found violations for recipe {self.recipe.name!r} (rollout is not the "
                    f"training forward); refusing to train. Set lint.allow_violations=true to train anyway.\n"
                    + report.table()
                )
            self.log(report.table())

    def _sync(self):
        from jetrl.rollout.sync import sync_weights

        return sync_weights(self.model, self.engine, self.recipe)

    def _param_names(self) -> list[str]:
        """Names of the trainable parameters, in the order of the optimizer's masters."""
        return [n for n, p in self.model.named_parameters() if p.requires_grad]

    def _load_policy(self):
        """The model of `init_path` in BF16 on the run's device, in eval mode (no dropout; no HF cache)."""
        from transformers import AutoModelForCausalLM

        cfg = self.cfg
        if cfg.model.path is None:  # the warm-up cache: checked here (model.path was checked at start)
            try:
                check_model_dir(self.init_path, field="the warm-up cache")
            except ValueError as e:
                raise TrainError(f"{e}; delete {self.init_path} to rebuild it") from None
        try:
            attn = cfg.model.attn_implementation
            model = AutoModelForCausalLM.from_pretrained(
                self.init_path, dtype=torch.bfloat16, attn_implementation="sdpa" if attn == "sdpa_causal" else attn
            ).to(self.device)
        except (OSError, ValueError) as e:  # safetensors' SafetensorError is neither: caught below
            raise TrainError(f"{self.init_path}: cannot load the model ({type(e).__name__}: {e})") from None
        except Exception as e:  # noqa: BLE001
            if type(e).__name__ != "SafetensorError":
                raise
            raise TrainError(f"{self.init_path}: a weights file is unreadable ({e})") from None
        if cfg.model.numerics == "hf" and cfg.model.attn_implementation == "sdpa_causal":
            use_causal_sdpa(model)
        if cfg.model.numerics == "vllm-cpu":
            from jetrl.rollout.engine_match import match_vllm_cpu

            self.numerics_path = match_vllm_cpu(model, amx=False)  # the engine starts with cpu_amx=False
        elif cfg.model.numerics == "strict":
            from jetrl.rollout.engine_strict import match_vllm_strict

            match_vllm_strict(model)
        return model.eval()

    # ------------------------------------------------------------------ rollout
    def _generate(self, problems: list[Problem], *, n: int, temperature: float, seed: int):
        prompts = [self.tokens.encode_problem(p) for p in problems]
        r = self.cfg.rollout
        return self.engine.generate(
            prompts,
            n=n,
            temperature=temperature,
            top_p=r.top_p if temperature > 0 else 1.0,
            max_tokens=r.max_tokens,
            seed=seed,
            ignore_eos=r.ignore_eos,
        )

    def _score(self, problems: list[Problem], samples: list, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        correct = []
        for i, s in enumerate(samples):
            ok = s.finish_reason == "stop" and self.task.score_response(
                self.tokens.decode(s.response_ids), problems[i // n]
            )
            correct.append(float(ok))
        correct_t = torch.tensor(correct)
        rewards = correct_t.clone()
        a = self.cfg.algo
        if a.overlong_buffer:
            lengths = torch.tensor([len(s.response_ids) for s in samples])
            rewards += algo.overlong_penalty(
                lengths, max_len=self.cfg.rollout.max_tokens, buffer_len=a.overlong_buffer, factor=a.overlong_penalty
            )
        return rewards, correct_t

    def _rollout(self, step: int) -> tuple[_Rollout, dict[str, float], int]:
        r, a = self.cfg.rollout, self.cfg.algo
        g = r.samples_per_prompt
        kept_p, kept_s, kept_r, kept_c = [], [], [], []
        first: _Rollout | None = None
        rounds = 0
        for round_ in range(a.max_gen_batches if a.dynamic_sampling else 1):
            problems = self.task.problems(Stream.RL, step, r.prompts_per_step, round_=round_)
            samples = self._generate(
                problems, n=g, temperature=r.temperature, seed=_seed_of(self.cfg.run.seed, step, round_)
            )
            rewards, correct = self._score(problems, samples, g)
            rounds += 1
            if first is None:
                first = _Rollout(problems, samples, rewards, correct)
            keep = (
                algo.groups_with_signal(rewards, g)
                if a.dynamic_sampling
                else torch.ones(len(problems), dtype=torch.bool)
            )
            for i in torch.nonzero(keep).flatten().tolist():
                kept_p.append(problems[i])
                kept_s.extend(samples[i * g : (i + 1) * g])
                kept_r.append(rewards[i * g : (i + 1) * g])
                kept_c.append(correct[i * g : (i + 1) * g])
            if len(kept_p) >= r.prompts_per_step:
                break
        kept_p = kept_p[: r.prompts_per_step]
        n = len(kept_p)
        batch = _Rollout(
            kept_p,
            kept_s[: n * g],
            torch.cat(kept_r[:n]) if n else torch.zeros(0),
            torch.cat(kept_c[:n]) if n else torch.zeros(0),
        )
        lengths = torch.tensor([len(s.response_ids) for s in first.samples], dtype=torch.float32)
        metrics = {
            "reward/mean": float(first.rewards.mean()),
            "reward/accuracy": float(first.correct.mean()),
            "reward/pass@k": algo.pass_at_k(first.correct, g, g),
            "reward/k": g,
            "response/length_mean": float(lengths.mean()),
            "response/length_max": float(lengths.max()),
            "response/clip_ratio": sum(s.finish_reason == "length" for s in first.samples) / len(first.samples),
            "batch/groups_kept": n,
            "batch/gen_rounds": rounds,
        }
        return batch, metrics, n

    # ------------------------------------------------------------------ train
    def _micro_batches(self, lengths: list[int], idx: list[int]) -> list[list[int]]:
        a = self.cfg.algo
        return micro_batches(lengths, idx, max_seqs=a.micro_batch_size, max_tokens=a.micro_batch_tokens)

    def _train(self, step: int, ro: _Rollout, n_groups: int) -> dict[str, float]:
        a, g = self.cfg.algo, self.cfg.rollout.samples_per_prompt
        temp = self.cfg.rollout.temperature
        t0 = time.perf_counter()
        batch: TokenBatch = make_batch(
            [s.prompt_ids for s in ro.samples],
            [s.response_ids for s in ro.samples],
            [s.response_logprobs for s in ro.samples],
            self.tokens.pad_id,
        )
        # prompt + response tokens per row (the budget's unit), read on the host before the batch moves
        lengths = batch.attention_mask.sum(dim=1).tolist()
        batch = TokenBatch(*(t.to(self.device) for t in vars(batch).values()))
        # [N, L-1]; a micro-batch trimmed to its longest sequence (w + 1 tokens) fills [mb, :w], the
        # positions beyond stay 0 (padding of those rows)
        old_lp = torch.zeros_like(batch.rollout_logp)
        ent = torch.zeros_like(batch.rollout_logp)
        all_idx = list(range(len(batch)))
        ref_lp = torch.zeros_like(batch.rollout_logp) if self.ref_model is not None else None
        with torch.no_grad():
            for mb in self._micro_batches(lengths, all_idx):
                width = max(lengths[i] for i in mb)
                sub = batch.select(mb).trim(width)
                w = sub.mask.shape[1]
                if self.graphed is not None:
                    lp, e = self.graphed.no_grad(sub, width)
                else:
                    lp, e = forward_logprobs(self.model, sub, temperature=temp, with_entropy=True)
                old_lp[mb, :w], ent[mb, :w] = lp, e  # copied out before the next replay
                if ref_lp is not None:
                    ref_lp[mb, :w], _ = forward_logprobs(self.ref_model, sub, temperature=temp)
        out = dict(algo.mismatch_metrics(old_lp, batch.rollout_logp, batch.mask))
        out["actor/entropy"] = float(algo.masked_mean(ent, batch.mask))
        # the metrics above read the log-probs on the host: the device has finished the old-log-prob pass
        out["time/old_logp_s"] = time.perf_counter() - t0
        anchor = old_lp if a.old_logp == "trainer" else batch.rollout_logp
        is_w = algo.truncated_is_weights(old_lp, batch.rollout_logp, a.tis_cap) if a.tis_cap else None
        adv = algo.group_advantages(ro.rewards, g, norm_by_std=a.norm_adv_by_std, eps=a.eps).to(self.device)
        gen = torch.Generator().manual_seed(_seed_of(self.cfg.run.seed, step, 99))
        stats = dict.fromkeys(
            ("clip_frac", "clip_frac_lower", "approx_kl", "kl", "ratio_max", "pg_loss", "tokens"), 0.0
        )
        # seq-mean-token-sum-norm divides by a constant: micro-batches are trimmed to different widths
        scale = a.loss_scale_factor if a.loss_scale_factor is not None else self.cfg.rollout.max_tokens
        norms = []
        n_micro, real_slots, padded_slots = 0, 0, 0
        n_mb = min(a.mini_batches, n_groups)
        for _ in range(a.epochs):
            order = torch.randperm(n_groups, generator=gen).tolist()
            for groups in [order[i::n_mb] for i in range(n_mb)]:
                idx = [gi * g + j for gi in sorted(groups) for j in range(g)]
                num_tokens = float(batch.mask[idx].sum())
                for mb in self._micro_batches(lengths, idx):
                    width = max(lengths[i] for i in mb)  # host lengths: no device sync
                    sub = batch.select(mb).trim(width)
                    t = sub.mask.shape[1]
                    n_micro += 1
                    real_slots += sum(lengths[i] for i in mb)
                    # the token slots computed: a graph computes its whole bucket
                    rows, cols = (len(mb), width) if self.graphed is None else self.graphed.bucket_of(len(mb), width)
                    padded_slots += rows * cols
                    if self.graphed is not None:
                        lp = self.graphed(sub, width)
                    else:
                        lp, _ = forward_logprobs(self.model, sub, temperature=temp)
                    # denominators of the whole mini-batch: the micro-batch losses sum to its loss
                    loss, st = algo.policy_loss(
                        lp,
                        anchor[mb, :t],
                        adv[mb],
                        sub.mask,
                        clip_low=a.clip_low,
                        clip_high=a.clip_high,
                        clip_ratio_c=a.clip_ratio_c,
                        loss_agg=a.loss_agg,
                        is_weights=None if is_w is None else is_w[mb, :t],
                        num_tokens=num_tokens,
                        num_seqs=len(idx),
                        loss_scale_factor=scale,
                    )
                    st["pg_loss"] = float(loss.detach())
                    if ref_lp is not None:
                        kl = algo.kl_penalty(lp, ref_lp[mb, :t], a.kl_type, mask=sub.mask)
                        kl_loss = algo.aggregate_loss(
                            kl, sub.mask, a.loss_agg, num_tokens=num_tokens, num_seqs=len(idx), loss_scale_factor=scale
                        )
                        loss = loss + a.kl_coef * kl_loss
                        st["kl"] = float(algo.masked_mean(kl.detach(), sub.mask))
                    loss.backward()
                    n_tok = float(sub.mask.sum())
                    for k in ("clip_frac", "clip_frac_lower", "approx_kl", "kl"):
                        stats[k] += st.get(k, 0.0) * n_tok
                    stats["ratio_max"] = max(stats["ratio_max"], st["ratio_max"])
                    stats["pg_loss"] += st["pg_loss"]
                    stats["tokens"] += n_tok
                norms.append(self.opt.step())
                if self.graphed is not None:  # the graphs read the cached FP8 weights: update them in place
                    refresh_fp8_weights_(self.model)
        tok = max(stats["tokens"], 1.0)
        out.update(
            {
                "actor/clip_frac": stats["clip_frac"] / tok,
                "actor/clip_frac_lower": stats["clip_frac_lower"] / tok,
                "actor/approx_kl": stats["approx_kl"] / tok,
                "actor/ratio_max": stats["ratio_max"],
                "actor/pg_loss": stats["pg_loss"] / max(1, len(norms)),
                "actor/grad_norm": sum(norms) / len(norms),
                "actor/lr": self.opt.lr(),
                "actor/optimizer_steps": len(norms),
                "batch/micro_batches": n_micro,
                "batch/pad_frac": 1.0 - real_slots / padded_slots,
                "reward/kept_mean": float(ro.rewards.mean()),
            }
        )
        if ref_lp is not None:
            out["actor/kl_ref"] = stats["kl"] / tok
        return out

    # ------------------------------------------------------------------ eval
    def _evaluate(self) -> float | None:
        n = self.cfg.run.eval_prompts
        if n == 0:
            return None
        problems = self.task.problems(Stream.EVAL, 0, n)
        samples = self._generate(problems, n=1, temperature=0.0, seed=_seed_of(self.cfg.run.seed, 0, 0))
        _, correct = self._score(problems, samples, 1)
        return float(correct.mean())

    # ------------------------------------------------------------------ loop
    def checkpoint_state(self, step: int) -> dict[str, Any]:
        """What a checkpoint holds (tensors, numbers, strings: `jetrl.train.checkpoint` stores it without
        pickles): the optimizer (fp32 masters, AdamW moments), the trainer's counters, the names of the
        trainable parameters the masters belong to (`jetrl export` maps them back by name)."""
        return {
            "step": step,
            "params": self._param_names(),
            "optimizer": self.opt.state_dict(),
            "trainer": dict(self.state),
        }

    def _checkpoint(self, step: int) -> None:
        save_checkpoint(
            self.run_dir / "checkpoints", step, self.checkpoint_state(step), keep=self.cfg.run.keep_checkpoints
        )
        self.last_checkpoint = step

    def step(self, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        ro, row, n_groups = self._rollout(step)
        t1 = time.perf_counter()
        if n_groups == 0:  # dynamic sampling found no group with signal: nothing to learn this step
            nan = float("nan")
            row.update(
                {
                    k: nan
                    for k in (
                        "mismatch/logp_abs_diff_mean",
                        "mismatch/logp_abs_diff_max",
                        "mismatch/is_ratio_mean",
                        "actor/clip_frac",
                        "actor/entropy",
                    )
                }
            )
            row["actor/optimizer_steps"] = 0
            row["time/old_logp_s"] = 0.0
        else:
            row.update(self._train(step, ro, n_groups))
        t2 = time.perf_counter()
        rep = self._sync()
        t3 = time.perf_counter()
        row.update(
            {
                "step": step,
                "time/rollout_s": t1 - t0,
                "time/train_s": t2 - t1,
                "time/update_s": t2 - t1 - row.get("time/old_logp_s", 0.0),
                "time/sync_s": t3 - t2,
                "sync/bytes": rep.bytes,
                "sync/tensors": rep.n_params,
                "sync/digests_equal": rep.digests_equal,
            }
        )
        ev = self.cfg.run.eval_every
        if step == self.cfg.run.steps or (ev and step % ev == 0):
            row["eval/accuracy"] = self._evaluate()
        row["time/step_s"] = time.perf_counter() - t0
        if hasattr(os, "getloadavg"):  # the machine's load while this run was timed (plots compare under it)
            row["host/load_1m"] = os.getloadavg()[0]
        return row

    def run(self) -> dict[str, Any]:
        t_start = time.perf_counter()
        self.setup()
        cfg = self.cfg
        if self.start_step == 0:
            self.state["eval_start"] = self._evaluate()
            self.log(f"step 0: greedy eval accuracy {self.state['eval_start']}")
        if self.start_step >= cfg.run.steps:
            self.log(f"nothing to do: checkpoint at step {self.start_step} >= run.steps={cfg.run.steps}")
        writer = MetricsWriter(self.run_dir / "metrics.jsonl", resume_step=self.start_step if self.resume else None)
        self._write_host()
        sinks = open_loggers(cfg, self.run_dir)
        bar = ProgressBar(cfg.run.steps, start=self.start_step, enabled=cfg.run.progress)
        try:
            for step in range(self.start_step + 1, cfg.run.steps + 1):
                self.current_step = step
                row = self.step(step)
                writer.write(row)
                sinks.log(row)
                bar.update(
                    step, reward=row["reward/mean"], dlogp=row["mismatch/logp_abs_diff_mean"], step_s=row["time/step_s"]
                )
                ce = cfg.run.checkpoint_every
                if (ce and step % ce == 0) or step == cfg.run.steps:
                    self.state["wall_s_before"] += time.perf_counter() - t_start
                    t_start = time.perf_counter()
                    self._checkpoint(step)
        finally:
            writer.close()
            sinks.close()
        self.state["wall_s_before"] += time.perf_counter() - t_start
        summary = self.summary()
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        from .plots import plot_runs

        plot_runs([self.run_dir], self.run_dir / "plots")
        return summary

    def _write_host(self) -> None:
        """``host.json``: where this run was timed (host, CPUs, device, threads); plots compare step times
        of runs only when these agree and the load did (`jetrl.train.plots`)."""
        info = {
            "host": platform.node(),
            "cpu_count": os.cpu_count(),
            "device": self.cfg.run.device,
            "gpu": torch.cuda.get_device_name() if self.device.type == "cuda" else None,
            "torch_threads": torch.get_num_threads(),
        }
        (self.run_dir / "host.json").write_text(json.dumps(info, indent=2))

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    def summary(self) -> dict[str, Any]:
        rows = read_metrics(self.run_dir / "metrics.jsonl")
        w = max(1, min(5, len(rows) // 4))

        def mean(key: str, rs: list[dict]) -> float | None:
            vals = [r[key] for r in rs if r.get(key) is not None]
            return sum(vals) / len(vals) if vals else None

        last_eval = next((r["eval/accuracy"] for r in reversed(rows) if r.get("eval/accuracy") is not None), None)
        return {
            "run": self.cfg.run.name,
            "recipe": self.recipe.name,
            "algo": self.cfg.algo.name,
            "seed": self.cfg.run.seed,
            "steps": len(rows),
            "reward_start": mean("reward/mean", rows[:w]),
            "reward_end": mean("reward/mean", rows[-w:]),
            "reward_window": w,
            "eval_accuracy_start": self.state.get("eval_start"),
            "eval_accuracy_end": last_eval,
            "mismatch_logp_abs_diff_mean": mean("mismatch/logp_abs_diff_mean", rows),
            "mismatch_logp_abs_diff_max": max(
                (r["mismatch/logp_abs_diff_max"] for r in rows if r.get("mismatch/logp_abs_diff_max") is not None),
                default=None,
            ),
            "mismatch_is_ratio_mean": mean("mismatch/is_ratio_mean", rows),
            "time_rollout_s_mean": mean("time/rollout_s", rows),
            "time_train_s_mean": mean("time/train_s", rows),
            "time_sync_s_mean": mean("time/sync_s", rows),
            "sync_bytes": rows[-1]["sync/bytes"] if rows else None,
            "wall_s": self.state.get("wall_s_before"),
            "setup_s": getattr(self, "setup_s", None),
            "converted_linears": len(self.conversion.converted_names()) if hasattr(self, "conversion") else None,
            "finite": all(math.isfinite(r["reward/mean"]) for r in rows),
            "numerics": self.cfg.model.numerics,
            "engine_ops": self.cfg.rollout.engine_ops,
            "numerics_path": (
                {**asdict(self.numerics_path), "text": self.numerics_path.describe()}
                if getattr(self, "numerics_path", None)
                else None
            ),
        }
