"""The `deepgemm` backend: DeepGEMM's ``fp8_gemm_nt`` (sm_90, JIT-compiled per shape).

Calls (``../shared/NUMERICS.md`` section 4), all NT, both operands K-major:

- fprop / dgrad: ``fp8_gemm_nt((A, sA), (B, sB), D bf16)``, sA 1x128 ``[M, K/128]``, sB 128x128.
- wgrad: ``fp8_gemm_nt((dY^T, s), (X^T, s), d=dW, c=dW, recipe=(1, 1, 128))``: both operands 1x128
  along the token axis, fp32 accumulation in place (`gemm_accumulate_` passes ``d = c = acc``).

Activation scales are passed MN-major with strides ``(1, align(rows, 4))`` (`scale_layout =
"deepgemm"`); DeepGEMM would otherwise transpose them itself at extra cost. The token axis of wgrad
(its K) is zero-padded to a multiple of 128 when needed. The module is imported from ``deep_gemm``,
else from ``vllm.third_party.deep_gemm`` (the copy bundled in vLLM wheels).

DeepGEMM compiles the dimensions named by ``compiled_dims`` (its default ``"nk"``) into each kernel. For fprop
and dgrad those are the Linear's fixed features; for wgrad K is the token count (padded to 128), so with ``"nk"``
every new count compiled a new kernel with nvcc (2.3-3.4 s each on an H100, `deepgemm-jit-nvidia-h100.json`:
12 of 12 counts for qkv and down_proj), inside training steps whose packed micro-batches change the count
almost every time. wgrad therefore passes ``compiled_dims="mn"`` (`DeepGemmBackend.wgrad_compiled_dims`): the
count is a runtime argument, one kernel per Linear shape, the same bits at all 12 counts measured and the same
speed (steady sum over the four Llama-8B Linears 52.6 vs 53.0 ms).
"""

from __future__ import annotations

import importlib
import os
import shutil

import torch

from jetrl.gemm.base import BackendUnavailableError, GemmBackend, empty_result, pad_k, to_scale_layout
from jetrl.quant import FP8_DTYPE, ceil_div
from jetrl.recipe import BLOCK

_MODULES = ("deep_gemm", "vllm.third_party.deep_gemm")


def warmup_rows(max_rows: int) -> list[int]:
    """The row counts `DeepGemmBackend.warm_up` runs: every ``m <= 16`` and both ends of every 16-row interval
    (``m % 16`` in 0, 1) up to `max_rows`, and `max_rows`. DeepGEMM picks its kernel (block sizes, multicast,
    stages) per call from ``m`` and JIT-compiles each new pick; its block sizes are multiples of 16, so a pick
    can change inside a 16-row interval only at a threshold, and one sample on each side of it sees both."""
    if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1:
        raise ValueError(f"deepgemm warm-up: max_rows must be a positive int, got {max_rows!r}")
    return [m for m in range(1, max_rows + 1) if m <= 16 or m % 16 in (0, 1) or m == max_rows]


def import_deep_gemm():
    """The DeepGEMM module, or `BackendUnavailableError` listing why each candidate failed."""
    errors = []
    for mod in _MODULES:
        try:
            dg = importlib.import_module(mod)
        except Exception as e:  # ImportError, or OSError from a .so built for another torch/CUDA
            errors.append(f"import {mod}: {type(e).__name__}: {e}")
            continue
        if not hasattr(dg, "fp8_gemm_nt"):
            errors.append(f"{mod} has no fp8_gemm_nt (DeepGEMM built without CUDA >= 12.1 kernels?)")
            continue
        return dg
    raise BackendUnavailableError("DeepGEMM is not importable: " + "; ".join(errors))


