"""The precision graph: ops as nodes, tensors as edges labelled with exactly how they are represented.

A `Graph` is one side of an RL setup (the training forward or the rollout engine). Nodes are ops
(`OpKind`: embedding, norm, quantize, GEMM with its role, activation, attention, lm_head, and the
fused forms norm+quantize / activation+quantize) tagged with the module path that ran them. Edges
are the tensors between them; each carries a `Precision`:

- ``dtype``: the element dtype of the tensor (``bfloat16``, ``float32``, ``float8_e4m3fn``);
- ``spec``: for fp8 tensors the `jetrl.recipe.QuantSpec` that produced the bytes (granularity, scale
  dtype and format, eps, division formula). The spec is *reused*, never restated: two edges carry the
  same values only if their specs are equal (`QuantSpec`'s own docstring);
- ``producer``: which implementation wrote the bytes (``jetrl::quantize_1x128``, ``checkpoint``,
  ``vllm:per_token_group_quant_fp8`` ...), for the report only;
- ``when``: a regime the label is conditional on (``"M<32"`` for a quantizer vLLM only selects for
  small batches); empty means every batch size.

Each edge also records its ``origin``: the setting that decided the label (``env:VLLM_USE_DEEP_GEMM_E8M0=1``,
``recipe:rollout_activation``, ``quantization_config:ignored_layers`` ...). The check turns an origin
into the concrete fix of a violation, so a finding names the knob to turn, not just the symptom.

Canonical form (what `jetrl.lint.normalize` produces and `jetrl.lint.check` compares): module paths
are HF paths (``model.layers.0.self_attn.q_proj``), every quantized Linear has its own ``quantize``
node ``<module>:quantize`` feeding port ``x`` of its GEMM node ``<module>:fprop``, whose port ``w``
is fed by the weight (source ``param:<module>.weight``). Node ids are `node_id(module, kind, role)`.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from jetrl.recipe import QuantSpec

__all__ = [
    "OpKind",
    "Precision",
    "Node",
    "Edge",
    "Graph",
    "GraphError",
    "node_id",
    "BF16",
    "FP32",
    "FP8",
    "GEMM_KINDS",
    "linear_site",
    "iter_linear_sites",
]

FP8 = "float8_e4m3fn"


class GraphError(ValueError):
    """An inconsistent precision graph (unknown node, duplicate id, a label that contradicts itself)."""


class OpKind(enum.StrEnum):
    EMBEDDING = "embedding"
    NORM = "norm"
    NORM_QUANT = "norm+quantize"
    """A fused norm whose output is also quantized (``jetrl::rmsnorm_quant``); normalized away."""
    QUANTIZE = "quantize"
    GEMM = "gemm"
    """A Linear's matmul; ``role`` is fprop / dgrad / wgrad."""
    ACTIVATION = "activation"
    ACTIVATION_QUANT = "activation+quantize"
    """A fused activation whose output is also quantized (``jetrl::swiglu_quant``); normalized away."""
    ATTENTION = "attention"
    LM_HEAD = "lm_head"
    """The output projection to the vocabulary (a GEMM with its own kind: it stays BF16 by default)."""


GEMM_KINDS = (OpKind.GEMM, OpKind.LM_HEAD)


def node_id(module: str, kind: OpKind | str, role: str | None = None) -> str:
    """Canonical node id: ``"<module>:<kind>"`` or, for GEMMs, ``"<module>:<role>"``."""
    kind = OpKind(kind)
    if kind in GEMM_KINDS:
        if role is None:
            raise GraphError(f"node_id({module!r}, {kind.value}): a GEMM node needs a role (fprop/dgrad/wgrad)")
        return f"{module}:{role}"
    return f"{module}:{kind.value}"


