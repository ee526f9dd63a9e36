"""Parallel layout of the fused Actor+Critic pipeline: validated sizes, the paper's placement, process groups.

docs/paper.md §3: the model with more pipeline stages occupies the ranks of a *fused group*
in order; the other model is split into K = N / its stages replicas, each reversed over its block of ranks
(e.g. actor 4 stages on ranks 0..3, critic 2 stages as replicas on 1,0 and 3,2). The fused group is replicated
`dp` times (data parallelism); world size = N * dp. The merge, placement and co-location rules are
`rlhfuse.pipeline.colocation`'s (`ParallelLayout.colocation`), the ones the planner reads.

This module is pure except `build_process_groups`, which asks for the groups (`rlhfuse.distributed.WorldGroups`)
on every rank in the same order (as torch requires).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

from rlhfuse.core.types import ModelRole
from rlhfuse.pipeline.colocation import Colocation, StageMerge, placed_on
from rlhfuse.pipeline.problem import Problem, make_problem

if TYPE_CHECKING:
    from rlhfuse.distributed import WorldGroups

# the trained models (str enums: they key dicts, files and metrics as "actor" / "critic")
MODELS: tuple[str, ...] = (ModelRole.ACTOR, ModelRole.CRITIC)


@dataclass(frozen=True)
class ModelParallel:
    """Parallel sizes of one model.

    Attributes:
        pp: pipeline stages of one replica (1 = no pipeline).
        tp: tensor-parallel degree: each stage is split over tp consecutive ranks (its tp group).
    """

    pp: int = 1
    tp: int = 1


@dataclass(frozen=True)
class RankGeometry:
    """Where one global rank sits in the pipeline ranks and tp groups, per model: its peers, merges and positions,
    by the merge rule of `rlhfuse.pipeline.colocation.StageMerge` (`ParallelLayout` and both stream interpreters
    read it).

    tp: a pipeline rank's width (the larger tp degree); model_tp: each model's own tp degree (dividing tp). A
    model with model_tp < tp has merge = tp / model_tp consecutive stages merged onto each pipeline rank; this
    rank runs sub-stage `position` of each (ranks position*t .. position*t + t - 1 of the group, t = model_tp).
    """

    rank: int
    tp: int
    model_tp: Mapping[str, int]

    def __post_init__(self) -> None:
        bad = {m: t for m, t in self.model_tp.items() if t < 1 or self.tp % t}
        if bad:
            raise ValueError(f"model tp degrees {bad} must divide the pipeline rank's width tp={self.tp}")

    def merging(self, model: str) -> StageMerge:
        return StageMerge(self.tp, self.model_tp[model])

    @property
    def pipeline_rank(self) -> int:
        return self.rank // self.tp

    def merge(self, model: str) -> int:
        return self.merging(model).factor

    def position(self, model: str) -> int:
        """The sub-stage slot this rank runs of `model`'s merged stages (0 when not merged)."""
        return self.merging(model).slot_at(self.rank % self.tp)

    def model_tp_rank(self, model: str) -> int:
        return self.rank % self.model_tp[model]

    def sub_stage(self, model: str, merged: int) -> int:
        """The stage (module) this rank runs for merged stage `merged` of `model`."""
        return self.merging(model).stage(merged, self.position(model))

    def merged_stage(self, model: str, stage: int) -> int:
        """The merged stage of `model` that holds `stage`."""
        return self.merging(model).merged_of(stage)

    def peer(self, pipeline_rank: int, model: str, slot: int = 0) -> int:
        """The global rank of this rank's peer (same tp position of `model`) in sub-stage slot `slot` of
        `pipeline_rank`."""
        return pipeline_rank * self.tp + self.merging(model).offset(slot, self.model_tp_rank(model))

    def takes_part(self, send: bool, model: str, grad: bool) -> tuple[bool, int]:
        """Whether this rank sends (`send`) or receives a message between merged stages of `model`, and the peer's
        sub-stage slot: activations leave the last sub-stage and arrive at the first, gradients the reverse."""
        last = self.merge(model) - 1
        sender, receiver = (0, last) if grad else (last, 0)
        mine, theirs = (sender, receiver) if send else (receiver, sender)
        return self.position(model) == mine, theirs


