"""Findings and the lint report: one record per violation, rendered as a table or as JSON."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Finding", "LintReport", "Severity", "group_findings"]


class Severity:
    ERROR = "error"
    """Rollout and training forward disagree: the rollout is off-policy. Exit code 1."""
    WARNING = "warning"
    """A difference the recipe tolerates but the user should know about (reported with the reason)."""


@dataclass(frozen=True)
class Finding:
    """One violation of G_rollout ⊆ G_train_fwd (or a warning), with both sides and the fix."""

    severity: str
    code: str
    """Stable short id: precision-mismatch, quantized-one-side, missing-in-training, fused-split,
    tp-shard, norm-quant-fusion, kv-cache-dtype, numeric-* ..."""
    message: str
    rollout_module: str = ""
    training_module: str = ""
    tensor: str = ""
    expected: str = ""
    """The training forward's label (what the rollout must match)."""
    found: str = ""
    """The rollout's label."""
    fix: str = ""
    """The concrete change that removes the finding (env var, recipe field, layer to exclude)."""
    also: tuple[str, ...] = ()
    """Further modules (training names where there is one) with exactly the same finding, grouped to keep
    reports readable."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class LintReport:
    """Everything one lint run established. ``ok`` is False iff there is an error-severity finding."""

    model: str
    recipe: str
    rollout: str
    findings: list[Finding] = field(default_factory=list)
    training_summary: dict[str, Any] = field(default_factory=dict)
    rollout_summary: dict[str, Any] = field(default_factory=dict)
    normalizations: list[str] = field(default_factory=list)
    """The normalization rules applied, each with its validity condition."""
    numeric: dict[str, Any] | None = None
    """Numeric mode results (per-layer table, first divergent layer), None if not run."""
    graphs: dict[str, Any] = field(default_factory=dict)

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == Severity.ERROR]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == Severity.WARNING]

    @property
    def ok(self) -> bool:
        return not self.errors

    def codes(self) -> set[str]:
        return {f.code for f in self.findings}

    def to_dict(self, *, with_graphs: bool = False) -> dict[str, Any]:
        d = {
            "model": self.model,
            "recipe": self.recipe,
            "rollout": self.rollout,
            "ok": self.ok,
            "n_errors": len(self.errors),
            "n_warnings": len(self.warnings),
            "findings": [f.to_dict() for f in self.findings],
            "training": self.training_summary,
            "rollout_graph": self.rollout_summary,
            "normalizations": self.normalizations,
            "numeric": self.numeric,
        }
        if with_graphs:
            d["graphs"] = self.graphs
        return d

    def to_json(self, *, with_graphs: bool = False) -> str:
        return json.dumps(self.to_dict(with_graphs=with_graphs), indent=2, default=str)

    def table(self) -> str:
        """The human-readable report: header, one block per finding, numeric table, verdict."""
        out = [
            f"jetrl lint: model={self.model} recipe={self.recipe} rollout={self.rollout}",
            f"  training: {self.training_summary.get('source', '')} "
            f"({self.training_summary.get('n_nodes', '?')} nodes, "
            f"{self.training_summary.get('n_quantized_linears', '?')} quantized linears)",
            f"  rollout:  {self.rollout_summary.get('source', '')} "
            f"({self.rollout_summary.get('n_nodes', '?')} nodes, "
            f"{self.rollout_summary.get('n_quantized_linears', '?')} quantized linears)",
        ]
        if self.normalizations:
            out.append("  normalized: " + "; ".join(self.normalizations))
        if self.findings:
            w_sev = max(len("SEVERITY"), *(len(f.severity) for f in self.findings))
            w_code = max(len("CODE"), *(len(f.code) for f in self.findings))
            out.append("")
            out.append(f"{'SEVERITY':<{w_sev}}  {'CODE':<{w_code}}  ROLLOUT MODULE -> TRAINING MODULE [TENSOR]")
            for f in self.findings:
                where = f"{f.rollout_module or '-'} -> {f.training_module or '-'}" + (
                    f" [{f.tensor}]" if f.tensor else ""
                )
                out.append(f"{f.severity:<{w_sev}}  {f.code:<{w_code}}  {where}")
                pad = " " * (w_sev + w_code + 4)
                out.append(f"{pad}{f.message}")
                if f.also:
                    more = ", ".join(f.also[:4]) + (f", ... ({len(f.also)} in all)" if len(f.also) > 4 else "")
                    out.append(f"{pad}same in: {more}")
                if f.expected or f.found:
                    out.append(f"{pad}expected (training): {f.expected}")
                    out.append(f"{pad}found (rollout):     {f.found}")
                if f.fix:
                    out.append(f"{pad}fix: {f.fix}")
        if self.numeric is not None:
            out.append("")
            out.extend(_numeric_table(self.numeric))
        out.append("")
        verdict = "CONSISTENT" if self.ok else "VIOLATIONS"
        out.append(f"{verdict}: {len(self.errors)} error(s), {len(self.warnings)} warning(s)")
        return "\n".join(out)


def group_findings(findings: list[Finding]) -> list[Finding]:
    """Merge findings that differ only in their module (same code, tensor, labels, fix up to the module
    name): the first keeps its modules, the others are listed in ``also``."""
    groups: dict[tuple, list[Finding]] = {}
    for f in findings:
        fix = f.fix
        for mod in (f.training_module, f.rollout_module):
            leaf = mod.rsplit(".", 1)[-1]
            fix = fix.replace(mod, "<m>").replace(f"'{leaf}'", "<leaf>") if leaf else fix
        fix = re.sub(r"model\.layers\.\d+\.", "<layer>.", fix)
        key = (f.severity, f.code, f.tensor, f.expected, f.found, fix)
        groups.setdefault(key, []).append(f)
    out = []
    for fs in groups.values():
        first = fs[0]
        if len(fs) == 1:
            out.append(first)
        else:
            out.append(
                Finding(
                    first.severity,
                    first.code,
                    first.message,
                    first.rollout_module,
                    first.training_module,
                    first.tensor,
                    first.expected,
                    first.found,
                    first.fix,
                    tuple(f.training_module or f.rollout_module for f in fs[1:]),
                )
            )
    return out


def _numeric_table(num: dict[str, Any]) -> list[str]:
    lines = [f"numeric mode: {num.get('probe', '')}"]
    lines += [f"  {sentence}" for sentence in num.get("compared", [])]
    rows = num.get("layers", [])
    if rows:
        lines.append(f"  {'LAYER':<40} {'W BYTES':<8} {'X BYTES':<8} {'MAX|dX|':>10} {'MAX|dY|':>10} {'SQNR dB':>8}")
        for r in rows:
            sq = r.get("sqnr_db")
            sq_s = "inf" if sq == float("inf") else (f"{sq:.1f}" if sq is not None else "-")
            mad, dx = r.get("max_abs_diff"), r.get("input_max_abs_diff")
            lines.append(
                f"  {r['module']:<40} {_yn(r.get('weight_bytes_equal')):<8} {_yn(r.get('act_bytes_equal')):<8} "
                f"{(f'{dx:.3e}' if dx is not None else '-'):>10} {(f'{mad:.3e}' if mad is not None else '-'):>10} "
                f"{sq_s:>8}"
            )
    fd = num.get("first_divergence")
    lines.append(f"  first divergence: {fd['module']} ({fd['what']})" if fd else "  first divergence: none")
    if "logits_max_abs_diff" in num:
        lines.append(f"  logits max |diff|: {num['logits_max_abs_diff']:.3e}")
    return lines


def _yn(v: Any) -> str:
    return "-" if v is None else ("equal" if v else "DIFFER")
