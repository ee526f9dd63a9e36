"""Parity of the Triton chosen-token log-prob kernel (`kernels/logprobs.py`, interpreter on CPU) with PyTorch.

Legend: N rows, V vocabulary.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from rlhfuse._resources import load_kernel_module
from rlhfuse.algorithms import logprobs_from_logits


@pytest.fixture(scope="module")
def logprobs_kernel():
    return load_kernel_module("logprobs")


def _reference_N(logits_NV: torch.Tensor, labels_N: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.log_softmax(logits_NV.float() / temperature, -1).gather(-1, labels_N[:, None]).squeeze(-1)


@pytest.mark.parametrize(
    ("V", "block_v", "temperature"),
    [
        (37, 8, 1.0),  # several vocabulary blocks and a partial tail block
        (5, 1024, 1.0),  # the whole vocabulary inside one (clamped) block
        (64, 16, 0.6),  # temperature scaling
    ],
)
def test_values_and_gradients_match_log_softmax_gather(logprobs_kernel, V, block_v, temperature):
    generator = torch.Generator().manual_seed(V)
    logits_NV = (3 * torch.randn(6, V, generator=generator)).requires_grad_(True)
    labels_N = torch.randint(0, V, (6,), generator=generator)
    expected_N = _reference_N(logits_NV, labels_N, temperature)
    logprobs_N = logprobs_kernel.chosen_logprobs(
        logits_NV, labels_N, temperature, block_v=block_v, backward_chunk_rows=4
    )
    torch.testing.assert_close(logprobs_N, expected_N, rtol=0, atol=1e-6)
    upstream_N = torch.randn(6, generator=generator)
    (grad,) = torch.autograd.grad(logprobs_N, logits_NV, upstream_N)
    (expected_grad,) = torch.autograd.grad(expected_N, logits_NV, upstream_N)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-6, atol=1e-6)


def test_large_logits_do_not_overflow(logprobs_kernel):
    # A naive Σ exp(x) overflows fp32 at x ≈ 89; the online log-sum-exp must not.
    logits_NV = torch.tensor([[1.0e4, 1.0e4 - 1.0, -1.0e4, 0.0, 1.0e4 - 2.0]])
    labels_N = torch.tensor([1])
    logprobs_N = logprobs_kernel.chosen_logprobs(logits_NV, labels_N, block_v=2)
    torch.testing.assert_close(logprobs_N, _reference_N(logits_NV, labels_N, 1.0))
    assert torch.isfinite(logprobs_N).all()


def test_bf16_and_non_contiguous_logits(logprobs_kernel):
    generator = torch.Generator().manual_seed(7)
    logits_VN = torch.randn(20, 4, generator=generator)
    labels_N = torch.randint(0, 20, (4,), generator=generator)
    logprobs_N = logprobs_kernel.chosen_logprobs(logits_VN.T, labels_N, block_v=8)
    torch.testing.assert_close(logprobs_N, _reference_N(logits_VN.T, labels_N, 1.0), rtol=0, atol=1e-6)
    logits_bf16_NV = logits_VN.T.bfloat16()
    logprobs_bf16_N = logprobs_kernel.chosen_logprobs(logits_bf16_NV, labels_N, block_v=8)
    torch.testing.assert_close(
        logprobs_bf16_N, _reference_N(logits_bf16_NV, labels_N, 1.0), rtol=0, atol=1e-6
    )


def test_logprobs_from_logits_backend_triton_matches_torch():
    generator = torch.Generator().manual_seed(8)
    logits_BTV = torch.randn(2, 3, 11, generator=generator)
    labels_BT = torch.randint(0, 11, (2, 3), generator=generator)
    triton_BT = logprobs_from_logits(logits_BTV, labels_BT, temperature=0.9, backend="triton")
    torch_BT = logprobs_from_logits(logits_BTV, labels_BT, temperature=0.9, backend="torch")
    torch.testing.assert_close(triton_BT, torch_BT, rtol=0, atol=1e-6)


def test_import_rlhfuse_does_not_import_triton():
    # triton takes seconds to import and is absent on macOS/Windows: only a kernel call may import it.
    code = (
        "import sys, torch, rlhfuse, rlhfuse.algorithms.ops\n"
        "from rlhfuse.algorithms import compute_gae, logprobs_from_logits\n"
        "compute_gae(torch.randn(2, 4), torch.randn(2, 4), torch.ones(2, 4), 0.9, 0.9)\n"
        "logprobs_from_logits(torch.randn(2, 4, 5), torch.zeros(2, 4, dtype=torch.long))\n"
        "assert 'triton' not in sys.modules, 'triton was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env={"OMP_NUM_THREADS": "1", "PATH": ""})
