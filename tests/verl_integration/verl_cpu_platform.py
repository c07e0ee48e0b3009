"""A CPU platform for verl 0.9.1, for the CPU tests only.

verl 0.9.1 ships CUDA / NPU / ROCm platforms and falls back to ``nvidia`` (``torch.cuda``) when no
accelerator is found, so its FSDP engine cannot run on a CPU-only machine. verl's platform plugin API
(`verl.plugin.platform.PlatformRegistry`, selected by ``VERL_PLATFORM``) is the documented way to add a
device; this registers one named ``jetrl_cpu_test`` whose device is ``cpu`` (gloo, no IPC). It is used
only by `tests/verl_integration` to run the real engine code on CPU.
"""

from __future__ import annotations

import contextlib
import os
import types

import torch
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry, set_platform

NAME = "jetrl_cpu_test"


class _CPUDeviceModule(types.ModuleType):
    """``torch.cpu`` plus the few ``torch.cuda``-style calls verl makes on its device module (memory
    statistics, ``empty_cache``), which do nothing or report 0 on a CPU, and the RNG state calls of its
    checkpoint manager (the device's generator is torch's CPU generator)."""

    def __getattr__(self, name):
        return getattr(torch.cpu, name)

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def memory_allocated(*_a, **_k) -> int:
        return 0

    memory_reserved = max_memory_allocated = max_memory_reserved = memory_allocated

    @staticmethod
    def mem_get_info(*_a, **_k) -> tuple[int, int]:
        return 0, 0

    @staticmethod
    def reset_peak_memory_stats(*_a, **_k) -> None:
        return None

    get_rng_state = staticmethod(torch.get_rng_state)
    set_rng_state = staticmethod(torch.set_rng_state)


DEVICE_MODULE = _CPUDeviceModule("jetrl_cpu_test_device")


class CPUTestPlatform(PlatformBase):
    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self):
        return DEVICE_MODULE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check=False) -> bool:
        return os.environ.get("VERL_PLATFORM", "") == NAME

    def current_device(self):
        return torch.device("cpu")

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index) -> None:
        return None

    def synchronize(self, device_index=None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0):
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "JETRL_CPU_TEST_VISIBLE_DEVICES"

    def nvtx_range(self, msg: str):
        return contextlib.nullcontext()

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self):
        return None


def install() -> None:
    """Register the platform (idempotent) and select it for this process (before verl's first lookup)."""
    if PlatformRegistry.get(NAME) is None:
        PlatformRegistry.register(NAME)(CPUTestPlatform)
    os.environ["VERL_PLATFORM"] = NAME
    set_platform(CPUTestPlatform())
