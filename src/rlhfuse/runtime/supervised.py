"""Fabric's DDP strategy and subprocess launcher with `rlhfuse.runtime.launch.Watchdog` in place of Fabric's child
observer (the launch module's docstring says why). Subclasses of Lightning's classes, in a module of their own:
`distributed_fabric` imports it when it launches, so that importing `launch` (the command line does) leaves
Lightning unloaded."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed

if TYPE_CHECKING:
    from rlhfuse.runtime.launch import Watchdog


class SupervisedDDPStrategy(DDPStrategy):
    """Fabric's DDP strategy launching through `SupervisedLauncher` (`_configure_launcher` is where Fabric's
    strategies choose their launcher)."""

    def __init__(self, watchdog: Watchdog, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.watchdog = watchdog

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        self._launcher = SupervisedLauncher(
            self.watchdog, self.cluster_environment, self.num_processes, self.num_nodes
        )


class SupervisedLauncher(_SubprocessScriptLauncher):
    """Fabric's subprocess launcher (same commands, environment and Hydra run folder for ranks 1..N-1) with the
    `Watchdog` in place of Fabric's child observer (`rlhfuse.runtime.launch`): `launch` is Fabric's, less the
    `_launch_process_observer(self.procs)` call."""

    def __init__(self, watchdog: Watchdog, *args: Any) -> None:
        super().__init__(*args)
        self.watchdog = watchdog

    def launch(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            self._call_children_scripts()
            first = self.cluster_environment.node_rank() * self.num_processes + 1
            self.watchdog.supervise({first + i: proc for i, proc in enumerate(self.procs)})
        _set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kwargs)
