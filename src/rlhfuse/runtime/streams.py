"""The point-to-point half of running an instruction stream, shared by the training executor
(`rlhfuse.runtime.executor.PipelineExecutor`) and pipeline inference (`rlhfuse.trainer.strategies.pipelines.inference.ForwardExecutor`):
posting, waiting and sending a stream's RECV / SEND instructions, the messages between the sub-stages of a merged
stage, and the inbox of tensors produced or received for a later compute. The interpreters keep only their
compute (forward and backward, forward only).

Messages travel on one process group per model, direction and rank pair (`rlhfuse.runtime.lower.p2p_group_key`),
to the peer `RankGeometry` names (same tp position; a merged stage's messages leave its last sub-stage and enter its
first, in the direction of the message), so every group carries messages one way in the order the lowering proved
NCCL can run (`check_program`, under both of NCCL's stream models: a group of one pair is one stream either way). Sub-stage messages travel on the same groups, on pairs inside one pipeline
rank, in the order both sub-stages run the same stream.

Legend: B batch rows, T tokens, D model width.
"""

from __future__ import annotations

import datetime
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from rlhfuse import distributed
from rlhfuse.pipeline.ir import Kind
from rlhfuse.runtime.layout import RankGeometry
from rlhfuse.runtime.lower import Instr, Message, p2p_group_key


class PipelineError(RuntimeError):
    """A rank failed or timed out while running its stream; the message names the rank and the instruction."""


def wait_for(work: Any, what: str, rank: int, timeout_s: float, device: torch.device | None = None) -> None:
    """Wait for an async point-to-point or collective handle; a failure or timeout is a PipelineError naming
    the rank and the instruction (another rank probably stopped).

    On a CUDA device (NCCL) the wait is stream-ordered: `work.wait()` makes the current stream wait for the op and
    returns at once, so the host queues the rest of the stream ahead (a `wait(timeout=...)` blocks the host until
    the op has finished: a host sync per receive). A hang is then the process group's timeout
    (`distributed.timeout_s`, NCCL's watchdog aborts the communicator). Elsewhere (gloo, the NCCL-ordering
    emulation) the wait is bounded by `timeout_s` and names the instruction."""
    try:
        if device is not None and device.type == "cuda":
            work.wait()
            return
        ok = work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as err:
        raise PipelineError(
            f"rank {rank}: {what} failed or timed out after {timeout_s:.0f}s ({err}); "
            "another rank probably stopped: see its error"
        ) from err
    if ok is False:
        raise PipelineError(f"rank {rank}: {what} timed out after {timeout_s:.0f}s")


ShapeFn = Callable[[Message], tuple[int, ...]]  # message -> the shape of its tensor ([B, T, D])


class StreamComm:
    """One rank's messages while it runs its stream.

    geometry: the rank's place (`ParallelLayout.geometry`); groups: (model, direction, low rank, high rank) ->
    process group (`ProcessGroups.p2p`, `p2p_group_key`; a missing key means the default group); shape_of: a message's tensor shape; dtype,
    device: its buffers'; timeout_s: how long a wait may block before it is a PipelineError naming the
    instruction."""

    def __init__(
        self,
        geometry: RankGeometry,
        groups: Mapping[Any, Any],
        shape_of: ShapeFn,
        *,
        dtype: torch.dtype,
        device: torch.device,
        timeout_s: float,
    ) -> None:
        self.geometry, self.groups, self.shape_of = geometry, dict(groups), shape_of
        self.dtype, self.device, self.timeout_s = dtype, device, timeout_s
        self.rank = geometry.rank
        self.pending: dict[Message, tuple[Tensor, Any]] = {}
        self.inbox: dict[Message, Tensor] = {}
        self.sends: dict[str, list[tuple[Any, Tensor, str]]] = defaultdict(list)
        self.waited = 0.0
        """Seconds spent blocked in waits for messages (not compute)."""

    def _group(self, message: Message, peer: int) -> Any:
        return self.groups.get(p2p_group_key(message, min(self.rank, peer), max(self.rank, peer)))

    def _buffer(self, message: Message) -> Tensor:
        return torch.empty(self.shape_of(message), dtype=self.dtype, device=self.device)

    def wait(self, work: Any, what: str) -> None:
        start = time.perf_counter()
        wait_for(work, what, self.rank, self.timeout_s, self.device)
        self.waited += time.perf_counter() - start

    # --- the stream's RECV / SEND instructions ---------------------------------------------------------------
    def run(self, ins: Instr) -> None:
        """Run a RECV (post or wait) or SEND instruction; a rank of a merged stage that is not the sub-stage
        sending or receiving it skips it."""
        assert ins.message is not None and ins.kind in (Kind.RECV, Kind.SEND)
        message = ins.message
        part, slot = self.geometry.takes_part(ins.kind is Kind.SEND, ins.model, message.grad)
        if not part:
            return
        peer = self.geometry.peer(ins.peer, ins.model, slot)
        if ins.kind is Kind.SEND:
            tensor = self.inbox.pop(message).contiguous()
            self.sends[ins.model].append(
                (distributed.isend(tensor, peer, group=self._group(message, peer)), tensor, str(ins))
            )
        elif ins.post:
            buf = self._buffer(message)
            self.pending[message] = (buf, distributed.irecv(buf, peer, group=self._group(message, peer)))
        else:
            buf, handle = self.pending.pop(message)
            self.wait(handle, str(ins))
            self.inbox[message] = buf

    def put(self, message: Message, tensor: Tensor) -> None:
        """A tensor this rank produced for `message`: sent by a SEND, or consumed here."""
        self.inbox[message] = tensor

    def take(self, message: Message) -> Tensor:
        """The tensor a compute consumes (received, or produced on this rank)."""
        return self.inbox.pop(message)

    # --- between the sub-stages of a merged stage (same pipeline rank) ---------------------------------------
    def receive_sub(self, message: Message, slot: int, what: str) -> Tensor:
        """Blocking receive of `message`'s tensor from sub-stage slot `slot` of this pipeline rank."""
        buf = self._buffer(message)
        peer = self.geometry.peer(self.geometry.pipeline_rank, message.model, slot)
        self.wait(distributed.irecv(buf, peer, group=self._group(message, peer)), f"{what} from rank {peer}")
        return buf

    def send_sub(self, message: Message, tensor: Tensor, slot: int) -> None:
        """Send to sub-stage slot `slot` of this pipeline rank (kept alive until `wait_sends`)."""
        tensor = tensor.contiguous()
        peer = self.geometry.peer(self.geometry.pipeline_rank, message.model, slot)
        work = distributed.isend(tensor, peer, group=self._group(message, peer))
        self.sends[message.model].append((work, tensor, f"sub-stage send of {message} to rank {peer}"))

    # --- completion -------------------------------------------------------------------------------------------
    def wait_sends(self, model: str | None = None) -> None:
        """Wait for the sends of `model` (None: every model)."""
        for name in [model] if model is not None else list(self.sends):
            for work, _, what in self.sends.pop(name, []):
                self.wait(work, what)

    def check_drained(self) -> None:
        """Every posted receive waited for, every message consumed."""
        if self.pending or self.inbox:
            raise PipelineError(
                f"rank {self.rank}: messages left over: posted {list(self.pending)[:4]}, unconsumed "
                f"{list(self.inbox)[:4]}"
            )
