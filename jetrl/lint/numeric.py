"""Numeric mode: run the probe through both sides and attribute every difference to one layer.

For each Linear of the training forward (in execution order), with the rollout's fused Linears split
into their parts (columns of the output, rows of the weight and of its 128-row scale blocks):

- **weights**: the rollout's weight bytes and scales equal the trainer's (sha256 digests reported);
- **activation quantizer**: the rollout's fp8 input bytes equal what the *training* spec
  (`jetrl.quant.quantize`) makes of the rollout's own input. This isolates the quantizer from upstream
  drift: it holds whenever the rollout quantizes exactly like the trainer, whatever its input;
- **input / output**: max |difference| and SQNR of the Linear's input and output between the two sides.
  The input difference of a Linear whose predecessor Linears all matched bit for bit is drift from a
  non-Linear op (attention, norm kernels): reported, not an error (the FP8 recipe does not cover it).

The first layer where anything differs is named with what differs and by how much. Weight or
quantizer differences are errors (`numeric-weights`, `numeric-quantizer`); drift is information.

The trainer side runs the *run's own* numerics between the Linears (`capture_training_numerics`:
``model.numerics`` 'vllm-cpu' matches RoPE, attention and residual+RMSNorm to vLLM's CPU kernels, as
``jetrl train`` does on CPU; 'strict' runs vLLM's FlashAttention forward in the trainer on CUDA
(`jetrl.rollout.engine_strict`); 'hf' is transformers' model as is), so the table describes what training
computes. The result's ``compared`` sentences say in words what each column compares and why drift
does not make the verdict inconsistent; the report prints them above the table.
"""

from __future__ import annotations

from typing import Any

import torch

from jetrl import quant
from jetrl.lint.capture import ModelTrace, digest
from jetrl.lint.report import Finding, Severity, group_findings
from jetrl.recipe import BLOCK
from jetrl.testing.numerics import max_abs_diff, sqnr_db

__all__ = ["compare_numeric", "capture_training_numerics", "describe_comparison"]


def capture_training_numerics(model_path, recipe, *, numerics: str, probe: list[int], backend: str = "auto"):
    """The training capture of `model_path` for a numeric lint, with the trainer's numerics between the
    Linears: 'hf' is `jetrl.lint.builders.capture_training` as is; 'vllm-cpu' takes the per-layer tensors
    from the checkpoint with `jetrl.rollout.engine_match.match_vllm_cpu` applied (what ``jetrl train``
    computes on CPU) and the graph from transformers' forward (the matched layers run the same ops in the
    same precisions, but their norms bypass the module calls the graph capture records).
    ``trace.meta["numerics"]`` records the choice."""
    from jetrl.convert import convert_model
    from jetrl.gemm import get_backend
    from jetrl.lint.builders import (
        LintEnvError,
        TrainingCapture,
        capture_converted,
        capture_training,
        load_training_model,
    )

    if numerics not in ("hf", "vllm-cpu", "strict"):
        raise LintEnvError(f"numerics {numerics!r}: choose 'hf', 'vllm-cpu' or 'strict'")
    graph_cap = capture_training(model_path, recipe, probe=probe, backend=backend, keep_tensors=numerics == "hf")
    if numerics == "hf":
        graph_cap.trace.meta["numerics"] = numerics
        return graph_cap
    model = load_training_model(model_path)
    if numerics == "strict":  # vLLM's CUDA kernels in the trainer (jetrl.rollout.engine_strict)
        if not torch.cuda.is_available():
            raise LintEnvError("numerics 'strict' runs vLLM's CUDA kernels in the trainer: it needs a GPU")
        from jetrl.rollout.engine_strict import match_vllm_strict

        model = model.cuda()
        match_vllm_strict(model)
    else:
        if recipe.train_fp8 and get_backend(backend).device_type == "cuda":
            raise LintEnvError("numerics 'vllm-cpu' matches vLLM's CPU kernels; with a CUDA GEMM backend use 'hf'")
        from jetrl.rollout.engine_match import match_vllm_cpu

        match_vllm_cpu(model)
    report = convert_model(model, recipe, backend=backend)
    matched = capture_converted(model, report, recipe, probe=probe, keep_tensors=True)
    matched.trace.meta["numerics"] = numerics
    return TrainingCapture(graph_cap.graph, matched.trace, graph_cap.conversion)