class DeepGemmBackend(GemmBackend):
    name = "deepgemm"
    needs_block_multiples = True
    compiles_per_shape = True
    scale_layout = "deepgemm"
    device_type = "cuda"
    wgrad_compiled_dims = "mn"
    """DeepGEMM's ``compiled_dims`` for wgrad: ``"mn"`` (the token count a runtime argument) or ``"nk"`` (DeepGEMM's
    default: a kernel compiled per token count; kept for `scripts/bench_deepgemm_jit.py`'s comparison)."""

    def __init__(self) -> None:
        reason = self.unavailable_reason()
        if reason:
            raise BackendUnavailableError(f"GEMM backend 'deepgemm' unavailable: {reason}")
        # DeepGEMM JIT-compiles with nvcc found through CUDA_HOME; point it at the nvcc on PATH when
        # CUDA_HOME is unset (done here, at first use, not at import).
        nvcc = shutil.which("nvcc")
        if "CUDA_HOME" not in os.environ and nvcc:
            os.environ["CUDA_HOME"] = os.path.dirname(os.path.dirname(nvcc))
        self.dg = import_deep_gemm()
        self.version = getattr(self.dg, "__version__", "unknown")

    @staticmethod
    def unavailable_reason() -> str | None:
        if not torch.cuda.is_available():
            return "no CUDA device (DeepGEMM needs an sm_90 GPU)"
        major, minor = torch.cuda.get_device_capability()
        if major != 9:
            return f"DeepGEMM FP8 with fp32 scales targets sm_90; this GPU is sm_{major}{minor}"
        try:
            import_deep_gemm()
        except BackendUnavailableError as e:
            return str(e)
        if not (os.environ.get("CUDA_HOME") or shutil.which("nvcc")):
            return "DeepGEMM JIT-compiles its kernels with nvcc: set CUDA_HOME or put nvcc on PATH"
        return None

    def _wgrad_kw(self) -> dict:
        """``recipe`` and ``compiled_dims`` of a wgrad call."""
        dims = self.wgrad_compiled_dims
        if dims not in ("nk", "mn"):
            raise ValueError(f"deepgemm: wgrad_compiled_dims must be 'nk' or 'mn', got {dims!r}")
        return {"recipe": (1, 1, 128), "compiled_dims": dims}

    def _gemm(self, a, a_s, b, b_s, *, role, out_dtype, c):
        m, n = a.shape[0], b.shape[0]
        if m == 0 or n == 0 or a.shape[1] == 0:
            return empty_result(m, n, out_dtype, c, a.device)
        a, b = pad_k(a), pad_k(b)
        sa = to_scale_layout(a_s, "deepgemm")
        if role == "wgrad":
            # the (1, 1, 128) kernel only exists as an accumulate (it asserts c is given): D = D + A @ B.T
            d = c.clone() if c is not None else torch.zeros((m, n), dtype=torch.float32, device=a.device)
            # Shapes: [N, T] @ [K, T]^T -> [N, K], fp32
            self.dg.fp8_gemm_nt((a, sa), (b, to_scale_layout(b_s, "deepgemm")), d, c=d, **self._wgrad_kw())
            return d if out_dtype == torch.float32 else d.to(out_dtype)
        d = torch.empty((m, n), dtype=torch.float32 if c is not None else out_dtype, device=a.device)
        # Shapes: [M, K] @ [N, K]^T -> [M, N]
        self.dg.fp8_gemm_nt((a, sa), (b, b_s.contiguous()), d, c=c)
        return d if d.dtype == out_dtype else d.to(out_dtype)

    def warm_up(self, n: int, k: int, max_rows: int, device: torch.device | str) -> int:
        """Run the fprop GEMM on zeros at every `warmup_rows` count, so DeepGEMM JIT-compiles every kernel an
        ``m <= max_rows`` can pick now, not in the middle of a decode (in vLLM's worker, capturing the nine
        piecewise CUDA-graph sizes took 66-68 s without it, 4-6 s with it; the compiles move to load: engine start
        on cold caches 202 -> 364 s on the H200, `rollout-mp-warmup-*.json`). DeepGEMM caches what it compiled,
        in the process and on disk (``DG_JIT_CACHE_DIR``)."""
        rows = warmup_rows(max_rows)
        a = torch.zeros((max_rows, k), dtype=FP8_DTYPE, device=device)
        a_s = torch.ones((max_rows, ceil_div(k, BLOCK)), dtype=torch.float32, device=device)
        b = torch.zeros((n, k), dtype=FP8_DTYPE, device=device)
        b_s = torch.ones((ceil_div(n, BLOCK), ceil_div(k, BLOCK)), dtype=torch.float32, device=device)
        for m in rows:
            self.gemm(a[:m], a_s[:m], b, b_s, role="fprop", out_dtype=torch.bfloat16)
        torch.cuda.synchronize(device)
        return len(rows)

    def gemm_accumulate_(self, a, a_s, b, b_s, acc):
        self._validate(a, a_s, b, b_s, "wgrad", acc)
        if a.shape[0] == 0 or b.shape[0] == 0 or a.shape[1] == 0:
            return acc
        if not acc.is_contiguous():
            raise ValueError(f"deepgemm[wgrad]: the fp32 accumulator must be contiguous, got strides {acc.stride()}")
        a, b = pad_k(a), pad_k(b)
        # Shapes: [N, T] @ [K, T]^T -> [N, K]; acc = acc + A @ B.T in place (d = c = acc)
        self.dg.fp8_gemm_nt(
            (a, to_scale_layout(a_s, "deepgemm")),
            (b, to_scale_layout(b_s, "deepgemm")),
            acc,
            c=acc,
            **self._wgrad_kw(),
        )
        return acc
