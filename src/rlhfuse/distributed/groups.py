"""The one owner of a run's process groups: `WorldGroups` creates every group (torch's `new_group`) and answers
the sub-groups each component asks for by name, the way torchtitan's `ParallelDims` answers its mesh's
dimensions. Nothing else in rlhfuse calls `torch.distributed.new_group`.

Creating a group is collective over the world: every rank creates every group, in the same order, members or not.
A component asks for its groups under a key that says what they are for (`("pipeline", "p2p", "actor", "act")`,
`("generation", "instances", 2)`, ...) and their ranks, on every rank in the same order; a key asked again over
the same ranks returns the groups made the first time, with no collective, so a component rebuilt in the same process (a second strategy, a test)
reuses its communicators instead of opening more (each NCCL communicator costs device memory). The same ranks
under two keys are two groups: messages on one never match the other's.

`WorldGroups.current()` is this process's owner, made on the first ask after `init_process_group` and made anew
when the world is (a new process group after `destroy_process_group`).
"""

from __future__ import annotations

import datetime
from collections.abc import Hashable, Iterable, Sequence
from typing import Any

import torch.distributed as dist

from rlhfuse.distributed.device import backend, is_initialized, rank


class WorldGroups:
    """Every process group of this process's world, made here once per key."""

    _current: WorldGroups | None = None

    def __init__(self) -> None:
        self._world = dist.group.WORLD if is_initialized() else None
        self._made: dict[tuple[Hashable, tuple[tuple[int, ...], ...]], tuple[Any, ...]] = {}
        self._cpu: dict[int, Any] = {}

    @classmethod
    def current(cls) -> WorldGroups:
        """This process's owner of its world's groups (made anew for a new world)."""
        world = dist.group.WORLD if is_initialized() else None
        if cls._current is None or cls._current._world is not world:
            cls._current = cls()
        return cls._current

    @property
    def world(self) -> Any:
        """The whole world's group (torch's default group; None without a process group)."""
        return self._world

    def _make(
        self,
        key: Hashable,
        rank_lists: Iterable[Iterable[int]],
        *,
        timeout_s: float | None,
        backend_name: str | None,
    ) -> tuple[tuple[tuple[int, ...], ...], Any]:
        lists = tuple(tuple(int(r) for r in ranks) for ranks in rank_lists)
        if (key, lists) not in self._made:
            kwargs: dict[str, Any] = {}
            if timeout_s is not None:
                kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
            if backend_name is not None:
                kwargs["backend"] = backend_name
            self._made[(key, lists)] = tuple(dist.new_group(list(ranks), **kwargs) for ranks in lists)
        return lists, self._made[(key, lists)]

    def group(self, key: Hashable, ranks: Sequence[int], timeout_s: float | None = None) -> Any:
        """Collective over the world: the group of `ranks` known as `key` (torch's non-member marker on a rank
        outside it)."""
        return self._make(key, [ranks], timeout_s=timeout_s, backend_name=None)[1][0]

    def subgroups(
        self, key: Hashable, rank_lists: Iterable[Iterable[int]], timeout_s: float | None = None
    ) -> Any:
        """Collective over the world: one group per list of ranks, all known as `key`; this rank's (None when it
        is in none)."""
        lists, made = self._make(key, rank_lists, timeout_s=timeout_s, backend_name=None)
        return next((g for ranks, g in zip(lists, made, strict=True) if rank() in ranks), None)

    def control(
        self, key: Hashable, rank_lists: Iterable[Iterable[int]], timeout_s: float | None = None
    ) -> Any:
        """Collective over the world: a gloo control group per list of ranks (each made on every rank, as torch
        requires), each its own `cpu`; this rank's (None when it is in none). For control messages among some
        ranks only: `cpu` of a group that some ranks are not in would be made by its members alone."""
        from rlhfuse.distributed import ordering

        lists, made = self._make(("control", key), rank_lists, timeout_s=timeout_s, backend_name="gloo")
        mine = None
        for ranks, group in zip(lists, made, strict=True):
            if rank() in ranks:
                ordering.mark_control(group)
                self._cpu[id(group)] = group
                mine = group
        return mine

    def cpu(self, group: Any = None) -> Any:
        """A gloo control group over the ranks of `group` (the world if None), for small control messages on the
        CPU, the only kind of group that may use tags or receive from any rank (NCCL matches point-to-point
        messages by order alone). On gloo it is `group` itself, except under the NCCL-ordering emulation
        (`rlhfuse.distributed.ordering`), which needs the control messages apart from the device messages it
        queues: a gloo group made once per group, as on NCCL. Collective: every rank of `group` calls it
        together (the trainer asks for the world's at start-up: `Topology.groups`, never first in mid-run)."""
        from rlhfuse.distributed import ordering

        if backend(group) == "gloo" and not ordering.enabled():
            return group
        whole = group is None or group is self._world
        key = 0 if whole else id(group)
        if key not in self._cpu:
            ranks = None if whole else dist.get_process_group_ranks(group)
            self._cpu[key] = dist.new_group(ranks=ranks, backend="gloo")
            ordering.mark_control(self._cpu[key])
        return self._cpu[key]


def cpu_group(group: Any = None) -> Any:
    """`WorldGroups.cpu` of this process's world."""
    return WorldGroups.current().cpu(group)
