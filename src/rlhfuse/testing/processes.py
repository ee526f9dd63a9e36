"""Ending a spawned test rank: a rank whose checks all passed leaves through `rlhfuse.distributed.exit_finished`
(past interpreter finalisation, whose race with gloo's worker threads has aborted passing ranks on a loaded
machine); a failing one tears its process group down and raises."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

import torch.distributed as dist

from rlhfuse import distributed


@contextmanager
def finishing_rank() -> Iterator[None]:
    """Around a spawned rank's work, inside its process group: an error tears the group down and propagates (the
    process exits non-zero); success waits for every rank (a barrier) and exits with status 0 (the block never
    returns)."""
    try:
        yield
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_after_success()


def leave_after_success() -> NoReturn:
    """End a spawned rank whose checks all passed: every rank done (a barrier), then exit with status 0."""
    distributed.barrier(distributed.group_device())
    distributed.exit_finished()
