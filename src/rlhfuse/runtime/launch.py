"""Multi-process launch through Lightning Fabric (no home-made launcher or transport).

`rlhfuse-train ... distributed.nproc_per_node=2`: Fabric's subprocess launcher re-runs the same command for
ranks 1..N-1 (Hydra-aware: same run directory) and initialises torch.distributed (gloo on CPU, NCCL on GPU).
Under `torchrun`, Fabric reads the torchelastic environment and each process is one rank.

`Watchdog`: every wait of a multi-process run is bounded. Under Fabric's launcher rank 0 supervises the ranks it
started (their `Popen`s: it reaps them and knows their exit status) and each of them watches rank 0, its parent;
under `torchrun` each rank watches the other ranks of its host (their pids, exchanged once the process group is
up). When a watched rank is gone, the rank prints one line naming it (and its exit status where known) and this
rank's last step, stops the ranks it started, and exits with status 1 within about a second; start-up (launch,
rendezvous, the first collective) is bounded by `distributed.timeout_s`, and so is every collective after it
(the process group's timeout).

Fabric's own child observer is not started (`SupervisedLauncher`, in `rlhfuse.runtime.supervised`): it polls the
children every 5 s and SIGKILLs the whole job, rank 0 included, when one has died, so whenever it looked before the
watchdog the run ended with status -9 and no line. With it gone the watchdog is the only one that reaps the
children, whichever thread of rank 0 notices the death first (the watchdog's, or the main thread's failed
collective) prints the same line.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from rlhfuse.core.protocols import Callback

if TYPE_CHECKING:
    from lightning.fabric import Fabric

RUN_LOG_NAME = "rlhfuse-train"
"""The logger whose handlers the command line points at the run folder's log (`rlhfuse-train.log`)."""


def launched_rank_zero() -> bool:
    """Whether this process is rank 0 of its job (or the only process), before any process group exists: torchrun
    sets RANK; Fabric's launcher sets LOCAL_RANK and NODE_RANK for the ranks it starts (the process that starts
    them has neither)."""
    if os.environ.get("RANK", "").strip():
        return os.environ["RANK"].strip() == "0"
    return all(os.environ.get(name, "0").strip() in ("", "0") for name in ("LOCAL_RANK", "NODE_RANK"))


def distributed_fabric(
    *, nproc_per_node: int, backend: str, timeout_s: float, device_type: str, precision: str
) -> Fabric:
    """A launched Fabric with its process group initialised; returns on every rank."""
    import torch
    from lightning.fabric import Fabric

    from rlhfuse.distributed import launched_local_world, launched_world
    from rlhfuse.runtime.supervised import SupervisedDDPStrategy

    launched = launched_world()
    world = nproc_per_node if launched is None else launched
    # LOCAL_WORLD_SIZE counts only beside torchrun's WORLD_SIZE: vLLM sets it to 1 in any process that built an
    # engine, which would make a launch from that process wait for processes of another node
    if launched is not None:
        local = launched_local_world() or nproc_per_node
    else:
        # this process launches the ranks of this host: they inherit the count (Fabric's launcher sets
        # WORLD_SIZE, LOCAL_RANK and NODE_RANK for them, not LOCAL_WORLD_SIZE)
        local = world
        os.environ["LOCAL_WORLD_SIZE"] = str(local)
    if world % local:
        raise ValueError(f"WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local}")
    if backend == "auto":
        backend = "nccl" if device_type == "cuda" else "gloo"
    watchdog = Watchdog(timeout_s)
    strategy = SupervisedDDPStrategy(
        watchdog, process_group_backend=backend, timeout=datetime.timedelta(seconds=timeout_s)
    )
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
    watchdog.start()
    fabric.launch()
    watchdog.joined(fabric)
    if device_type != "cuda":
        # N processes share the cores: without this each would start one thread per core
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    return fabric


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


def exit_status(returncode: int) -> str:
    """`Popen.returncode` in words: `exit status 3`, `killed by SIGKILL`."""
    if returncode >= 0:
        return f"exit status {returncode}"
    try:
        return f"killed by {signal.Signals(-returncode).name}"
    except ValueError:
        return f"killed by signal {-returncode}"


