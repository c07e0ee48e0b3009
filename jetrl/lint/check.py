"""The check: after normalization, every rollout node and edge maps onto the training forward graph
with an identical label (G_rollout ⊆ G_train_fwd, Jet-RL's invariant).

For each rollout node the training graph must hold a node of the same canonical id (quantize nodes
are checked through the edge they feed). For each rollout edge, the training edge into the same port
of the same node must carry the same `Precision` (dtype and QuantSpec; a regime-conditional port
such as ``x[M<32]`` is compared with the training's unconditional ``x``). Each mismatch becomes a
`Finding` naming both modules, the expected (training) and found (rollout) labels, and a fix
derived from the edge's ``origin`` — the setting that produced the rollout's label — so the fix names
the environment variable, recipe field or layer to exclude that actually decided it.

A K/V-cache dtype the trainer does not use is a warning, not an error: attention is not a Linear of
the recipe, so the FP8 flow does not forbid it, but it moves rollout log-probs away from the
trainer's and the report says so.

Findings with the same code, tensor, labels and fix are grouped (first module in the record, the
others in ``also``), so a setting that breaks every Linear reads as one line, not fifty.
"""

from __future__ import annotations

from jetrl.lint.ir import Edge, Graph, Node, OpKind
from jetrl.lint.report import Finding, Severity, group_findings

__all__ = ["check", "spec_differences"]


def spec_differences(expected: Edge, found: Edge) -> list[str]:
    """Names of the QuantSpec / dtype fields in which two edges' labels differ."""
    a, b = expected.precision, found.precision
    if a.spec is None or b.spec is None:
        return ["dtype"] if a.dtype != b.dtype else []
    fields = ("granularity", "scale_format", "eps", "division", "dtype", "scale_dtype")
    return [f for f in fields if getattr(a.spec, f) != getattr(b.spec, f)]


def check(training: Graph, rollout: Graph) -> list[Finding]:
    """Findings of `rollout` against `training`; both graphs must already be normalized."""
    if training.side != "training" or rollout.side != "rollout":
        raise ValueError(f"check(training, rollout): got sides {training.side!r}, {rollout.side!r}")
    engine = rollout.meta.get("engine", "rollout")
    findings: list[Finding] = []
    # visit the rollout's nodes in the training forward's order, so findings read first layer first
    rank = {nid: i for i, nid in enumerate(training.nodes)}
    ordered = sorted(rollout.nodes.items(), key=lambda kv: rank.get(kv[0], len(rank)))
    for nid, node in ordered:
        if node.kind is OpKind.QUANTIZE:
            continue  # its output label is checked on the GEMM port it feeds
        tnode = training.nodes.get(nid)
        if tnode is None:
            findings.append(
                Finding(
                    Severity.ERROR,
                    "missing-in-training",
                    f"the rollout runs {node.kind.value} {nid!r}, which the training forward graph does not contain",
                    rollout_module=node.module,
                    fix="check the model and checkpoint are the same architecture (rollout and training must run "
                    "the same ops)",
                )
            )
            continue
        t_in = training.inputs(nid)
        for port, edge in sorted(rollout.inputs(nid).items()):
            base = port.split("[", 1)[0]
            tedge = t_in.get(port) or t_in.get(base)
            if tedge is None:
                if edge.precision.quantized:
                    findings.append(
                        Finding(
                            Severity.ERROR,
                            "missing-in-training",
                            f"{nid} port {port!r} has no training counterpart",
                            rollout_module=node.module,
                            training_module=tnode.module,
                            tensor=port,
                            found=edge.precision.label(),
                        )
                    )
                continue
            if edge.precision.same_values(tedge.precision):
                continue
            r_mod = node.attr("engine_module", node.module)
            findings.append(_mismatch(node, r_mod, tnode.module, port, tedge, edge, engine))
    return group_findings(findings)


