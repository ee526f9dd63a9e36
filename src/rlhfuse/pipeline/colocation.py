"""How the Actor and the Critic share one fused layout, in pure arithmetic: the one definition of the merged-stage
and placement rules. `rlhfuse.runtime.ParallelLayout` (and, through its `RankGeometry`, the stream interpreters of
training and pipeline inference) and `rlhfuse.planner` (the memory model, the plan search, `plan=auto`) read it.

With T = max(actor tp, critic tp) and the smaller tp t dividing T, the smaller-tp model's m = T / t consecutive
stages (each on t ranks, its own tp) form one *merged stage* on one T-wide group of consecutive ranks (a pipeline
rank): its forward or backward runs the m sub-stages one after the other inside the group, sub-stage j on the
group's ranks j*t .. j*t + t - 1 (`StageMerge`). Each model then spans pp * tp / T pipeline ranks (its merged
stages, its *positions*); the model with more positions (the Actor on ties) is placed in rank order on the N
pipeline ranks of a fused group, the other as N / its positions replicas reversed over blocks
(`Colocation.placement`; docs/distributed.md, "Merged stages"). Equal tp: m = 1 and the positions are the stages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rlhfuse.pipeline.problem import reversed_blocks

MODELS: tuple[str, str] = ("actor", "critic")

# the rules a pair of sizes can break, in the order they are checked (each needs the ones before it to hold)
SIZES = "sizes below 1"
TP_DIVIDES = "the smaller tp does not divide the larger"
PP_MULTIPLE = "the smaller-tp model's pp is not a multiple of max tp / its tp"
NEST = "merged stages do not nest"
MICROBATCHES = "micro-batches do not split over the smaller model's replicas"


@dataclass(frozen=True)
class StageMerge:
    """One model's stages on pipeline ranks of `tp` consecutive ranks, its own tp degree `model_tp` dividing `tp`:
    `factor` = tp / model_tp consecutive stages form one merged stage, and the sub-stage in slot j of it runs on
    the ranks j*model_tp .. j*model_tp + model_tp - 1 of the pipeline rank (tp shard i on the i-th of them).
    `model_tp` = `tp`: one stage per merged stage, on the whole pipeline rank."""

    tp: int
    model_tp: int

    @property
    def factor(self) -> int:
        """Consecutive stages merged onto one pipeline rank (1 for the model with the larger tp)."""
        return max(self.tp // self.model_tp, 1)

    def slot_at(self, offset: int) -> int:
        """The sub-stage slot run by the rank `offset` (0 .. tp - 1) ranks into its pipeline rank."""
        return offset // self.model_tp

    def offset(self, slot: int, tp_rank: int = 0) -> int:
        """The rank, counted from its pipeline rank's first, that holds tp shard `tp_rank` of sub-stage `slot`."""
        return slot * self.model_tp + tp_rank

    def stage(self, merged: int, slot: int) -> int:
        """The stage (module) in slot `slot` of merged stage `merged`."""
        return merged * self.factor + slot

    def stages(self, merged: int) -> range:
        """The stages of merged stage `merged`, in forward order."""
        return range(self.stage(merged, 0), self.stage(merged + 1, 0))

    def merged_of(self, stage: int) -> int:
        """The merged stage that holds `stage`."""
        return stage // self.factor

    def slot_of(self, stage: int) -> int:
        """`stage`'s slot in its merged stage."""
        return stage % self.factor


def placed_on(placement: Sequence[Sequence[int]], rank: int) -> list[tuple[int, int]]:
    """(replica, merged stage) of every entry of `placement` (placement[r][S]: the pipeline rank of merged stage S
    of replica r, inside a fused group) on pipeline rank `rank` of the group."""
    return [(r, s) for r, row in enumerate(placement) for s, v in enumerate(row) if v == rank]


@dataclass(frozen=True)
class Refusal:
    """A rule of the co-location that a pair of sizes breaks: `rule` names it (one of the constants above; the
    planner counts its prunings by it), `message` gives the sizes, the arithmetic and the fix (the errors of
    `rlhfuse.runtime.ParallelLayout`)."""

    rule: str
    message: str


