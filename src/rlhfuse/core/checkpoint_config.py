"""`checkpoint.*`: when checkpoints are saved and kept (`rlhfuse.core.checkpoint` writes them). No torch, so that
the command line composes the configuration without it."""

from __future__ import annotations

from dataclasses import dataclass

from rlhfuse.core.config_checks import non_negative


@dataclass
class CheckpointConfig:
    # Save every N iterations (0 = never); the last iteration is always saved when N > 0.
    every: int = 0
    # Most recent checkpoints kept on disk (0 = keep all).
    keep: int = 2
    # Folder, relative to the run directory.
    dir: str = "checkpoints"
    # At the end, export the trained Actor as a Hugging Face checkpoint in <run_dir>/actor_hf.
    export_hf: bool = True
    # Start a fresh run (resume=never) in a run folder that holds another run's checkpoints. They stay on disk
    # (rotation removes only this run's own), and resume=auto then continues this run. false = refuse.
    overwrite: bool = False

    def problems(self) -> list[str]:
        problems: list[str] = []
        non_negative(problems, "checkpoint.every", self.every, "0 = never")
        non_negative(problems, "checkpoint.keep", self.keep, "0 = keep all")
        return problems
