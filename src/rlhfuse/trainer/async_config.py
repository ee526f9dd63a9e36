"""Asynchronous RL's configuration (the root section `async`; `RLHFConfig.asynchronous` in Python, `async` being
a Python keyword): how far generation may run ahead of training (`rlhfuse.trainer.asynchronous`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlhfuse.core.config_checks import need


@dataclass
class AsyncConfig:
    # The staleness bound, in policy versions (version v = the Actor after v iterations' training). 0 = the
    # synchronous run: iteration i's samples come from version i-1. k > 0: generation runs ahead of training in
    # a background thread beside it (colocated), iteration i's samples from version max(0, i-1-k) exactly, so
    # no trained token is more than k versions old and the run does not depend on timing.
    max_staleness: int = 0
    # Partial rollouts: a weight sync does not wait for the batch being generated; its samples continue under the
    # new weights from the next decode step on (their KV cache kept), so a sample's tokens may come from two or
    # more versions (each recorded), none older than the bound. Runs then depend on the timing (of the threads,
    # or of the split placement's two ranks).
    partial_rollout: bool = False
    # Split placement: the last N ranks of the world generate and the others train; each sync pushes the Actor's
    # weights to them over a process group (`rlhfuse.trainer.split`). 0 = colocated (generation in a thread of the
    # training process). With any max_staleness, 0 included (a synchronous run split over processes). For now one
    # generation rank beside one training rank (pipeline=plain, a world of 2).
    generation_ranks: int = 0
    # Where the frozen models (Ref, Reward) and the rule rewards score each batch: on the training ranks, with the
    # Actor and the Critic (training_ranks), or, with the split placement, on the generation ranks as each batch is
    # generated (generation_ranks: they send its Ref log-probs and scores with it, and the training ranks run the
    # Actor and the Critic only). The result is the same, bit for bit; generation_ranks moves work off the
    # training ranks where they, not generation, bound the iteration.
    frozen_inference: Literal["training_ranks", "generation_ranks"] = "training_ranks"

    @property
    def enabled(self) -> bool:
        """Whether generation runs ahead of training."""
        return self.max_staleness > 0

    @property
    def split(self) -> bool:
        """Whether generation runs on ranks of its own (the split placement)."""
        return self.generation_ranks > 0

    def problems(self) -> list[str]:
        problems: list[str] = []
        need(
            problems,
            self.max_staleness >= 0,
            f"async.max_staleness={self.max_staleness} must be >= 0 (0 = synchronous; typically 1 or 2)",
        )
        need(
            problems,
            not self.partial_rollout or self.max_staleness > 0,
            "async.partial_rollout=true continues in-flight samples under the weights of a later sync, which "
            "only happens with generation ahead of training: set async.max_staleness >= 1",
        )
        need(
            problems,
            self.generation_ranks in (0, 1),
            f"async.generation_ranks={self.generation_ranks}: the split placement has one generation rank for "
            "now: set async.generation_ranks=1 (or 0: generation in a thread of the training process)",
        )
        need(
            problems,
            self.frozen_inference == "training_ranks" or self.split,
            "async.frozen_inference=generation_ranks scores batches where they are generated, which needs "
            "generation ranks of their own: set async.generation_ranks=1 (or async.frozen_inference="
            "training_ranks)",
        )
        return problems