@dataclass(frozen=True)
class Colocation:
    """The Actor's and the Critic's (pp, tp) on one fused layout: the merge, the positions, the placement and the
    rules a pair must satisfy to be placed."""

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

    def merging(self, model: str) -> StageMerge:
        """How `model`'s stages merge onto the pipeline ranks."""
        return StageMerge(self.tp, self.model_tp(model))

    def merge(self, model: str) -> int:
        """Consecutive stages of `model` merged onto one pipeline rank: tp / the model's tp (1 for the larger tp)."""
        return self.merging(model).factor

    def positions(self, model: str) -> int:
        """`model`'s merged stages: pp / merge (the stages of its schedule, one pipeline rank each)."""
        return self.pp(model) // self.merge(model)

    def sub_stages(self, model: str, merged: int) -> range:
        """The stages (modules) of merged stage `merged` of `model`, in forward order."""
        return self.merging(model).stages(merged)

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
    def group_ranks(self) -> int:
        """Global ranks of one fused group: tp * N (at least tp; also defined for sizes `problem` refuses, so that
        the data-parallel degree is known before the layout is validated)."""
        return self.tp * max(self.ranks, 1)

    @property
    def width(self) -> int:
        """Ranks of a pipeline rank that hold different stages: the larger merge (1 with equal tp)."""
        return max(self.merge("actor"), self.merge("critic"))

    def replicas(self, model: str) -> int:
        """Replicas of `model` in one fused group (1 for the larger model, N / its positions for the other)."""
        return self.ranks // max(self.positions(model), 1)

    def placement(self, model: str) -> list[list[int]]:
        """placement[r][S]: the pipeline rank (inside a fused group) of merged stage S of replica r of `model`."""
        n = self.ranks
        if model == self.larger:
            return [list(range(n))]
        return reversed_blocks(n, self.positions(model))

    # --- the rules -------------------------------------------------------------------------------------------
    def positions_name(self, model: str) -> str:
        """How the messages name `model`'s positions: its pp, or its merged stages."""
        k = self.merge(model)
        return f"{model}.pp" if k == 1 else f"{model} merged stages ({model}.pp / {k})"

    def size_refusals(self) -> list[Refusal]:
        return [
            Refusal(SIZES, f"{m}.{key}={value} must be >= 1")
            for m in MODELS
            for key, value in (("pp", self.pp(m)), ("tp", self.model_tp(m)))
            if value < 1
        ]

    def merge_refusals(self) -> list[Refusal]:
        """Unequal tp (sizes >= 1): the smaller must divide the larger and the smaller-tp model's pp be a multiple
        of their ratio."""
        if self.actor_tp == self.critic_tp:
            return []
        wide, narrow = ("actor", "critic") if self.actor_tp > self.critic_tp else ("critic", "actor")
        big_tp, small_tp, small_pp = self.tp, self.model_tp(narrow), self.pp(narrow)
        if big_tp % small_tp:
            divisors = [d for d in range(1, big_tp + 1) if big_tp % d == 0]
            return [
                Refusal(
                    TP_DIVIDES,
                    f"{narrow}.tp={small_tp} must divide {wide}.tp={big_tp} (consecutive {narrow} stages are "
                    f"merged onto one {wide}.tp-wide group): set {narrow}.tp to one of {divisors}",
                )
            ]
        merge = self.merge(narrow)
        if small_pp % merge:
            return [
                Refusal(
                    PP_MULTIPLE,
                    f"{narrow}.pp={small_pp} must be a multiple of {wide}.tp / {narrow}.tp = {big_tp} / "
                    f"{small_tp} = {merge} ({merge} consecutive {narrow} stages of tp={small_tp} are merged onto "
                    f"each tp={big_tp} group): set {narrow}.pp to a multiple of {merge}",
                )
            ]
        return []

    def nest_refusals(self, microbatches: int | None = None) -> list[Refusal]:
        """Once the stages merge: the smaller number of positions must divide the larger, and `microbatches`
        (the larger model's per fused group, checked when given) split over the other's replicas."""
        big, small = self.larger, self.smaller
        n_big, n_small = self.positions(big), self.positions(small)
        if n_big % n_small:
            return [
                Refusal(
                    NEST,
                    f"{self.positions_name(small)}={n_small} must divide {self.positions_name(big)}={n_big} (the "
                    f"{small} is placed as {n_big} / {n_small} replicas over blocks of ranks): set {small}.pp so "
                    "that it does",
                )
            ]
        k = n_big // n_small
        if microbatches is not None and microbatches % k:
            return [
                Refusal(
                    MICROBATCHES,
                    f"microbatches={microbatches} must be a multiple of the {k} {small} replicas "
                    f"({self.positions_name(big)} / {self.positions_name(small)} = {n_big} / {n_small} = {k}): "
                    f"use a multiple of {k}",
                )
            ]
        return []

    def refusals(self, microbatches: int | None = None) -> list[Refusal]:
        """The rules this pair breaks (`microbatches`: the larger model's per fused group, checked when given),
        stopping at the first group of rules that fails: sizes, merge, nesting."""
        return self.size_refusals() or self.merge_refusals() or self.nest_refusals(microbatches)

    def problem(self, microbatches: int | None = None) -> str | None:
        """Why the pair cannot be placed (the first rule it breaks, named), or None when it can."""
        found = self.refusals(microbatches)
        return found[0].rule if found else None

    def check(self) -> Colocation:
        reason = self.problem()
        if reason is not None:
            raise ValueError(
                f"actor pp={self.actor_pp} tp={self.actor_tp}, critic pp={self.critic_pp} tp={self.critic_tp}: "
                f"rlhfuse.runtime cannot co-locate them ({reason})"
            )
        return self

    # --- stages per rank -------------------------------------------------------------------------------------
    def _merged_on(self, model: str) -> list[int]:
        """The merged stage of `model` on each pipeline rank of a fused group (every rank holds one of each
        model: the placement covers the group once per model)."""
        merged = [0] * self.ranks
        for row in self.placement(model):
            for s, v in enumerate(row):
                merged[v] = s
        return merged

    def _stage_at(self, model: str, merged: int, position: int) -> int:
        """The stage of merged stage `merged` of `model` at sub-rank `position` (ranks position*t' .. of the
        pipeline rank, t' the smaller tp)."""
        merging = self.merging(model)
        return merging.stage(merged, merging.slot_at(position * min(self.actor_tp, self.critic_tp)))

    def stage_on(self, model: str, rank: int, position: int = 0) -> int:
        """The stage (module) of `model` held by pipeline rank `rank` (0 .. N - 1) at sub-rank `position`
        (0 .. width - 1: ranks position*t' .. of the group, t' the smaller tp)."""
        return self._stage_at(model, self._merged_on(model)[rank], position)

    def local_stages(self) -> list[tuple[int, int]]:
        """(Actor stage, Critic stage) on each distinct rank of a fused group: entry v * width + j is pipeline rank
        v's sub-rank j (global ranks v*T + j*t .. v*T + (j+1)*t - 1, t the smaller tp; every tp rank of a stage
        holds the same count). Equal tp: one entry per pipeline rank."""
        self.check()
        actor, critic = self._merged_on("actor"), self._merged_on("critic")
        return [
            (self._stage_at("actor", actor[v], j), self._stage_at("critic", critic[v], j))
            for v in range(self.ranks)
            for j in range(self.width)
        ]
