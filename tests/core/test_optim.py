"""`build_optimizer` steps CPU parameters with torch's foreach (multi-tensor) AdamW, which torch picks only for
CUDA parameters by default: the same bits as the per-tensor loop, for fp32 parameters and for bf16 ones through
`MasterWeightAdamW`, over several steps with weight decay and a warmup schedule."""

from __future__ import annotations

import pytest
import torch

from rlhfuse.core.optim import MasterWeightAdamW, build_optimizer
from rlhfuse.core.optim_config import OptimConfig


def _params(dtype: torch.dtype) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(16, 24), (24,), (24, 16), (16,)]
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]


def _train(params: list[torch.nn.Parameter], optim: torch.optim.Optimizer, sched=None) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        optim.step()
        if sched is not None:
            sched.step()
        optim.zero_grad()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_parameters_step_with_foreach_and_the_per_tensor_bits(dtype):
    config = OptimConfig(warmup_steps=2, weight_decay=0.1)
    ours = _params(dtype)
    optim, sched = build_optimizer(ours, 1e-2, config, total_steps=5)
    assert optim.defaults["foreach"] is True
    _train(ours, optim, sched)

    reference = _params(dtype)
    kind = MasterWeightAdamW if dtype == torch.bfloat16 else torch.optim.AdamW
    per_tensor = kind(reference, lr=1e-2, betas=tuple(config.betas), weight_decay=0.1, foreach=False)
    schedule = torch.optim.lr_scheduler.LambdaLR(per_tensor, sched.lr_lambdas[0])
    _train(reference, per_tensor, schedule)
    for a, b in zip(ours, reference, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(ours[0], _params(dtype)[0])  # it trained
