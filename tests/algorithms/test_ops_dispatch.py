"""Where `rlhfuse.algorithms.ops` runs a kernel: `backend="auto"` takes the Triton kernel only for CUDA tensors,
so `make train` / `make bench` on a CPU, where TRITON_INTERPRET is not set, run the PyTorch references — for CPU
tensors and for a non-CUDA accelerator's (the stand-in device) alike."""

import pytest
import torch

from rlhfuse.algorithms import ops
from rlhfuse.algorithms.gae import compute_gae_scan
from rlhfuse.algorithms.logits import chosen_logprobs_torch
from rlhfuse.testing.standin import standin_device


@pytest.fixture
def no_interpreter(monkeypatch):
    """The environment of `make train` on a CPU: no TRITON_INTERPRET, no forcing; kernel loads recorded."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("RLHFUSE_FORCE_TRITON", raising=False)
    loaded: list[str] = []
    real = ops.load_kernel_module
    monkeypatch.setattr(ops, "load_kernel_module", lambda name: loaded.append(name) or real(name))
    return loaded


@pytest.mark.parametrize("device", ["cpu", standin_device()], ids=["cpu", "standin"])
def test_auto_runs_the_references_off_cuda_without_the_interpreter(no_interpreter, device) -> None:
    torch.manual_seed(0)
    rewards_BT, values_BT = torch.randn(2, 5, device=device), torch.randn(2, 5, device=device)
    mask_BT = torch.ones(2, 5, device=device)
    logits_NV, labels_N = torch.randn(6, 11, device=device), torch.randint(11, (6,), device=device)
    assert not ops._use_triton(None, rewards_BT, values_BT, mask_BT)
    advantages_BT, returns_BT = ops.gae(rewards_BT, values_BT, mask_BT, 0.9, 0.95)
    expected = compute_gae_scan(rewards_BT, values_BT, mask_BT, 0.9, 0.95)
    assert torch.equal(advantages_BT.cpu(), expected[0].cpu()) and torch.equal(
        returns_BT.cpu(), expected[1].cpu()
    )
    torch.testing.assert_close(
        ops.chosen_logprobs(logits_NV, labels_N), chosen_logprobs_torch(logits_NV, labels_N)
    )
    assert no_interpreter == []  # no kernel module was loaded, so triton was never needed


def test_forcing_the_kernels_on_cpu_without_the_interpreter_names_the_fix(no_interpreter) -> None:
    zeros_BT = torch.zeros(1, 2)
    with pytest.raises(RuntimeError, match=r"needs TRITON_INTERPRET=1 .*or use backend='torch'"):
        ops.gae(zeros_BT, zeros_BT, zeros_BT, 0.9, 0.9, backend="triton")
