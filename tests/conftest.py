"""Suite-wide guard: on CI, optional-looking dependencies are required.

Several modules skip when vLLM or transformers cannot be imported (so the suite collects on a bare
machine). On CI (``CI`` set, as `.ci/run` runs) such a skip would hide a broken install, so a missing
dependency fails the session at once instead.
"""

from __future__ import annotations

import importlib
import importlib.util
import os

import pytest

from jetrl.testing.engines import shared_gpu_engine_kwargs

REQUIRED_ON_CI = ("vllm", "transformers", "triton", "ml_dtypes", "verl")
"""On CI a skip for any of these fails the session (``verl``: tests/verl_integration, installed by `make venv`)."""


def pytest_sessionstart(session):
    if not os.environ.get("CI"):
        return
    broken: list[str] = []
    for name in REQUIRED_ON_CI:
        try:
            mod = importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - any import failure is the finding
            broken.append(f"{name}: {type(e).__name__}: {e}")
            continue
        if getattr(mod, "__file__", None) is None:  # a namespace package: some folder named like it, not the package
            broken.append(f"{name}: only a namespace package ({list(mod.__path__)}), not the installed package")
    if broken:
        raise pytest.UsageError("CI must run every CPU test, but these cannot be imported: " + "; ".join(broken))


@pytest.fixture(scope="session", autouse=True)
def _vllm_engines_share_the_gpu():
    import torch

    if not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None:
        yield
        return
    import vllm

    class SharedGpuLLM(vllm.LLM):
        def __init__(self, *args, **kw):
            super().__init__(*args, **shared_gpu_engine_kwargs(kw))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(vllm, "LLM", SharedGpuLLM)  # `create_engine` imports it at call time
        yield
