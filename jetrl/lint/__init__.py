"""The precision-graph lint: prove the rollout graph is a subgraph of the training forward graph.

Jet-RL's invariant G_rollout ⊆ G_train_fwd, checked on real graphs: the training forward captured
from a jetrl-converted model (`builders.capture_training`), the rollout captured in a live vLLM
engine running ``jetrl_fp8`` (`builders.capture_jetrl_vllm`) or derived from stock vLLM's settings
(`stock_vllm`), both normalized (`normalize`) and compared edge by edge (`check`), optionally
numerically (`numeric`). Entry points: `lint(...)` and ``jetrl lint`` (`jetrl.lint.cli:main`).
"""

from jetrl.lint.api import ROLLOUTS, LintEnvError, lint
from jetrl.lint.ir import Edge, Graph, Node, OpKind, Precision
from jetrl.lint.report import Finding, LintReport, Severity
from jetrl.lint.stock_vllm import StockConfigError, StockVllmSettings

__all__ = [
    "lint",
    "ROLLOUTS",
    "LintEnvError",
    "LintReport",
    "Finding",
    "Severity",
    "Graph",
    "Node",
    "Edge",
    "OpKind",
    "Precision",
    "StockVllmSettings",
    "StockConfigError",
]
