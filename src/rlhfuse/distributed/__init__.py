"""`rlhfuse.distributed`: the one package that calls `torch.distributed` collectives and point-to-point
operations (tests/test_distributed_boundary.py checks that no other module does).

Device rule: every tensor handed to a collective lives on the rank's collective device
(`rank_device`: `cuda:LOCAL_RANK` under NCCL, the CPU under gloo; `group_device` for an existing group). The
helpers take that device explicitly (objects and byte strings travel as uint8 tensors created on it), and
`check_device` refuses a CPU tensor on an NCCL group with a message naming the operation, instead of NCCL's
opaque error.

It sits just above `rlhfuse.core` (it uses the tensor codec `rlhfuse.core.wire`) and below every execution
package.
"""

from rlhfuse.distributed.autograd import copy_to_group, max_over_group, reduce_from_group
from rlhfuse.distributed.collectives import (
    ReduceOp,
    Work,
    all_gather,
    all_gather_bytes,
    all_gather_json,
    all_gather_packed,
    all_reduce,
    barrier,
    broadcast,
    broadcast_bytes,
    broadcast_dataclass,
    broadcast_json,
    broadcast_packed,
    broadcast_tensors,
    check_device,
    irecv,
    isend,
    recv,
    wait_all,
)
from rlhfuse.distributed.device import (
    backend,
    exit_finished,
    global_rank,
    group_device,
    is_initialized,
    launched_local_world,
    launched_world,
    local_rank,
    rank,
    rank_device,
    rank_in,
    shutdown,
    world_size,
)
from rlhfuse.distributed.groups import WorldGroups, cpu_group

__all__ = [
    "ReduceOp",
    "WorldGroups",
    "Work",
    "all_gather",
    "all_gather_bytes",
    "all_gather_json",
    "all_gather_packed",
    "all_reduce",
    "backend",
    "barrier",
    "broadcast",
    "broadcast_bytes",
    "broadcast_dataclass",
    "broadcast_json",
    "broadcast_packed",
    "broadcast_tensors",
    "check_device",
    "copy_to_group",
    "cpu_group",
    "exit_finished",
    "global_rank",
    "group_device",
    "irecv",
    "is_initialized",
    "isend",
    "launched_local_world",
    "launched_world",
    "local_rank",
    "max_over_group",
    "rank_in",
    "rank",
    "rank_device",
    "recv",
    "reduce_from_group",
    "shutdown",
    "wait_all",
    "world_size",
]