@dataclass(frozen=True)
class Precision:
    """The precision label of one tensor (an edge)."""

    dtype: str
    """Element dtype, as torch names it without the prefix: bfloat16, float32, float8_e4m3fn."""
    spec: QuantSpec | None = None
    """The quantization that produced fp8 bytes; None for unquantized tensors."""
    producer: str = ""
    """Implementation that wrote the tensor (report only, not compared)."""
    when: str = ""
    """Regime the label holds in ("" = always, e.g. "M<32" for a small-batch-only quantizer)."""

    def __post_init__(self) -> None:
        if self.dtype.startswith("torch."):
            object.__setattr__(self, "dtype", self.dtype[len("torch.") :])
        if self.spec is not None and self.dtype != self.spec.dtype:
            raise GraphError(f"Precision: dtype {self.dtype!r} but QuantSpec.dtype {self.spec.dtype!r}")
        if self.spec is None and self.dtype == FP8:
            raise GraphError("Precision: an fp8 tensor needs the QuantSpec that produced it")

    @property
    def quantized(self) -> bool:
        return self.spec is not None

    def same_values(self, other: Precision) -> bool:
        """True if both labels describe the same bytes for the same input (producer is not compared:
        two implementations of one spec are bit-identical by the project's kernel tests; ``when`` only says
        where the label applies)."""
        return self.dtype == other.dtype and self.spec == other.spec

    def label(self) -> str:
        base = self.spec.label() if self.spec is not None else self.dtype
        return f"{base} when {self.when}" if self.when else base

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"dtype": self.dtype, "label": self.label()}
        if self.spec is not None:
            d["spec"] = {
                "granularity": self.spec.granularity.value,
                "scale_format": self.spec.scale_format.value,
                "eps": self.spec.eps,
                "division": self.spec.division.value,
                "scale_dtype": self.spec.scale_dtype,
            }
        if self.producer:
            d["producer"] = self.producer
        if self.when:
            d["when"] = self.when
        return d


BF16 = Precision("bfloat16")
FP32 = Precision("float32")


@dataclass(frozen=True)
class Node:
    """One op. ``attrs`` holds facts the normalization needs (shapes, fused parts, TP sharding)."""

    id: str
    kind: OpKind
    module: str
    role: str | None = None
    attrs: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", OpKind(self.kind))
        if self.kind in GEMM_KINDS and self.role not in ("fprop", "dgrad", "wgrad"):
            raise GraphError(f"node {self.id!r}: GEMM role {self.role!r} is not fprop/dgrad/wgrad")

    def attr(self, key: str, default: Any = None) -> Any:
        for k, v in self.attrs:
            if k == key:
                return v
        return default

    def with_attrs(self, **changes: Any) -> Node:
        """A copy with attributes set (None removes one)."""
        d = dict(self.attrs)
        for k, v in changes.items():
            if v is None:
                d.pop(k, None)
            else:
                d[k] = v
        return Node(self.id, self.kind, self.module, self.role, tuple(sorted(d.items())))


@dataclass(frozen=True)
class Edge:
    """A tensor from ``src`` (a node id, or ``param:<name>`` / ``input``) into port ``port`` of ``dst``."""

    src: str
    dst: str
    port: str
    precision: Precision
    origin: str = ""
    """The setting that decided this label (``env:NAME=value``, ``recipe:<field>``, ...)."""


