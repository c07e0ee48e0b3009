"""Normalization: rewrite a precision graph into canonical form, each rule with its validity condition.

Two graphs can only be compared once they name the same ops the same way. The rollout engine fuses
and shards what the HF training model keeps separate; each rewrite below is exact only under a
condition, which is checked, and a rewrite whose condition fails is itself a finding (the fused or
sharded engine computes different values than the separate training ops would):

1. **Tensor-parallel shards -> one Linear.** Valid iff every shard's size along the split dim is a
   multiple of 128 wherever the tensor is block-quantized: a column-parallel shard (split along N)
   of a 128x128-quantized weight must not cut a block; a row-parallel shard (split along K) must not
   cut a 1x128 activation group or a weight block. (BF16 shards are exact up to the all-reduce order.)
2. **Fused ``qkv_proj`` / ``gate_up_proj`` -> the HF projections.** Valid iff every part's N is a
   multiple of 128 when the weight is 128x128-quantized (no block straddles two parts, so each part's
   block scales equal those of the separately quantized projection) and the input quantization is
   shared (one quantize node feeds the fused GEMM; quantization is a deterministic function of the
   tensor and the spec, so each part sees the bytes a separate projection would compute).
3. **Fused norm+quantize / activation+quantize -> the op, then a quantize per consumer.** Valid iff the
   fused op quantizes its output after rounding it to the output dtype (attribute ``quant_input``
   equals the op's output dtype), which is what a separate quantizer would read.
4. **Module names.** vLLM's ``self_attn.attn`` is the attention core of HF's ``self_attn``.

Rewritten nodes keep the engine's own module path in the attribute ``engine_module`` (and the parts
of a split fused Linear in ``fused_parts``), so findings can name both modules.

`normalize(graph)` applies them in that order and returns the canonical graph, the findings of
rules whose condition failed, and the list of rules applied (with their conditions) for the report.
"""

from __future__ import annotations

from collections.abc import Callable

from jetrl.lint.ir import BF16, GEMM_KINDS, Edge, Graph, Node, OpKind, node_id
from jetrl.lint.layout import FUSED_LINEARS
from jetrl.lint.report import Finding, Severity
from jetrl.recipe import BLOCK, Granularity

__all__ = ["normalize", "RULES"]

RULES = {
    "tp": "TP shards -> one Linear (valid iff each shard along the split dim is a multiple of 128 when quantized)",
    "fused": "fused qkv_proj/gate_up_proj -> HF projections (valid iff each part's N is a multiple of 128 and "
    "the input quantization is shared)",
    "norm_quant": "fused norm/activation+quantize -> op then quantize (valid iff the fused op quantizes its "
    "rounded output)",
    "rename": "vLLM self_attn.attn -> HF self_attn",
}


def normalize(graph: Graph) -> tuple[Graph, list[Finding], list[str]]:
    """Canonical copy of `graph`, findings of failed rule conditions, and the rules applied."""
    g = graph.copy()
    findings: list[Finding] = []
    applied: list[str] = []
    for key, rule in (("tp", _merge_tp), ("fused", _split_fused), ("norm_quant", _unfuse_quant), ("rename", _rename)):
        n = rule(g, findings)
        if n:
            applied.append(f"{RULES[key]} x{n}")
    return g, findings, applied


def _block_quantized(edge: Edge | None) -> bool:
    return (
        edge is not None
        and edge.precision.spec is not None
        and edge.precision.spec.granularity
        in (
            Granularity.G128x128,
            Granularity.G1x128,
            Granularity.G128x1,
        )
    )


# -- rule 1: tensor-parallel shards ----------------------------------------------------------------