class Watchdog(Callback):
    """Ends this rank promptly, with one line, when another rank of the job dies (see the module docstring).
    `step` is what this rank was doing last (set by the trainer's stages); `disarm()` before an orderly exit."""

    current: Watchdog | None = None
    # How long a failed collective waits for the peer that broke it to be seen gone (it is exiting: its sockets
    # close before its process ends), so that the line can name it.
    death_wait_s = 5.0

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))
        # Fabric's launcher starts ranks 1..N-1 as children of rank 0 (torchrun's agent is nobody's rank)
        self.parent = os.getppid() if self.rank > 0 and "TORCHELASTIC_RUN_ID" not in os.environ else None
        self.peers: dict[int, int] = {}
        self.children: dict[int, subprocess.Popen[bytes]] = {}  # rank -> process, the ranks this one started
        self._stopping = threading.Lock()
        self.step = "start-up"
        # the run it watches, once its loop calls back: its run.json records the failure
        self.trainer: Any = None
        self.ready = False
        self.armed = True
        self.started = 0.0

    def start(self) -> None:
        """Watch from now on (the start-up timeout counts from here); `Watchdog.current` is this one."""
        Watchdog.current = self
        self.started = time.monotonic()
        threading.Thread(target=self._watch, daemon=True, name="rlhfuse-watchdog").start()

    def supervise(self, children: dict[int, subprocess.Popen[bytes]]) -> None:
        """The ranks this process launched, by rank: watched (and reaped) from now on, start-up included."""
        self.children = children

    def joined(self, fabric: Any) -> None:
        """The process group is up: learn every rank's host and pid. A rank started by Fabric's launcher watches
        its parent only (the parent supervises the others and stops them all, so one line is printed);
        otherwise every same-host rank is watched."""
        from rlhfuse import distributed

        self.rank = distributed.rank()
        here = socket.gethostname()
        found = distributed.all_gather_json([here, os.getpid()], distributed.group_device())
        self.peers = {
            r: pid
            for r, (host, pid) in enumerate(found)
            if host == here and r != self.rank and (self.parent is None or pid == self.parent)
        }
        self.ready = True

    def dead_ranks(self) -> list[int]:
        children = self.children
        dead = {r for r, proc in children.items() if proc.poll() is not None}
        dead |= {r for r, pid in self.peers.items() if r not in children and not _alive(pid)}
        if self.parent is not None and os.getppid() != self.parent:
            # orphaned: the local rank 0 that launched this process is gone
            dead.add(next((r for r, pid in self.peers.items() if pid == self.parent), 0))
        return sorted(dead)

    def await_dead(self) -> list[int]:
        """The dead ranks, waiting up to `death_wait_s` for one (a failed collective: the peer that broke it
        may still be ending); [] when none is seen by then."""
        deadline = time.monotonic() + self.death_wait_s
        while not (dead := self.dead_ranks()) and time.monotonic() < deadline:
            time.sleep(0.05)
        return dead

    def _name(self, rank: int) -> str:
        proc = self.children.get(rank)
        if proc is not None and proc.returncode is not None:
            return f"rank {rank} (pid {proc.pid}, {exit_status(proc.returncode)})"
        return f"rank {rank}" + (f" (pid {self.peers[rank]})" if rank in self.peers else "")

    def describe(self, dead: list[int]) -> str:
        names = ", ".join(self._name(r) for r in dead)
        return (
            f"{names} of this job died (this is rank {self.rank}, last step: {self.step}); every rank stops. "
            "See the dead rank's output for why (killed, out of memory?), then rerun with resume=auto to continue "
            "from the last checkpoint"
        )

    # Callback hooks (build_trainer adds the watchdog to a multi-process trainer): the last step, for the message
    def on_stage_start(self, trainer: Any, stage: str) -> None:
        self.trainer = trainer
        self.step = f"iteration {trainer.iteration + 1}, {stage}"

    def on_iteration_end(self, trainer: Any, iteration: int, metrics: Any) -> None:
        self.trainer = trainer
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
                self.stop(self.describe(dead))
            elif not self.ready and time.monotonic() - self.started > self.timeout_s:
                self.stop(
                    f"rank {self.rank}: the other ranks did not all join within distributed.timeout_s="
                    f"{self.timeout_s:g} s (a rank failed to start, or MASTER_ADDR/MASTER_PORT are unreachable): "
                    "check every rank's output, or raise distributed.timeout_s"
                )

    def stop(self, message: str) -> NoReturn:
        """Print the one error line, stop the ranks this one started, exit with status 1. Called by the watchdog's
        thread and by the main thread (a failed collective); whichever comes second waits here until the
        process has ended, so there is one line."""
        with self._stopping:
            sys.stdout.flush()
            sys.stderr.write(f"rlhfuse-train: error: {message}\n")
            sys.stderr.flush()
            # the run folder keeps the reason: the run log (the console's lines, rank 0) and run.json
            logging.getLogger(RUN_LOG_NAME).error("rlhfuse-train: error: %s", message)
            if self.trainer is not None:
                try:
                    self.trainer.end_run("failed", message)
                except Exception as err:  # the process is ending: the console line above stands
                    sys.stderr.write(f"rlhfuse-train: run.json not updated: {err}\n")
            for proc in self.children.values():
                proc.kill()  # SIGKILL, as Fabric's observer did: a rank blocked in a collective ignores SIGTERM
            os._exit(1)  # the main thread may be blocked in a collective that never returns
