"""Multi-process launch through Lightning Fabric (no home-made launcher or transport).

`rlhfuse-train ... distributed.nproc_per_node=2`: Fabric's subprocess launcher re-runs the same command for
ranks 1..N-1 (Hydra-aware: same run directory) and initialises torch.distributed (gloo on CPU, NCCL on GPU).
Under `torchrun`, Fabric reads the torchelastic environment and each process is one rank.

`Watchdog`: every wait of a multi-process run is bounded. Each rank watches the other ranks of its host (their
pids, exchanged once the process group is up; before that, a rank started by Fabric's launcher watches rank 0,
its parent) and, when one is gone, prints one line naming it and this rank's last step and exits with status 1
within about a second; start-up (launch, rendezvous, the first collective) is bounded by
`distributed.timeout_s`, and so is every collective after it (the process group's timeout).
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from lightning.fabric import Fabric


def distributed_fabric(
    *, nproc_per_node: int, backend: str, timeout_s: float, device_type: str, precision: str
) -> Fabric:
    """A launched Fabric with its process group initialised; returns on every rank."""
    from lightning.fabric.strategies import DDPStrategy

    world = int(os.environ.get("WORLD_SIZE", nproc_per_node))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", nproc_per_node))
    if world % local:
        raise ValueError(f"WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local}")
    if backend == "auto":
        backend = "nccl" if device_type == "cuda" else "gloo"
    strategy = DDPStrategy(process_group_backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    accelerator = "cuda" if device_type == "cuda" else "cpu"
    fabric = Fabric(
        accelerator=accelerator,
        devices=local,
        num_nodes=world // local,
        strategy=strategy,
        precision=precision,  # type: ignore[arg-type]
    )
    if os.environ.get("RLHFUSE_DEBUG", "") in ("", "0"):
        # ranks launched below inherit it: no C++ retry warnings with stack frames when a peer is gone
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    watchdog = Watchdog.start(timeout_s)
    fabric.launch()
    watchdog.joined(fabric)
    if device_type != "cuda":
        # N processes share the cores: without this each would start one thread per core
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    return fabric


def is_global_zero(fabric: Any) -> bool:
    return bool(getattr(fabric, "global_rank", 0) == 0)


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, killed but not yet reaped by its parent, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return not Path("/proc").is_dir()  # no /proc to tell zombies apart: alive as far as we can see
    return stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")


class Watchdog:
    """Ends this rank promptly, with one line, when another rank of the job dies (see the module docstring).
    `step` is what this rank was doing last (set by the trainer's stages); `disarm()` before an orderly exit."""

    current: Watchdog | None = None

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))
        # Fabric's launcher starts ranks 1..N-1 as children of rank 0 (torchrun's agent is nobody's rank)
        self.parent = os.getppid() if self.rank > 0 and "TORCHELASTIC_RUN_ID" not in os.environ else None
        self.peers: dict[int, int] = {}
        self.step = "start-up"
        self.ready = False
        self.armed = True
        self.started = time.monotonic()

    @classmethod
    def start(cls, timeout_s: float) -> Watchdog:
        watchdog = cls.current = cls(timeout_s)
        threading.Thread(target=watchdog._watch, daemon=True, name="rlhfuse-watchdog").start()
        return watchdog

    def joined(self, fabric: Any) -> None:
        """The process group is up: learn every rank's host and pid (same-host ranks are watched)."""
        from rlhfuse import distributed

        self.rank = distributed.rank()
        here = socket.gethostname()
        found = distributed.all_gather_json([here, os.getpid()], distributed.group_device())
        self.peers = {r: pid for r, (host, pid) in enumerate(found) if host == here and r != self.rank}
        self.ready = True

    def dead_ranks(self) -> list[int]:
        dead = [r for r, pid in sorted(self.peers.items()) if not _alive(pid)]
        if self.parent is not None and os.getppid() != self.parent and 0 not in dead:
            dead.insert(0, 0)  # orphaned: rank 0, which launched this process, is gone
        return dead

    def describe(self, dead: list[int]) -> str:
        names = ", ".join(f"rank {r}" + (f" (pid {self.peers[r]})" if r in self.peers else "") for r in dead)
        return (
            f"{names} of this job died (this is rank {self.rank}, last step: {self.step}); every rank stops. "
            "See the dead rank's output for why (killed, out of memory?), then rerun with resume=auto to continue "
            "from the last checkpoint"
        )

    # Callback hooks (build_trainer adds the watchdog to a multi-process trainer): the last step, for the message
    def on_stage_start(self, trainer: Any, stage: str) -> None:
        self.step = f"iteration {trainer.iteration + 1}, {stage}"

    def on_iteration_end(self, trainer: Any, iteration: int, metrics: Any) -> None:
        self.step = f"after iteration {iteration}"

    def disarm(self) -> None:
        self.armed = False

    def _watch(self) -> None:
        while self.armed:
            time.sleep(0.5)
            if not self.armed:
                return
            dead = self.dead_ranks()
            if dead:
                self._stop(self.describe(dead))
            elif not self.ready and time.monotonic() - self.started > self.timeout_s:
                self._stop(
                    f"rank {self.rank}: the other ranks did not all join within distributed.timeout_s="
                    f"{self.timeout_s:g} s (a rank failed to start, or MASTER_ADDR/MASTER_PORT are unreachable): "
                    "check every rank's output, or raise distributed.timeout_s"
                )

    def _stop(self, message: str) -> None:
        sys.stderr.write(f"rlhfuse-train: error: {message}\n")
        sys.stderr.flush()
        os._exit(1)  # the main thread may be blocked in a collective that never returns
