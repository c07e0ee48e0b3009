"""jetrl.kernels.digest (the weight-sync digest) against its torch reference, bit for bit.

CPU: the Triton kernel under the interpreter (subprocess) on word counts around the block size,
with extreme words (the products and sums wrap mod 2^64). GPU (sm_90): the compiled kernel against
the reference on the CPU, and `tensor_digest` of CUDA tensors equal to that of their CPU copies
(what lets the trainer and engine sides be compared wherever each lives).
"""

from __future__ import annotations

import pytest
import torch
from kernels_cases import run_interpreted

from jetrl.kernels.digest import launch_digest, torch_digest
from jetrl.rollout.sync import DIGEST_K, tensor_digest, tensor_digests
from jetrl.testing.numerics import has_sm90

SIZES = [1, 7, 256, 257, 1000]


def _words(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(-(2**63), 2**63 - 1, (n,), dtype=torch.int64, generator=g)
    w[0] = -(2**63)  # extremes: the products overflow and must wrap
    if n > 1:
        w[-1] = 2**63 - 1
    return w


@pytest.fixture(scope="module")
def interp_results():
    calls = [("digest", "launch_digest", (_words(n, n), DIGEST_K), {"block": 256, "num_warps": 4}) for n in SIZES]
    return run_interpreted(calls)


@pytest.mark.parametrize("case", range(len(SIZES)), ids=[f"n{n}" for n in SIZES])
def test_interpreter_matches_reference(interp_results, case):
    r = interp_results[case]
    words, k = r["args"]
    assert torch.equal(r["out"], torch_digest(words, k)), SIZES[case]


def test_reference_chunking_does_not_change_the_digest():
    w = _words(1000, 1)
    assert torch.equal(torch_digest(w, DIGEST_K, chunk=64), torch_digest(w, DIGEST_K))


def test_empty():
    assert torch.equal(launch_digest(torch.empty(0, dtype=torch.int64), DIGEST_K), torch.zeros(2, dtype=torch.int64))


gpu = pytest.mark.skipif(not has_sm90(), reason="needs an sm_90 GPU to run the compiled Triton kernel")


@gpu
@pytest.mark.parametrize("n", [1, 7, 4096, 4097, 3 * 4096 + 5, 1 << 22])
def test_gpu_kernel_matches_reference(n):
    w = _words(n, n)
    assert torch.equal(launch_digest(w.cuda(), DIGEST_K).cpu(), torch_digest(w, DIGEST_K)), n


@gpu
def test_gpu_tensor_digests_equal_cpu():
    g = torch.Generator().manual_seed(0)
    tensors = {
        "fp8": torch.randn(384, 256, generator=g).to(torch.float8_e4m3fn),
        "scales": torch.rand(3, 2, generator=g),
        "odd bf16": torch.randn(7, generator=g).to(torch.bfloat16),  # 14 bytes: zero-padded to 16
        "big": torch.randn(4096, 4096, generator=g).to(torch.bfloat16),
    }
    cpu = {k: tensor_digest(t) for k, t in tensors.items()}
    assert tensor_digests({k: t.cuda() for k, t in tensors.items()}) == cpu
    assert tensor_digest(tensors["big"].cuda()[1:]) != cpu["big"]
