"""Optional metric sinks beside ``metrics.jsonl``: TensorBoard and Weights & Biases (``run.loggers``).

Neither package is a dependency of jetrl: asking for a logger whose package is missing is a
`ConfigError` naming the package, raised before the run directory is written. Each step's row goes to
every sink; a key that means what one of verl's metrics means is logged under verl's name
(`VERL_NAMES`, so dashboards of verl runs and jetrl runs line up), every other key under its jetrl
name. ``metrics.jsonl`` always keeps the jetrl names.
"""

from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path
from typing import Any

from .config import LOGGERS, ConfigError, TrainConfig

__all__ = ["LOGGERS", "VERL_NAMES", "check_loggers", "open_loggers", "verl_name"]


VERL_NAMES = {
    "reward/mean": "critic/score/mean",
    "response/length_mean": "response_length/mean",
    "response/length_max": "response_length/max",
    "response/clip_ratio": "response_length/clip_ratio",
    "actor/entropy": "actor/entropy",
    "actor/pg_loss": "actor/pg_loss",
    "actor/clip_frac": "actor/pg_clipfrac",
    "actor/approx_kl": "actor/ppo_kl",
    "actor/kl_ref": "actor/kl_loss",
    "actor/grad_norm": "actor/grad_norm",
    "actor/lr": "actor/lr",
    "time/rollout_s": "timing_s/gen",
    "time/step_s": "timing_s/step",
}
"""jetrl metric -> verl's metric of the same meaning (verl's ``compute_data_metrics``, actor and timing
metrics). jetrl's own keys without a verl counterpart (mismatch/*, sync/*, batch/*) keep their names."""


def verl_name(key: str) -> str:
    return VERL_NAMES.get(key, key)


def check_loggers(cfg: TrainConfig) -> None:
    """`ConfigError` naming the missing package of a requested logger."""
    for name in cfg.run.loggers:
        pkg = LOGGERS[name]
        if importlib.util.find_spec(pkg) is None:
            raise ConfigError(
                f"run.loggers: {name!r} needs the {pkg} package, which is not installed (pip install {pkg}, "
                f"or drop {name!r} from run.loggers)"
            )


class _TensorBoard:
    def __init__(self, run_dir: Path, cfg: TrainConfig):
        from torch.utils.tensorboard import SummaryWriter

        self.w = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, row: dict[str, Any], step: int) -> None:
        for k, v in row.items():
            self.w.add_scalar(verl_name(k), v, global_step=step)
        self.w.flush()

    def close(self) -> None:
        self.w.close()


class _Wandb:
    def __init__(self, run_dir: Path, cfg: TrainConfig):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "jetrl"),
            name=cfg.run.name,
            dir=str(run_dir),
            config=cfg.to_dict(),
            resume="allow",
        )

    def log(self, row: dict[str, Any], step: int) -> None:
        self.run.log({verl_name(k): v for k, v in row.items()}, step=step)

    def close(self) -> None:
        self.run.finish()


_CLASSES = {"tensorboard": _TensorBoard, "wandb": _Wandb}


class Loggers:
    """The configured sinks; `log(row)` sends the row's finite numbers (not the step itself) to each."""

    def __init__(self, sinks: list[Any]):
        self.sinks = sinks

    def log(self, row: dict[str, Any]) -> None:
        if not self.sinks:
            return
        step = int(row["step"])
        nums = {
            k: float(v)
            for k, v in row.items()
            if k != "step" and isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
        }
        for s in self.sinks:
            s.log(nums, step)

    def close(self) -> None:
        for s in self.sinks:
            s.close()
        self.sinks = []


def open_loggers(cfg: TrainConfig, run_dir: Path) -> Loggers:
    check_loggers(cfg)
    return Loggers([_CLASSES[name](run_dir, cfg) for name in cfg.run.loggers])
