"""run.loggers: TensorBoard and W&B beside metrics.jsonl, under verl's metric names; optional packages."""

from __future__ import annotations

import sys
import types

import pytest

from jetrl.train import loggers as L
from jetrl.train.config import ConfigError, config_from_dict


def _cfg(tmp_path, names):
    return config_from_dict({"run": {"loggers": list(names), "out_dir": str(tmp_path)}})


ROW = {
    "step": 3,
    "reward/mean": 0.5,
    "actor/clip_frac": 0.1,
    "response/length_mean": 4.0,
    "mismatch/logp_abs_diff_mean": 1e-6,
    "actor/entropy": float("nan"),  # not finite: not sent
    "sync/digests_equal": True,  # not a number: not sent
}
WANT = {
    "critic/score/mean": 0.5,
    "actor/pg_clipfrac": 0.1,
    "response_length/mean": 4.0,
    "mismatch/logp_abs_diff_mean": 1e-6,  # no verl counterpart: jetrl's name
}


def test_missing_package_is_a_config_error_naming_it(tmp_path, monkeypatch):
    monkeypatch.setattr(L.importlib.util, "find_spec", lambda name: None)
    for name in ("tensorboard", "wandb"):
        with pytest.raises(ConfigError, match=rf"run.loggers: '{name}' needs the {name} package, which is not"):
            L.check_loggers(_cfg(tmp_path, [name]))
    L.check_loggers(_cfg(tmp_path, []))  # no logger asked: nothing needed


def test_unknown_or_repeated_logger_is_refused():
    with pytest.raises(ConfigError, match="unknown logger 'mlflow'"):
        config_from_dict({"run": {"loggers": ["mlflow"]}})
    with pytest.raises(ConfigError, match="names a logger twice"):
        config_from_dict({"run": {"loggers": ["wandb", "wandb"]}})


def test_wandb_and_tensorboard_get_verl_names(tmp_path, monkeypatch):
    calls: dict[str, list] = {"wandb": [], "tb": []}

    class Run:
        def log(self, data, step):
            calls["wandb"].append((step, data))

        def finish(self):
            calls["wandb"].append("finish")

    fake_wandb = types.ModuleType("wandb")
    fake_wandb.init = lambda **kw: calls["wandb"].append(("init", kw["project"], kw["name"])) or Run()

    class Writer:
        def __init__(self, log_dir):
            calls["tb"].append(("init", log_dir))

        def add_scalar(self, tag, value, global_step):
            calls["tb"].append((global_step, tag, value))

        def flush(self):
            pass

        def close(self):
            calls["tb"].append("close")

    fake_tb = types.ModuleType("torch.utils.tensorboard")
    fake_tb.SummaryWriter = Writer
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake_tb)
    monkeypatch.setattr(L.importlib.util, "find_spec", lambda name: object())
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    cfg = _cfg(tmp_path, ["tensorboard", "wandb"])
    sinks = L.open_loggers(cfg, tmp_path / "run")
    sinks.log(ROW)
    sinks.close()
    assert calls["wandb"] == [("init", "jetrl", "tiny-arith"), (3, WANT), "finish"]
    assert calls["tb"][0] == ("init", str(tmp_path / "run" / "tensorboard"))
    assert {(t, v) for _, t, v in calls["tb"][1:-1]} == set(WANT.items()) and calls["tb"][-1] == "close"
    assert all(s == 3 for s, _, _ in calls["tb"][1:-1])