_NUMERICS_WORDS = {
    "hf": "transformers' own ops between the Linears (model.numerics 'hf')",
    "vllm-cpu": "RoPE, attention and residual+RMSNorm computed as vLLM's CPU kernels do (model.numerics 'vllm-cpu', "
    "what jetrl train runs on CPU)",
    "strict": "transformers' ops with vLLM's FlashAttention forward, in vLLM's batch-invariant mode (model.numerics "
    "'strict')",
}


def describe_comparison(numerics: str, probe_len: int) -> list[str]:
    """What the numeric table compares, in words (printed above it)."""
    return [
        f"compared: one prefill of the same {probe_len}-token probe through the trainer (the BF16 checkpoint "
        f"converted with the recipe, {_NUMERICS_WORDS.get(numerics, numerics)}) and through the rollout engine.",
        "W BYTES: the engine's fp8 weight bytes and scales of the Linear equal the trainer's (or differ).",
        "X BYTES: the engine's fp8 input bytes and scales equal what the training quantizer makes of the engine's "
        "own input, i.e. both sides quantize alike whatever the input (if the inputs are equal, also equal to the "
        "trainer's bytes).",
        "MAX|dX|: largest difference between the two sides' inputs of the Linear: drift carried in from the ops "
        "before it (attention, norms, RoPE), which the FP8 recipe does not cover. MAX|dY| / SQNR dB: the Linear's "
        "output difference and signal-to-noise ratio (inf: equal).",
        "verdict: only differing W or X bytes are errors (the rollout would not compute what training computes "
        "with); input/output drift with equal bytes is reported, not an error, so it can read CONSISTENT.",
    ]


def _rollout_index(rollout: ModelTrace) -> dict[str, tuple[str, int, int]]:
    """HF Linear name -> (rollout module, first output column, last+1) for fused and plain Linears."""
    out: dict[str, tuple[str, int, int]] = {}
    for info in rollout.modules:
        if info.kind not in ("linear", "lm_head"):
            continue
        if info.parts:
            prefix = info.path.rsplit(".", 1)[0]
            lo = 0
            for name, n in info.parts:
                out[f"{prefix}.{name}"] = (info.path, lo, lo + n)
                lo += n
        else:
            out[info.path] = (info.path, 0, info.n)
    return out