def _mismatch(node: Node, r_mod: str, t_mod: str, port: str, tedge: Edge, redge: Edge, engine: str) -> Finding:
    kind = node.kind
    exp, got = tedge.precision, redge.precision
    common = dict(rollout_module=r_mod, training_module=t_mod, tensor=port, expected=exp.label(), found=got.label())
    if port == "kv":
        return Finding(
            Severity.WARNING,
            "kv-cache-dtype",
            f"the rollout stores K/V as {got.dtype} ({got.producer or redge.origin}) but the trainer computes "
            f"attention from {exp.dtype} K/V; attention is outside the FP8 recipe, so this is allowed, but it "
            "changes rollout attention outputs and raises the trainer/rollout log-prob mismatch",
            fix=f"serve with kv_cache_dtype='auto' (K/V in {exp.dtype}) to keep attention on-policy",
            **common,
        )
    what = "lm_head" if kind is OpKind.LM_HEAD else "Linear"
    tensor = {"x": "activation", "w": "weight"}.get(port.split("[", 1)[0], port)
    if exp.quantized != got.quantized:
        side_q, side_b = ("rollout", "training") if got.quantized else ("training", "rollout")
        return Finding(
            Severity.ERROR,
            "quantized-one-side",
            f"{what} {t_mod}: the {tensor} is quantized in {side_q} only "
            f"({side_b} keeps it {(exp if got.quantized else got).dtype})",
            fix=_fix_one_side(t_mod, node.attr("fused_parts", ()), tedge, redge, engine),
            **common,
        )
    if not got.quantized:
        return Finding(
            Severity.ERROR,
            "dtype-mismatch",
            f"{what} {t_mod}: {tensor} is {got.dtype} in the rollout but {exp.dtype} in training",
            fix="run both sides in the same dtype (model dtype / torch_dtype)",
            **common,
        )
    diffs = spec_differences(tedge, redge)
    detail = ", ".join(f"{f} {getattr(exp.spec, f)} vs {getattr(got.spec, f)}" for f in diffs)
    effects = "; ".join(_EFFECTS[f] for f in diffs if f in _EFFECTS)
    if "448/amax" in got.producer:  # FlashInfer's formula: the closest QuantSpec is x*(1/s), the effect is larger
        effects = "448/amax then x*scale: ~0.1% of bytes and ~60% of scales differ (NUMERICS.md section 2)"
    detail = f"{detail} ({effects})" if effects else detail
    regime = f" (for {got.when})" if got.when else ""
    producer = f"; produced by {got.producer}" if got.producer else ""
    return Finding(
        Severity.ERROR,
        "precision-mismatch",
        f"{what} {t_mod}: the rollout quantizes the {tensor} differently{regime}: {detail}{producer}",
        fix=_fix_spec(diffs, redge, port, tensor, engine),
        **common,
    )


_EFFECTS = {
    "scale_format": "power-of-two scales change scales and bytes of almost every group",
    "eps": "differs on all-zero or tiny groups, e.g. padding rows",
    "division": "x*(1/s) differs from x/s in ~1 of 33M bytes on bf16 activations, more on other data",
    "granularity": "a different grouping changes every scale",
}
"""What each QuantSpec field difference does to the bytes (NUMERICS.md section 2)."""


def _env_fix(origin: str) -> str | None:
    if not origin.startswith("env:"):
        return None
    name, _, val = origin[4:].split(" ", 1)[0].partition("=")
    flipped = "0" if val == "1" else "1"
    extra = {
        "VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER": " (or start vLLM with --linear-backend deep_gemm)",
        "VLLM_USE_DEEP_GEMM_E8M0": " (and drop scale_fmt from the checkpoint's quantization_config)",
    }.get(name, "")
    return f"export {name}={flipped} before starting vLLM{extra}"


def _fix_spec(diffs: list[str], redge: Edge, port: str, tensor: str, engine: str) -> str:
    origin = redge.origin
    env = _env_fix(origin)
    if env:
        return env
    if origin.startswith("recipe:"):
        fld = origin.split(":", 1)[1]
        return f"set Recipe.{fld} to the training spec (differs in {', '.join(diffs)})"
    if origin.startswith("quantization_config:scale_fmt"):
        return "remove scale_fmt='ue8m0' from the checkpoint's quantization_config, or export VLLM_USE_DEEP_GEMM_E8M0=0"
    if origin.startswith("quantization="):
        method = origin.split("=", 1)[1]
        return (
            f"do not use online --quantization {method}: export the trainer's 128x128 FP8 weights "
            "(quant_method 'fp8', weight_block_size [128, 128]) or use --rollout jetrl-vllm"
        )
    if origin.startswith("quant_op=native"):
        return "enable vLLM's quant_fp8 custom op (compilation_config custom_ops=['+quant_fp8'], or enforce_eager=True)"
    if origin.startswith("quantization_config"):
        return "re-export the checkpoint with 128x128 weight blocks (weight_block_size [128, 128]) from the trainer"
    return (
        f"make the {engine} {tensor} quantizer produce the training spec (differs in {', '.join(diffs)}); "
        f"origin: {origin or 'unknown'}"
    )


def _fix_one_side(t_mod: str, fused_parts: tuple[str, ...], tedge: Edge, redge: Edge, engine: str) -> str:
    leaf = t_mod.rsplit(".", 1)[-1]
    if redge.precision.quantized:  # quantized in rollout only
        if engine == "stock-vllm":
            names = fused_parts or (t_mod,)
            fused = " (all parts of the fused Linear: vLLM refuses a partly ignored one)" if fused_parts else ""
            how = f"add {', '.join(repr(n) for n in names)} to quantization_config.ignored_layers{fused}"
        else:
            how = f"add '{leaf}' to the rollout's keep_bf16 (Recipe.keep_bf16)"
        why = f" (training keeps it BF16: {tedge.origin})" if tedge.origin else ""
        return f"exclude {t_mod} from FP8 in the rollout: {how}{why}; or convert it in training"
    # quantized in training only
    why = f" (rollout keeps it BF16: {redge.origin})" if redge.origin else ""
    return (
        f"keep {t_mod} in BF16 in training too (add '{leaf}' to Recipe.keep_bf16), "
        f"or quantize it identically in the rollout{why}"
    )