@dataclass
class Graph:
    """One side's precision graph. ``meta`` records how it was built (engine, recipe, env, probe)."""

    side: str
    """"training" or "rollout"."""
    source: str
    """How the graph was obtained, one line (shown in reports)."""
    nodes: dict[str, Node] = field(default_factory=dict)
    edges: list[Edge] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.side not in ("training", "rollout"):
            raise GraphError(f"Graph.side={self.side!r}: choose 'training' or 'rollout'")

    # -- construction ------------------------------------------------------------------------
    def add_node(self, kind: OpKind | str, module: str, role: str | None = None, **attrs: Any) -> Node:
        nid = node_id(module, kind, role)
        if nid in self.nodes:
            raise GraphError(f"{self.side} graph: duplicate node {nid!r}")
        node = Node(nid, OpKind(kind), module, role, tuple(sorted(attrs.items())))
        self.nodes[nid] = node
        return node

    def replace_node(self, node: Node) -> None:
        if node.id not in self.nodes:
            raise GraphError(f"{self.side} graph: no node {node.id!r} to replace")
        self.nodes[node.id] = node

    def add_edge(self, src: str, dst: str, port: str, precision: Precision, origin: str = "") -> Edge:
        if dst not in self.nodes:
            raise GraphError(f"{self.side} graph: edge into unknown node {dst!r}")
        if not (src in self.nodes or src.startswith(("param:", "input"))):
            raise GraphError(f"{self.side} graph: edge from unknown node {src!r} into {dst!r}")
        if any(e.dst == dst and e.port == port for e in self.edges):
            raise GraphError(f"{self.side} graph: port {port!r} of {dst!r} already has an input")
        edge = Edge(src, dst, port, precision, origin)
        self.edges.append(edge)
        return edge

    def remove_node(self, nid: str) -> None:
        """Remove a node and every edge touching it."""
        self.nodes.pop(nid)
        self.edges = [e for e in self.edges if e.src != nid and e.dst != nid]

    # -- queries -----------------------------------------------------------------------------
    def inputs(self, nid: str) -> dict[str, Edge]:
        """Port -> edge for the inputs of node `nid`."""
        return {e.port: e for e in self.edges if e.dst == nid}

    def outputs(self, nid: str) -> list[Edge]:
        return [e for e in self.edges if e.src == nid]

    def of_kind(self, *kinds: OpKind) -> Iterator[Node]:
        return (n for n in self.nodes.values() if n.kind in kinds)

    def modules(self) -> set[str]:
        return {n.module for n in self.nodes.values()}

    def copy(self) -> Graph:
        return Graph(self.side, self.source, dict(self.nodes), list(self.edges), dict(self.meta))

    # -- views -------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "side": self.side,
            "source": self.source,
            "meta": _jsonable(self.meta),
            "nodes": [
                {
                    "id": n.id,
                    "kind": n.kind.value,
                    "module": n.module,
                    "role": n.role,
                    "attrs": _jsonable(dict(n.attrs)),
                }
                for n in self.nodes.values()
            ],
            "edges": [
                {"src": e.src, "dst": e.dst, "port": e.port, "precision": e.precision.to_dict(), "origin": e.origin}
                for e in self.edges
            ],
        }

    def summary(self) -> str:
        """One line per node: id and the labels of its inputs (for debugging and `--json`-less output)."""
        lines = [f"{self.side} graph ({self.source}): {len(self.nodes)} nodes, {len(self.edges)} edges"]
        for nid, node in self.nodes.items():
            ins = ", ".join(f"{p}={e.precision.label()}" for p, e in sorted(self.inputs(nid).items()))
            lines.append(f"  {nid:<52} {node.kind.value:<20} {ins}")
        return "\n".join(lines)


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, str | int | float | bool) or obj is None:
        return obj
    try:
        json.dumps(obj)
        return obj
    except TypeError:
        return str(obj)


def linear_site(
    graph: Graph,
    module: str,
    *,
    x: Precision,
    w: Precision,
    x_src: str = "input",
    kind: OpKind = OpKind.GEMM,
    x_origin: str = "",
    w_origin: str = "",
    **attrs: Any,
) -> Node:
    """Add one Linear in canonical form: ``[quantize ->] fprop`` with the weight on port ``w``.

    If `x` is quantized a ``<module>:quantize`` node takes the bf16 input (from `x_src`) and feeds
    the GEMM's port ``x``; otherwise the input goes straight to the GEMM. Returns the GEMM node."""
    gemm = graph.add_node(kind, module, "fprop", **attrs)
    if x.quantized:
        qn = graph.add_node(OpKind.QUANTIZE, module)
        graph.add_edge(x_src, qn.id, "x", BF16)
        graph.add_edge(qn.id, gemm.id, "x", x, x_origin)
    else:
        graph.add_edge(x_src, gemm.id, "x", x, x_origin)
    graph.add_edge(f"param:{module}.weight", gemm.id, "w", w, w_origin)
    return gemm


def iter_linear_sites(graph: Graph) -> Iterable[Node]:
    """GEMM and lm_head fprop nodes, in insertion order."""
    return (n for n in graph.nodes.values() if n.kind in GEMM_KINDS and n.role == "fprop")