def _rows(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.reshape(-1, t.shape[-1])


def _bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype == quant.FP8_DTYPE:
        return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    return torch.equal(a, b)


def compare_numeric(
    training: ModelTrace, rollout: ModelTrace, *, probe_len: int
) -> tuple[dict[str, Any], list[Finding]]:
    """The per-layer table, the first divergence, and the findings (see module docstring)."""
    index = _rollout_index(rollout)
    t_infos = {i.path: i for i in training.modules}
    r_infos = {i.path: i for i in rollout.modules}
    rows: list[dict[str, Any]] = []
    findings: list[Finding] = []
    first: dict[str, Any] | None = None
    linears = [p for p in training.order if p in t_infos and t_infos[p].kind in ("linear", "lm_head")]
    prev_linear = ""
    for path in linears:
        if path not in index:
            continue
        r_mod, lo, hi = index[path]
        tt, rt = training.tensors.get(path, {}), rollout.tensors.get(r_mod, {})
        tinfo, rinfo = t_infos[path], r_infos[r_mod]
        if not rinfo.parts and rinfo.n > tinfo.n:
            hi = lo + tinfo.n  # vLLM pads vocab-parallel rows (lm_head); the padding is not the trainer's
        row: dict[str, Any] = {"module": path, "rollout_module": r_mod}
        # -- weights ---------------------------------------------------------------------------
        if "wq" in tt and "wq" in rt and rt["wq"] is not None:
            rwq = rt["wq"][lo:hi]
            rws = rt["ws"]
            if rws is not None and rws.dim() == 2:
                rws = rws[lo // BLOCK : -(-hi // BLOCK)]
            eq = _bytes_equal(tt["wq"], rwq) and rws is not None and _bytes_equal(tt["ws"], rws)
            row["weight_bytes_equal"] = eq
            row["weight_digest_training"] = digest(tt["wq"])[:16]
            row["weight_digest_rollout"] = digest(rwq.contiguous())[:16]
        elif "w" in tt and "w" in rt:
            row["weight_bytes_equal"] = _bytes_equal(tt["w"], rt["w"][lo:hi])
        else:
            row["weight_bytes_equal"] = None  # one side quantized, the other not: the graph check reports it
        # -- activation quantizer ---------------------------------------------------------------
        rx, tx = _rows(rt.get("x")), _rows(tt.get("x"))
        t_spec = tinfo.x.spec if tinfo.x is not None else None
        if t_spec is not None and rx is not None and rt.get("xq") is not None:
            want_q, want_s = quant.quantize(rx, t_spec, name=f"{r_mod}:input")
            row["act_bytes_equal"] = _bytes_equal(_rows(rt["xq"]), want_q) and torch.equal(
                _rows(rt["xs"]).contiguous(), want_s
            )
        else:
            row["act_bytes_equal"] = None
        # -- input drift and output difference --------------------------------------------------
        if rx is not None and tx is not None and rx.shape == tx.shape:
            row["input_max_abs_diff"] = max_abs_diff(tx, rx)
            if row["input_max_abs_diff"] == 0.0 and tt.get("xq") is not None and rt.get("xq") is not None:
                # same input on both sides: the two sides' fp8 bytes must be identical too
                same = _bytes_equal(_rows(tt["xq"]), _rows(rt["xq"]))
                row["act_bytes_equal"] = bool(row["act_bytes_equal"] is not False and same)
        ry, ty = _rows(rt.get("y")), _rows(tt.get("y"))
        if ry is not None and ty is not None:
            ry = ry[:, lo:hi]
            if ry.shape == ty.shape:
                row["max_abs_diff"] = max_abs_diff(ty, ry)
                row["sqnr_db"] = sqnr_db(ty.float(), ry.float())
            else:
                row["max_abs_diff"] = None
                row["note"] = f"output shapes differ: training {tuple(ty.shape)} vs rollout {tuple(ry.shape)}"
        rows.append(row)
        what = _divergence(row, prev_linear)
        prev_linear = path
        if what and first is None:
            first = {"module": path, "rollout_module": r_mod, "what": what}
        if row["weight_bytes_equal"] is False:
            findings.append(
                Finding(
                    Severity.ERROR,
                    "numeric-weights",
                    f"the rollout's weight bytes of {path} differ from the trainer's "
                    f"(sha256 training {row.get('weight_digest_training', '?')} vs "
                    f"rollout {row.get('weight_digest_rollout', '?')})",
                    rollout_module=r_mod,
                    training_module=path,
                    tensor="w",
                    fix="sync the trainer's fp8 bytes (jetrl.rollout.sync.sync_weights, weight_sync='fp8-bytes') "
                    "instead of re-quantizing in the engine",
                )
            )
        if row["act_bytes_equal"] is False:
            findings.append(
                Finding(
                    Severity.ERROR,
                    "numeric-quantizer",
                    f"the rollout's fp8 input bytes of {r_mod} differ from the training quantizer "
                    f"({t_spec.label()}) applied to the same input",
                    rollout_module=r_mod,
                    training_module=path,
                    tensor="x",
                    expected=t_spec.label(),
                    fix="quantize rollout activations with the trainer's op (jetrl_fp8 / jetrl.gemm.linear_fp8)",
                )
            )
        del tinfo, rinfo
    logits = _logits(training, rollout)
    numerics = training.meta.get("numerics", "hf")
    result: dict[str, Any] = {
        "probe": f"{probe_len} tokens, one prefill on each side",
        "trainer_numerics": numerics,
        "compared": describe_comparison(numerics, probe_len),
        "layers": rows,
        "first_divergence": first,
    }
    if logits is not None:
        result["logits_max_abs_diff"] = logits
    return result, group_findings(findings)


def _divergence(row: dict[str, Any], prev_linear: str) -> str:
    if row.get("weight_bytes_equal") is False:
        return "weight bytes differ"
    if row.get("act_bytes_equal") is False:
        return "activation quantizer bytes differ"
    dx = row.get("input_max_abs_diff")
    if dx:
        since = f"after {prev_linear}" if prev_linear else "before the first Linear"
        return f"input differs (max |dx| = {dx:.3e}): drift from the non-Linear ops {since} (attention, norms)"
    dy = row.get("max_abs_diff")
    if dy:
        return f"output differs (max |dy| = {dy:.3e}, SQNR {row.get('sqnr_db', float('nan')):.1f} dB) with equal input"
    return ""


def _logits(training: ModelTrace, rollout: ModelTrace) -> float | None:
    t = training.tensors.get("lm_head", {}).get("y")
    r = rollout.tensors.get("logits_processor", {}).get("y")
    if t is None or r is None:
        return None
    t_last = t.reshape(-1, t.shape[-1])[-1]
    r_last = r.reshape(-1, r.shape[-1])[-1][: t_last.shape[0]]
    return max_abs_diff(t_last.float(), r_last.float())
