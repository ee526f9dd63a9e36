"""Bucketed data-parallel gradient reduction (`rlhfuse.distributed.grad_buckets`): the plan, and on 2 gloo ranks sums
equal to one whole reduction, buckets launched during the last backward, unused parameters summed as zeros."""

import pytest
import torch
from runtime_helpers import run_distributed

from rlhfuse.distributed.grad_buckets import GradReducer, plan_buckets


def test_buckets_follow_gradient_order_cap_and_dtype():
    params = [
        torch.zeros(n, dtype=d)
        for n, d in [
            (4, torch.float32),
            (4, torch.float32),
            (2, torch.float64),
            (100, torch.float32),
            (1, torch.float32),
            (1, torch.float32),
        ]
    ]
    buckets = plan_buckets(params, cap_bytes=32)
    # in the given (gradient) order; a dtype change and the 32-byte cap close a bucket; a larger one is alone
    assert [b.params for b in buckets] == [(0, 1), (2,), (3,), (4, 5)]
    assert [b.offsets for b in buckets] == [(0, 4), (0,), (0,), (0, 1)]
    assert [b.numel for b in buckets] == [8, 2, 100, 2]
    assert buckets[1].dtype == torch.float64
    with pytest.raises(ValueError, match="must be > 0"):
        plan_buckets(params, 0)


class _Net(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.a = torch.nn.Linear(8, 16)
        self.unused = torch.nn.Parameter(torch.ones(3))  # never gets a gradient
        self.b = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _worker(rank: int, world: int) -> None:
    import torch.distributed as dist

    actor, critic = _Net(0).double(), _Net(1).double()
    reference = [_Net(0).double(), _Net(1).double()]
    reducer = GradReducer([actor.parameters(), critic.parameters()], dist.group.WORLD, bucket_mb=300 / 2**20)
    assert len(reducer.buckets) > 4
    for step in range(2):
        xs = [
            torch.randn(
                5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(10 * step + rank + k)
            )
            for k in range(2)
        ]
        for k, x in enumerate(xs):
            if k == len(xs) - 1:
                reducer.arm()
            for model in (actor, critic):
                model(x).pow(2).sum().backward()
        launched = reducer.launched_in_backward
        reducer.finish()
        reducer.wait()
        # the old way: one concatenated sum of every gradient
        for model, ref in zip((actor, critic), reference, strict=True):
            ref.load_state_dict(model.state_dict())
            ref.zero_grad(set_to_none=True)
            for x in xs:
                ref(x).pow(2).sum().backward()
            grads = [p.grad for p in ref.parameters() if p.grad is not None]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)
            want = iter(flat.split([g.numel() for g in grads]))
            for name, p in model.named_parameters():
                if name == "unused":
                    torch.testing.assert_close(p.grad, torch.zeros_like(p))
                else:
                    torch.testing.assert_close(p.grad, next(want).view_as(p), rtol=1e-12, atol=1e-12)
        # the actor's buckets before its unused parameter were launched inside its backward; the rest after
        owner = next(
            b
            for b, bucket in enumerate(reducer.buckets)
            for i in bucket.params
            if reducer.params[i] is actor.unused
        )
        assert launched == owner, (launched, owner)
        with torch.no_grad():
            for model in (actor, critic):
                for p in model.parameters():
                    p -= 0.1 * p.grad
                model.zero_grad(set_to_none=True)


@pytest.mark.timeout(120)
def test_two_ranks_sum_buckets_like_one_reduction_and_launch_them_in_backward():
    run_distributed(_worker, 2, timeout=100)