def _merge_tp(g: Graph, findings: list[Finding]) -> int:
    count = 0
    for node in list(g.nodes.values()):
        tp = node.attr("tp_size")
        if not tp:
            continue
        count += 1
        split = node.attr("tp_split")
        ins = g.inputs(node.id)
        # along N only the weight blocks are cut; along K the activation groups and the weight blocks
        relevant = [ins.get("w")] if split == "N" else [ins.get("x"), ins.get("w")]
        if any(_block_quantized(e) for e in relevant):
            bad = [(part, size) for part, size in node.attr("tp_shards", ()) if size % BLOCK]
            if bad:
                what = "N (column-parallel)" if split == "N" else "K (row-parallel)"
                detail = ", ".join(f"{part} shard {size}" for part, size in bad)
                findings.append(
                    Finding(
                        Severity.ERROR,
                        "tp-shard",
                        f"TP={tp} splits {node.module} along {what} into shards that are not multiples of "
                        f"{BLOCK} ({detail}): 128-wide quantization groups straddle ranks, so each rank "
                        f"quantizes different groups than the unsharded training Linear",
                        rollout_module=node.module,
                        training_module=_hf_names(node),
                        tensor="w" if split == "N" else "x, w",
                        expected=f"shards of a multiple of {BLOCK} along {split}",
                        found=detail,
                        fix=f"use a tensor_parallel_size that splits every projection into multiples of {BLOCK} "
                        f"(TP={tp} does not), or keep {node.module} in BF16",
                    )
                )
        g.replace_node(node.with_attrs(tp_size=None, tp_split=None, tp_shards=None))
    return count


def _hf_names(node: Node) -> str:
    """The HF module(s) a (possibly fused) engine Linear computes."""
    parts = node.attr("parts")
    if not parts:
        return node.module
    prefix = node.module.rsplit(".", 1)[0]
    return ", ".join(f"{prefix}.{name}" for name, _ in parts)


# -- rule 2: fused projections ---------------------------------------------------------------------


def _split_fused(g: Graph, findings: list[Finding]) -> int:
    count = 0
    for node in list(g.nodes.values()):
        leaf = node.module.rsplit(".", 1)[-1]
        if node.kind not in GEMM_KINDS or leaf not in FUSED_LINEARS:
            continue
        parts = node.attr("parts")
        if not parts:
            raise ValueError(f"{g.side} graph: fused {node.module} carries no 'parts' attribute (N of each part)")
        prefix = node.module.rsplit(".", 1)[0]
        ins = g.inputs(node.id)
        x_ports = [p for p in ins if p.startswith("x")]
        w = ins["w"]
        if _block_quantized(w):
            bad = [(name, n) for name, n in parts if n % BLOCK]
            if bad:
                findings.append(
                    Finding(
                        Severity.ERROR,
                        "fused-split",
                        f"fused {leaf} concatenates parts whose N is not a multiple of {BLOCK} "
                        f"({', '.join(f'{nm} N={n}' for nm, n in bad)}): a 128x128 weight block spans two "
                        "projections, so its scale differs from the separately quantized training weights",
                        rollout_module=node.module,
                        training_module=", ".join(f"{prefix}.{nm}" for nm, _ in parts),
                        tensor="w",
                        expected=f"each part N % {BLOCK} == 0",
                        found=", ".join(f"{nm} N={n}" for nm, n in parts),
                        fix=f"exclude {node.module} from FP8 in the rollout (ignored_layers / recipe keep_bf16), "
                        "or use head dims that make every part a multiple of 128",
                    )
                )
        qsrc = {ins[p].src for p in x_ports}
        shared = all(s.endswith(":quantize") for s in qsrc) and len({s for s in qsrc if s}) == 1
        if any(ins[p].precision.quantized for p in x_ports) and not shared:
            findings.append(
                Finding(
                    Severity.ERROR,
                    "fused-split",
                    f"fused {leaf}: the parts' input quantizations are not one shared quantize op "
                    f"(sources {sorted(qsrc)}), so splitting it cannot be shown exact",
                    rollout_module=node.module,
                    tensor="x",
                )
            )
        quant_id = node_id(node.module, OpKind.QUANTIZE)
        quant_in = g.inputs(quant_id).get("x") if quant_id in g.nodes else None
        outs = g.outputs(node.id)
        g.remove_node(node.id)
        if quant_id in g.nodes:
            g.remove_node(quant_id)
        first = None
        for name, n in parts:
            mod = f"{prefix}.{name}"
            attrs = dict(node.attrs)
            attrs.pop("parts", None)
            attrs["n"] = n
            attrs["fused_from"] = node.module
            attrs["fused_parts"] = tuple(f"{prefix}.{nm}" for nm, _ in parts)
            attrs.setdefault("engine_module", node.module)
            new = g.add_node(node.kind, mod, node.role, **attrs)
            first = first or new.id
            for p in x_ports:
                e = ins[p]
                src = e.src
                if e.src == quant_id:
                    src = node_id(mod, OpKind.QUANTIZE)
                    if src not in g.nodes:
                        g.add_node(OpKind.QUANTIZE, mod, fused_from=node.module)
                        g.add_edge(
                            quant_in.src if quant_in else "input", src, "x", quant_in.precision if quant_in else BF16
                        )
                g.add_edge(src, new.id, p, e.precision, e.origin)
            g.add_edge(f"param:{mod}.weight", new.id, "w", w.precision, w.origin)
        for e in outs:
            g.edges.append(Edge(first, e.dst, e.port, e.precision, e.origin))
        count += 1
    return count