@dataclass(frozen=True)
class ParallelLayout:
    """Actor and Critic co-located on `world_size` ranks.

    Attributes:
        actor, critic: each model's pipeline sizes.
        dp: data-parallel fused groups; each holds one replica of the larger model and K of the smaller.
        world_size: number of ranks (processes).
        microbatches: micro-batches of the larger model per fused group and mini-batch; each replica of the
            smaller model runs microbatches / K of them.
        device: this rank's device ("cuda:LOCAL_RANK" under NCCL, "cpu" under gloo:
            `rlhfuse.distributed.rank_device`), the one source of truth for placement: every stage this rank
            holds, and every tensor handed to a collective or point-to-point call, lives there.
        trained: the models the training plan pipelines (built, trained, checkpointed). Both by default; a
            critic-free algorithm trains the Actor alone (`actor_only_layout`): the critic slot then trains
            nothing and only places the Reward model's inference.

    Rank numbering: the placement is over *pipeline ranks* (one per tp group); fused group g holds pipeline
    ranks g*N .. g*N + N - 1 (N = max(actor.pp, critic.pp)), and pipeline rank v spans the tp consecutive global
    ranks v*tp .. v*tp + tp - 1 (its tp group: the ranks of one stage's tp group are consecutive). tp = 1: the
    two numberings coincide.
    """

    actor: ModelParallel
    critic: ModelParallel
    dp: int
    world_size: int
    microbatches: int = 1
    device: str = "cpu"
    trained: tuple[str, ...] = MODELS

    def __post_init__(self) -> None:
        problems: list[str] = []
        if not self.trained or any(m not in MODELS for m in self.trained) or "actor" not in self.trained:
            problems.append(f"trained={self.trained} must be a non-empty subset of {MODELS} with the actor")
        colocation = self.colocation
        problems += [refusal.message for refusal in colocation.size_refusals()]
        if self.dp < 1:
            problems.append(f"dp={self.dp} must be >= 1")
        if self.microbatches < 1:
            problems.append(f"microbatches={self.microbatches} must be >= 1")
        if not problems:
            problems += [refusal.message for refusal in colocation.merge_refusals()]
        if not problems:
            problems += [refusal.message for refusal in colocation.nest_refusals(self.microbatches)]
            n_big, tp, big = colocation.ranks, colocation.tp, colocation.larger
            if n_big * tp * self.dp != self.world_size:
                span = n_big * tp
                hint = (
                    f"set dp={self.world_size // span}"
                    if self.world_size % span == 0
                    else f"use {span * self.dp} processes, or an {big}.pp * tp dividing {self.world_size}"
                )
                problems.append(
                    f"{colocation.positions_name(big)} * tp * dp = {n_big} * {tp} * {self.dp} = {span * self.dp} "
                    f"!= world size {self.world_size}: " + hint
                )
        if problems:
            raise ValueError("invalid parallel layout:\n  - " + "\n  - ".join(problems))

    @cached_property
    def colocation(self) -> Colocation:
        """The merge, positions and placement of the two models (`rlhfuse.pipeline.colocation`, shared with the
        planner): the methods below read it."""
        return Colocation(self.actor.pp, self.actor.tp, self.critic.pp, self.critic.tp)

    # --- sizes ---------------------------------------------------------------------------------------------
    @property
    def larger(self) -> str:
        """The model with more (merged) stages (the Actor on ties): placed in rank order."""
        return self.colocation.larger

    @property
    def smaller(self) -> str:
        return self.colocation.smaller

    @property
    def tp(self) -> int:
        """Width of a pipeline rank's group of consecutive ranks: the larger of the two tp degrees (equal
        degrees: both models' tp)."""
        return self.colocation.tp

    def model_tp(self, model: str) -> int:
        """`model`'s own tensor-parallel degree."""
        return int(getattr(self, model).tp)

    def geometry(self, rank: int) -> RankGeometry:
        """A global rank's place in the pipeline ranks and tp groups (the peer / merge / position arithmetic)."""
        return RankGeometry(rank, self.tp, {m: self.model_tp(m) for m in MODELS})

    def merge(self, model: str) -> int:
        """Consecutive stages of `model` merged onto one pipeline rank: tp / the model's tp (1 for the model
        with the larger tp). Sub-stage j of a merged stage runs on ranks j*t .. j*t + t - 1 of the group (t the
        model's tp)."""
        return self.colocation.merge(model)

    @property
    def pipeline_ranks(self) -> int:
        """Pipeline ranks (tp groups): world size / tp; the instruction streams are per pipeline rank."""
        return self.world_size // self.tp

    def tp_rank(self, rank: int, model: str | None = None) -> int:
        """A global rank's position in its tp group (of `model`: in that model's tp group of model_tp ranks;
        None: in the pipeline rank's group of `tp` ranks)."""
        return rank % (self.tp if model is None else self.model_tp(model))

    def position(self, model: str, rank: int) -> int:
        """Which sub-stage of `model`'s merged stages a global rank runs (0 .. merge - 1; 0 when not merged)."""
        return self.geometry(rank).position(model)

    def pipeline_rank(self, rank: int) -> int:
        """A global rank's pipeline rank (its tp group)."""
        return rank // self.tp

    def global_rank(self, pipeline_rank: int, tp_rank: int = 0) -> int:
        return pipeline_rank * self.tp + tp_rank

    @property
    def group_size(self) -> int:
        """N: pipeline ranks of one fused group."""
        return self.colocation.ranks

    def stages(self, model: str) -> int:
        """The model's pipeline stages (`pp`: how its layers are split into modules)."""
        return int(getattr(self, model).pp)

    def merged_stages(self, model: str) -> int:
        """The model's stages in the schedule: pp / merge (each merged stage is one pipeline rank's subtask)."""
        return self.colocation.positions(model)

    def sub_stages(self, model: str, merged: int) -> range:
        """The stages (modules) of merged stage `merged` of `model`, in execution order."""
        return self.colocation.sub_stages(model, merged)

    def replicas(self, model: str) -> int:
        """Replicas of `model` inside one fused group (1 for the larger model, K for the other)."""
        return self.colocation.replicas(model)

    def microbatches_per_replica(self, model: str) -> int:
        return self.microbatches // self.replicas(model)

    # --- placement -----------------------------------------------------------------------------------------
    def local_placement(self, model: str) -> list[list[int]]:
        """placement[r][S]: pipeline rank inside a fused group of merged stage S of replica r."""
        return self.colocation.placement(model)

    def rank(self, model: str, group: int, replica: int, stage: int, tp_rank: int = 0) -> int:
        """Global rank of tp shard `tp_rank` (0 .. model_tp - 1) of `stage` (0 .. pp - 1) of `replica` of `model`
        in data-parallel fused group `group`."""
        merging = self.colocation.merging(model)
        local = self.local_placement(model)[replica][merging.merged_of(stage)]
        return self.global_rank(
            group * self.group_size + local, merging.offset(merging.slot_of(stage), tp_rank)
        )

    def stages_on(self, rank: int) -> list[tuple[str, int, int]]:
        """(model, replica, stage) placed on a global rank (its tp shard of them; a merged stage: the one
        sub-stage at this rank's `position`), for every slot (the inference of a model placed like an untrained
        slot uses it too: `held_stages`)."""
        local = self.pipeline_rank(rank) % self.group_size
        geometry = self.geometry(rank)
        return [
            (model, r, geometry.sub_stage(model, s))
            for model in MODELS
            for r, s in placed_on(self.local_placement(model), local)
        ]

    def trained_stages_on(self, rank: int) -> list[tuple[str, int, int]]:
        """(model, replica, stage) of the trained models held by a global rank: what it trains."""
        return [key for key in self.stages_on(rank) if key[0] in self.trained]

    def held_stages(self, rank: int) -> dict[str, set[int]]:
        """model -> the stages of it that `rank` holds (any replica): what sharded construction materialises."""
        held: dict[str, set[int]] = {m: set() for m in MODELS}
        for model, _, stage in self.stages_on(rank):
            held[model].add(stage)
        return held

    def group_of(self, rank: int) -> int:
        return self.pipeline_rank(rank) // self.group_size

    def problem(
        self,
        forward: dict[str, Any] | None = None,
        backward: dict[str, Any] | None = None,
        activation: dict[str, Any] | None = None,
        name: str = "runtime",
    ) -> Problem:
        """The scheduling problem of one fused group (local pipeline ranks) over merged stages, with per-model
        durations (a number or one per merged stage; default: forward 1, backward 2 per stage) and activation
        sizes."""
        forward, backward, activation = forward or {}, backward or {}, activation or {}
        models = [
            {
                "name": m,
                "stages": self.merged_stages(m),
                "microbatches": self.microbatches_per_replica(m),
                "forward": forward.get(m, 1.0),
                "backward": backward.get(m, 2.0),
                "activation": activation.get(m, 1.0),
                "placement": self.local_placement(m),
            }
            for m in (self.larger, self.smaller)
            if m in self.trained
        ]
        return make_problem(models, ranks=self.group_size, name=name)

    # --- process groups by purpose (pure: which ranks) -------------------------------------------------------
    @cached_property
    def grad_groups(self) -> dict[tuple[str, int], tuple[int, ...]]:
        """(model, stage) -> every rank holding (a tp shard of) that stage: the critic replicas of all fused
        groups (or the data-parallel copies of the larger model). tp = 1: gradients of a stage are summed over
        these ranks (tp > 1: over `tp_grad_groups`)."""
        return {
            (m, s): tuple(
                self.rank(m, g, r, s, t)
                for g in range(self.dp)
                for r in range(self.replicas(m))
                for t in range(self.model_tp(m))
            )
            for m in self.trained
            for s in range(self.stages(m))
        }

    @cached_property
    def tp_grad_groups(self) -> dict[tuple[str, int, int], tuple[int, ...]]:
        """(model, stage, tp rank) -> every rank holding that tp shard of the stage: the shard's gradients are
        summed over these ranks (replicas and data parallelism; tp = 1: `grad_groups`)."""
        return {
            (m, s, t): tuple(
                self.rank(m, g, r, s, t) for g in range(self.dp) for r in range(self.replicas(m))
            )
            for m in self.trained
            for s in range(self.stages(m))
            for t in range(self.model_tp(m))
        }

    @cached_property
    def tp_groups(self) -> tuple[tuple[int, ...], ...]:
        """The pipeline ranks' groups: consecutive ranks v*tp .. v*tp + tp - 1 per pipeline rank v (the tp groups
        of the model with the larger tp)."""
        return tuple(tuple(range(v * self.tp, (v + 1) * self.tp)) for v in range(self.pipeline_ranks))

    def model_tp_groups(self, model: str) -> tuple[tuple[int, ...], ...]:
        """`model`'s tp groups: model_tp consecutive ranks each (`tp_groups` for the model with the larger tp;
        each sub-stage of a merged stage has its own)."""
        t = self.model_tp(model)
        return tuple(tuple(range(v * t, (v + 1) * t)) for v in range(self.world_size // t))

    @cached_property
    def pipeline_groups(self) -> dict[tuple[str, int, int], tuple[int, ...]]:
        """(model, fused group, replica) -> the pipeline ranks of that pipeline, in merged-stage order."""
        return {
            (m, g, r): tuple(g * self.group_size + v for v in row)
            for m in self.trained
            for g in range(self.dp)
            for r, row in enumerate(self.local_placement(m))
        }

    def p2p_pairs(self, model: str) -> tuple[tuple[int, int], ...]:
        """The global rank pairs (low, high) that exchange `model`'s point-to-point messages, sorted: the last
        sub-stage of each merged stage with the first of the next (same tp position), and neighbouring sub-stages
        inside a merged stage. Activations go one way and gradients the other on every pair."""
        merging = self.colocation.merging(model)
        pairs: set[tuple[int, int]] = set()
        for g in range(self.dp):
            for row in self.local_placement(model):
                for i in range(merging.model_tp):
                    # tp position i of each merged stage's sub-stages, in forward order
                    subs = [
                        [
                            self.global_rank(g * self.group_size + v, merging.offset(j, i))
                            for j in range(merging.factor)
                        ]
                        for v in row
                    ]
                    for ranks in subs:
                        pairs.update(itertools.pairwise(ranks))
                    for a, b in itertools.pairwise(subs):
                        pairs.add((min(a[-1], b[0]), max(a[-1], b[0])))
        return tuple(sorted(pairs))

    @cached_property
    def data_parallel_groups(self) -> tuple[tuple[int, ...], ...]:
        """Ranks with the same position in every fused group (same stages and tp shard of both models)."""
        n, tp = self.group_size, self.tp
        return tuple(tuple((g * n + k) * tp + t for g in range(self.dp)) for k in range(n) for t in range(tp))

    def describe(self) -> str:
        parts = [f"{self.world_size} ranks = {self.dp} fused group(s) x {self.group_size}"]
        if self.tp > 1:
            parts[0] += f" pipeline ranks x tp={self.tp} (consecutive ranks)"
        for m in (self.larger, self.smaller):
            if m in self.trained:
                merged = ""
                if self.merge(m) > 1:
                    merged = (
                        f" (tp={self.model_tp(m)}: {self.merge(m)} consecutive stages merged per pipeline rank, "
                        f"{self.merged_stages(m)} merged stages)"
                    )
                parts.append(
                    f"{m}: {self.replicas(m)} x pp={self.stages(m)}{merged} on {self.local_placement(m)}"
                )
        if len(self.trained) == 1:
            parts.append("no critic (critic-free algorithm: the Actor's pipeline alone)")
        return "; ".join(parts)


def actor_only_layout(
    actor: ModelParallel, dp: int, world_size: int, microbatches: int = 1, device: str = "cpu"
) -> ParallelLayout:
    """The layout of a critic-free algorithm: the Actor's pipeline alone (`trained=("actor",)`). The critic
    slot mirrors the Actor's stages, reversed over the same ranks, and trains nothing: it places the Reward
    model's inference (`rlhfuse.trainer.strategies.pipelines.inference`: Reward placed like the Critic) when one is used."""
    return ParallelLayout(actor, actor, dp, world_size, microbatches, device=device, trained=("actor",))


@dataclass
class ProcessGroups:
    """torch.distributed groups by purpose, built identically on every rank.

    p2p[(model, direction, low rank, high rank)]: one group of two ranks per model, direction ("act" forward,
    "grad" backward) and rank pair that exchanges the model's messages (`rlhfuse.runtime.lower.p2p_group_key`), so
    that on every group the pair's messages go one way, in the order the lowering proves NCCL can run under
    either of its stream models (per rank pair, per rank: a group of one pair is one stream both ways); grad[(model, stage)]: gradient reduction over replicas and data parallelism of this rank's tp
    shard of the stage (None when a single rank holds it); pipeline[(model, fused group, replica)]: the ranks of
    that pipeline with this rank's tp position; tp: this rank's tp group (None when tp = 1: the vocabulary- and
    tensor-parallel collectives then do nothing); world: the default group (norms, statistics, weight sync).
    """

    p2p: dict[tuple[str, str, int, int], Any]
    grad: dict[tuple[str, int], Any]
    pipeline: dict[tuple[str, int, int], Any]
    data_parallel: tuple[Any, ...]
    world: Any
    tp: Any = None
    tp_size: int = 1
    model_tp: dict[str, Any] = field(default_factory=dict)

    def tp_of(self, model: str) -> Any:
        """This rank's tp group of `model` (None: not tensor-parallel)."""
        return self.model_tp.get(model, self.tp)


DIRECTIONS: tuple[str, ...] = ("act", "grad")
"""The point-to-point directions of a model: activations forward, gradients backward (`ProcessGroups.p2p`)."""


def warm_up_pairs(groups: Mapping[Any, tuple[Any, Sequence[tuple[int, int]]]], device: str) -> None:
    """Collective: one tiny message on every (group, rank pair) that will carry point-to-point traffic, in one
    order every rank follows (groups in the mapping's order, pairs sorted), the lower rank sending.

    NCCL creates a pair's communicator on its first message and both ranks block there until the other arrives;
    the pipelines' streams interleave groups and pairs in rank-specific orders, so the communicators are made
    here, where a single global order makes the rendezvous deadlock-free. On gloo it costs a few messages."""
    import torch

    from rlhfuse import distributed

    me = distributed.rank()
    for group, pairs in groups.values():
        for lo, hi in pairs:
            if me == lo:
                distributed.isend(torch.zeros(1, device=device), hi, group=group).wait()
            elif me == hi:
                distributed.recv(torch.zeros(1, device=device), lo, group=group)


def build_process_groups(
    layout: ParallelLayout, timeout_s: float | None = None, groups: WorldGroups | None = None
) -> ProcessGroups:
    """Ask `groups` (the process's `WorldGroups` by default) for every group of the layout (collective: all ranks
    must call this, in the same order); keep this rank's."""
    from rlhfuse import distributed

    owner = groups if groups is not None else distributed.WorldGroups.current()
    me = distributed.rank()
    mine = layout.tp_rank(me)

    def group(key: tuple[Any, ...], ranks: tuple[int, ...] | list[int]) -> Any:
        return owner.group(("pipeline", *key), ranks, timeout_s)

    p2p = {
        (m, d, lo, hi): group(("p2p", m, d, lo, hi), (lo, hi))
        for m in layout.trained
        for d in DIRECTIONS
        for lo, hi in layout.p2p_pairs(m)
    }
    warm_up_pairs({key: (g, [key[2:]]) for key, g in p2p.items()}, layout.device)
    grad: dict[tuple[str, int], Any] = {}
    for (m, s, _), ranks in layout.tp_grad_groups.items():
        made = group(("tp-grad", m, s), ranks) if len(ranks) > 1 else None
        if me in ranks:
            grad[(m, s)] = made
    pipeline: dict[tuple[str, int, int], Any] = {}
    for key, ranks in layout.pipeline_groups.items():
        for t in range(layout.tp):
            made = group(("stages", *key, t), [layout.global_rank(v, t) for v in ranks])
            if t == mine:
                pipeline[key] = made
    dp = tuple(group(("data-parallel", i), ranks) for i, ranks in enumerate(layout.data_parallel_groups))
    tp_group = None
    if layout.tp > 1:
        for i, ranks in enumerate(layout.tp_groups):
            made = group(("tp", i), ranks)
            if me in ranks:
                tp_group = made
    # a merged model's tp groups (model_tp < tp): each sub-stage's consecutive model_tp ranks
    model_tp: dict[str, Any] = {}
    narrower: dict[int, Any] = {}
    for m in MODELS:
        t = layout.model_tp(m)
        if t == layout.tp:
            model_tp[m] = tp_group
            continue
        if t not in narrower:
            narrower[t] = None
            if t > 1:
                for i, ranks in enumerate(layout.model_tp_groups(m)):
                    made = group(("model-tp", t, i), ranks)
                    if me in ranks:
                        narrower[t] = made
        model_tp[m] = narrower[t]
    return ProcessGroups(p2p, grad, pipeline, dp, None, tp_group, layout.tp, model_tp)  # world None: default
