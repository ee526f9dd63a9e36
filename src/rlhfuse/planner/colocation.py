"""How `rlhfuse.runtime` co-locates the Actor and the Critic on one layout, in pure arithmetic: the planner's mirror
of `rlhfuse.runtime.ParallelLayout`'s rule (`tests/planner/test_planner_colocation.py` checks the two agree on
every small layout; the planner does not import the runtime, which pulls in torch and the executors).

With T = max(actor tp, critic tp) and the smaller tp t dividing T, the smaller-tp model's m = T / t consecutive
stages (each on t ranks, its own tp) form one *merged stage* on one T-wide group of ranks (a pipeline rank): its
forward or backward runs the m sub-stages one after the other inside the group, sub-stage j on the group's ranks
j*t .. j*t + t - 1. Each model then spans pp * tp / T pipeline ranks (its merged stages, its *positions*); the
model with more positions (the Actor on ties) is placed in rank order on the N ranks of a fused group, the other
as N / its positions replicas reversed over blocks (`docs/distributed.md`, "Merged stages"). Equal tp: m = 1 and
the positions are the stages.
"""

from __future__ import annotations

from dataclasses import dataclass

MODELS: tuple[str, str] = ("actor", "critic")


@dataclass(frozen=True)
class Colocation:
    """The Actor's and the Critic's (pp, tp) on one fused layout of `rlhfuse.runtime`."""

    actor_pp: int
    actor_tp: int
    critic_pp: int
    critic_tp: int

    def pp(self, model: str) -> int:
        return self.actor_pp if model == "actor" else self.critic_pp

    def model_tp(self, model: str) -> int:
        return self.actor_tp if model == "actor" else self.critic_tp

    @property
    def tp(self) -> int:
        """Width of a pipeline rank: the larger tp."""
        return max(self.actor_tp, self.critic_tp)

    def merge(self, model: str) -> int:
        """Consecutive stages of `model` merged onto one pipeline rank: tp / the model's tp (1 for the larger tp)."""
        return max(self.tp // self.model_tp(model), 1)

    def positions(self, model: str) -> int:
        """`model`'s merged stages: pp / merge (the stages of its schedule, one pipeline rank each)."""
        return self.pp(model) // self.merge(model)

    @property
    def larger(self) -> str:
        """The model placed in rank order: more positions, the Actor on ties."""
        return "actor" if self.positions("actor") >= self.positions("critic") else "critic"

    @property
    def smaller(self) -> str:
        return "critic" if self.larger == "actor" else "actor"

    @property
    def ranks(self) -> int:
        """N: pipeline ranks of one fused group."""
        return max(self.positions("actor"), self.positions("critic"))

    @property
    def width(self) -> int:
        """Ranks of a pipeline rank that hold different stages: the larger merge (1 with equal tp)."""
        return max(self.merge("actor"), self.merge("critic"))

    def replicas(self, model: str) -> int:
        return self.ranks // max(self.positions(model), 1)

    def problem(self, microbatches: int | None = None) -> str | None:
        """Why `rlhfuse.runtime.ParallelLayout` refuses this pair (`microbatches`: the larger model's micro-batches
        per fused group, checked when given), or None when it runs it; a short reason that names the rule."""
        if min(self.actor_pp, self.actor_tp, self.critic_pp, self.critic_tp) < 1:
            return "sizes below 1"
        narrow = "actor" if self.actor_tp < self.critic_tp else "critic"
        if self.actor_tp != self.critic_tp:
            if self.tp % self.model_tp(narrow):
                return "the smaller tp does not divide the larger"
            if self.pp(narrow) % self.merge(narrow):
                return "the smaller-tp model's pp is not a multiple of max tp / its tp"
        if self.ranks % self.positions(self.smaller):
            return "merged stages do not nest"
        if microbatches is not None and microbatches % self.replicas(self.smaller):
            return "micro-batches do not split over the smaller model's replicas"
        return None

    def check(self) -> Colocation:
        reason = self.problem()
        if reason is not None:
            raise ValueError(
                f"actor pp={self.actor_pp} tp={self.actor_tp}, critic pp={self.critic_pp} tp={self.critic_tp}: "
                f"rlhfuse.runtime cannot co-locate them ({reason})"
            )
        return self

    def stage_on(self, model: str, rank: int, position: int = 0) -> int:
        """The stage (module) of `model` held by pipeline rank `rank` (0 .. N - 1) at sub-rank `position`
        (0 .. width - 1: ranks position*t' .. of the group, t' the smaller tp)."""
        n, k = self.positions(model), self.merge(model)
        merged = rank if model == self.larger else n - 1 - rank % n
        sub = position * min(self.actor_tp, self.critic_tp) // self.model_tp(model)
        return merged * k + sub

    def local_stages(self) -> list[tuple[int, int]]:
        """(Actor stage, Critic stage) on each distinct rank of a fused group: entry v * width + j is pipeline rank
        v's sub-rank j (global ranks v*T + j*t .. v*T + (j+1)*t - 1, t the smaller tp; every tp rank of a stage
        holds the same count). Equal tp: one entry per pipeline rank."""
        self.check()
        return [
            (self.stage_on("actor", v, j), self.stage_on("critic", v, j))
            for v in range(self.ranks)
            for j in range(self.width)
        ]