# -- rule 3: fused norm / activation + quantize ------------------------------------------------------


def _unfuse_quant(g: Graph, findings: list[Finding]) -> int:
    count = 0
    plain = {OpKind.NORM_QUANT: OpKind.NORM, OpKind.ACTIVATION_QUANT: OpKind.ACTIVATION}
    for node in list(g.nodes.values()):
        if node.kind not in plain:
            continue
        count += 1
        out_dtype = node.attr("out_dtype", "bfloat16")
        if node.attr("quant_input", out_dtype) != out_dtype:
            findings.append(
                Finding(
                    Severity.ERROR,
                    "norm-quant-fusion",
                    f"{node.kind.value} at {node.module} quantizes its {node.attr('quant_input')} value, not the "
                    f"{out_dtype} output a separate quantizer reads: the fused bytes differ",
                    rollout_module=node.module if g.side == "rollout" else "",
                    training_module=node.module if g.side == "training" else "",
                    expected=f"quantize({out_dtype} output)",
                    found=f"quantize({node.attr('quant_input')})",
                )
            )
        ins = g.inputs(node.id)
        outs = g.outputs(node.id)
        g.remove_node(node.id)
        new = g.add_node(plain[node.kind], node.module, **dict(node.attrs))
        for port, e in ins.items():
            g.add_edge(e.src, new.id, port, e.precision, e.origin)
        for e in outs:
            consumer = g.nodes[e.dst]
            if e.precision.quantized and consumer.kind in GEMM_KINDS:
                qid = node_id(consumer.module, OpKind.QUANTIZE)
                if qid not in g.nodes:
                    g.add_node(OpKind.QUANTIZE, consumer.module, fused_into=node.module)
                    g.add_edge(new.id, qid, "x", BF16)
                g.edges.append(Edge(qid, e.dst, e.port, e.precision, e.origin))
            else:
                g.edges.append(Edge(new.id, e.dst, e.port, e.precision, e.origin))
    return count


# -- rule 4: names ---------------------------------------------------------------------------------


def _rename_module(module: str) -> str:
    if module.endswith(".self_attn.attn"):
        return module[: -len(".attn")]
    return module


def _rename(g: Graph, findings: list[Finding]) -> int:
    return _apply_rename(g, _rename_module)


def _apply_rename(g: Graph, fn: Callable[[str], str]) -> int:
    mapping: dict[str, str] = {}
    nodes: dict[str, Node] = {}
    for nid, n in g.nodes.items():
        mod = fn(n.module)
        new_id = node_id(mod, n.kind, n.role) if mod != n.module else nid
        mapping[nid] = new_id
        attrs = n.attrs if mod == n.module or n.attr("engine_module") else (*n.attrs, ("engine_module", n.module))
        nodes[new_id] = Node(new_id, n.kind, mod, n.role, tuple(sorted(attrs)))
    changed = sum(1 for a, b in mapping.items() if a != b)
    if changed:
        g.nodes = nodes
        g.edges = [Edge(mapping.get(e.src, e.src), mapping[e.dst], e.port, e.precision, e.origin) for e in g.edges]
    return changed
