"""Helpers of the runtime tests: random valid schedules, a random mini-batch, a gloo process launcher."""

from __future__ import annotations

import os
import random
import tempfile
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from rlhfuse.pipeline import Action, Problem, Schedule
from rlhfuse.pipeline.simulate import all_actions, dependencies
from rlhfuse.testing.data import random_batch as random_batch  # re-exported: the runtime tests import it here
from rlhfuse.testing.processes import gloo_rank


def random_schedule(problem: Problem, seed: int, *, split_backward: bool = False) -> Schedule:
    """A random valid schedule: a random topological order of all F/B (or F/I/W) ops, each appended to its rank.

    Unlike the search's schedules, micro-batches of one stage may run out of order (stage s+1 may take
    micro-batch 3 before 2), which exercises the lowering's channel ordering.
    """
    rng = random.Random(seed)
    placement = {
        (m.name, r, s): row[s]
        for m in problem.models
        for r, row in enumerate(m.placement)
        for s in range(m.stages)
    }
    todo = set(all_actions(problem, split_backward))
    done: set[Action] = set()
    lists: list[list[Action]] = [[] for _ in range(problem.ranks)]
    while todo:
        ready = sorted(a for a in todo if all(d in done for d in dependencies(problem, a)))
        a = rng.choice(ready)
        todo.remove(a)
        done.add(a)
        lists[placement[(a.model, a.replica, a.stage)]].append(a)
    return Schedule.from_lists(lists)


def _entry(rank: int, world: int, init_file: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    with gloo_rank(rank, f"file://{init_file}", world=world, timeout_s=60):
        fn(rank, world, *args)


def run_distributed(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 60.0) -> None:
    """Run fn(rank, world, *args) in `world` gloo processes; raise if any fails or the timeout passes."""
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        ctx = mp.start_processes(
            _entry, args=(world, init_file, fn, args), nprocs=world, join=False, start_method="spawn"
        )
        import time

        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise TimeoutError(f"distributed test did not finish within {timeout}s")
