"""Pure planning of a pipelined training step: profiled stage times -> `StepSchedule` (the schedule, its
lowered program and the predicted makespans). Nothing here touches a process group; the one collective choice
(rank 0 searches the fused schedule, the other ranks receive it) is passed in as `agree`.

Two planning functions, chosen once from the `pipeline` config name through `PLANNERS`:
    plan_fused        the fused Actor+Critic schedule (the paper's greedy, or annealing within a time budget)
    plan_serial_1f1b  the baseline: both models with 1F1B one after the other on the same ranks
An Actor-only layout (a critic-free algorithm: `ParallelLayout.trained == ("actor",)`) plans one model: both
run the Actor's 1F1B, or ZB-H1 with split backward (nothing to fuse it with).
Before the profiling step there are no stage times: `unprofiled_plan` is serial 1F1B on unit durations.

Split backward (`pipeline.split_backward`, `PlanOptions.split_backward`): each planner plans F/B, F/I/W (B split
into I, the input gradient, and W, the weight gradient: the zero-bubble split), or with "auto" both, and keeps
the one with the shorter predicted makespan (F/B on a tie): the fused search's F/I/W schedule, or for serial 1F1B
(and an Actor alone) each model's ZB-H1 (`serial_schedule`). F/I/W is predicted from measured I and W times: the
profiling step then runs its odd micro-batches' backwards split (`profiling_schedule`), so one step measures F,
B, I and W of every stage.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from rlhfuse.pipeline import SearchConfig, greedy, serial_one_f_one_b, simulate, solve, split_each_backward
from rlhfuse.pipeline.baselines import combine
from rlhfuse.pipeline.ir import Action, Kind, Schedule
from rlhfuse.pipeline.problem import Problem
from rlhfuse.pipeline.simulate import SPLIT_INPUT_SHARE, DurationFn, SplitBackward, is_split
from rlhfuse.pipeline.zero_bubble import zb_h1
from rlhfuse.runtime.layout import ParallelLayout
from rlhfuse.runtime.lower import Program, lower_checked

# Runs a schedule search where it must run (rank 0) and returns the schedule every rank uses.
Agree = Callable[[Callable[[], Schedule]], Schedule]

# Profiled stage times below this (seconds) are raised to it: the planner needs positive durations.
MIN_STAGE_SECONDS = 1e-6


def here(search: Callable[[], Schedule]) -> Schedule:
    """`Agree` for one process: run the search here."""
    return search()


@dataclass(frozen=True)
class StageProfile:
    """Per-micro-batch seconds of every stage, measured on the profiling step (which ran `microbatches`
    micro-batches per group): `forward[model][stage]`, `backward[model][stage]` (stage: 0 .. pp - 1, the modules;
    merged stages sum theirs in `problem`), and, where the profiling step split backwards, `backward_input` and
    `backward_weight` (I and W; empty: not measured, each taken as its share `SPLIT_INPUT_SHARE` of B)."""

    microbatches: int
    forward: Mapping[str, tuple[float, ...]]
    backward: Mapping[str, tuple[float, ...]]
    backward_input: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    backward_weight: Mapping[str, tuple[float, ...]] = field(default_factory=dict)

    @staticmethod
    def from_means(
        layout: ParallelLayout, microbatches: int, mean: Mapping[tuple[str, int, str], float]
    ) -> StageProfile:
        """From the mean seconds per (model, stage, "F" | "B" | "I" | "W") over every rank (I and W: a model's
        where every stage has them)."""

        def times(kind: str) -> dict[str, tuple[float, ...]]:
            return {
                m: tuple(max(mean[(m, s, kind)], MIN_STAGE_SECONDS) for s in range(layout.stages(m)))
                for m in layout.trained
                if all((m, s, kind) in mean for s in range(layout.stages(m)))
            }

        return StageProfile(microbatches, times("F"), times("B"), times("I"), times("W"))

    def durations(self, layout: ParallelLayout, microbatches: int) -> DurationFn:
        """Each op's predicted seconds on `problem(layout, microbatches)`'s merged stages: F and B as there, I and
        W measured (scaled and merged alike), or B's `SPLIT_INPUT_SHARE` and the rest where not measured."""
        profiled = self.problem(layout, microbatches)
        split = {
            (m, kind): self._merged(layout, microbatches, m, times[m])
            for kind, times in ((Kind.I, self.backward_input), (Kind.W, self.backward_weight))
            for m in times
        }

        def duration(a: Action) -> float:
            spec = profiled.model(a.model)
            if a.kind is Kind.F:
                return spec.forward[a.stage]
            if (a.model, a.kind) in split:
                return split[(a.model, a.kind)][a.stage]
            share = {Kind.I: SPLIT_INPUT_SHARE, Kind.W: 1.0 - SPLIT_INPUT_SHARE}.get(a.kind, 1.0)
            return spec.backward[a.stage] * share

        return duration

    def _merged(
        self, layout: ParallelLayout, microbatches: int, model: str, times: tuple[float, ...]
    ) -> list[float]:
        """Per merged stage: the sum of its sub-stages' times, scaled to `microbatches` micro-batches of the same
        mini-batch (a micro-batch's time taken as proportional to its share)."""
        scale = self.microbatches / microbatches
        out = [sum(times[s] for s in layout.sub_stages(model, i)) for i in range(layout.merged_stages(model))]
        return [t * scale if scale != 1 else t for t in out]

    def problem(self, layout: ParallelLayout, microbatches: int) -> Problem:
        """The layout's problem with these stage times, scaled to `microbatches` micro-batches of the same
        mini-batch (a micro-batch's time taken as proportional to its share); a merged stage's time is the sum
        of its sub-stages' (`ParallelLayout.merge`)."""
        # a merged stage runs its sub-stages one after the other: its time is their sum
        forward, backward = (
            {m: self._merged(layout, microbatches, m, times[m]) for m in layout.trained}
            for times in (self.forward, self.backward)
        )
        layout = dataclasses.replace(layout, microbatches=microbatches)
        return layout.problem(forward=forward, backward=backward, name="profiled")

    def to_json(self) -> str:
        kinds = ("forward", "backward", "backward_input", "backward_weight")
        return json.dumps(
            {"microbatches": self.microbatches}
            | {kind: {m: list(t) for m, t in getattr(self, kind).items()} for kind in kinds}
        )

    @staticmethod
    def from_json(text: str) -> StageProfile:
        raw = json.loads(text)
        forward, backward, backward_input, backward_weight = (
            {m: tuple(t) for m, t in raw.get(kind, {}).items()}
            for kind in ("forward", "backward", "backward_input", "backward_weight")
        )
        return StageProfile(int(raw["microbatches"]), forward, backward, backward_input, backward_weight)


@dataclass(frozen=True)
class StepSchedule:
    """What one training step runs, and what the planner predicted for it.

    microbatches: per data-parallel group; problem: the layout's scheduling problem for that count (unit
    durations: it fixes the ops, messages and placement the executor runs); schedule: every rank's order of
    ops; program: the schedule lowered to per-rank instruction streams (checked free of deadlock); profiled:
    the problem with the profiled stage times (None before profiling); predicted_s / predicted_serial_s: the
    simulated makespans of this schedule and of serial 1F1B with those times (nan before profiling); note: what
    the planner reports (empty: nothing to log).
    """

    microbatches: int
    problem: Problem
    schedule: Schedule
    program: Program
    profiled: Problem | None = None
    predicted_s: float = math.nan
    predicted_serial_s: float = math.nan
    note: str = ""


def lowered_plan(
    layout: ParallelLayout,
    microbatches: int,
    schedule: Schedule | None = None,
    *,
    prefetch: int,
    profile: StageProfile | None = None,
    predicted_s: float = math.nan,
    predicted_serial_s: float = math.nan,
    note: str = "",
) -> StepSchedule:
    """`schedule` (default serial 1F1B) for `microbatches` micro-batches, lowered and checked."""
    problem = dataclasses.replace(layout, microbatches=microbatches).problem()
    schedule = schedule if schedule is not None else serial_one_f_one_b(problem)
    program = lower_checked(problem, schedule, dp=layout.dp, prefetch=prefetch)
    profiled = profile.problem(layout, microbatches) if profile is not None else None
    return StepSchedule(
        microbatches, problem, schedule, program, profiled, predicted_s, predicted_serial_s, note
    )


def profiling_schedule(problem: Problem, split_backward: SplitBackward = False) -> Schedule:
    """Serial 1F1B; unless `split_backward` is False, with the backward of every odd micro-batch split into its I
    then its W in place, so that the one profiling step measures F, B, I and W of every stage (a model with one
    micro-batch per replica runs plain B: its I and W are then taken as shares of B)."""
    schedule = serial_one_f_one_b(problem)
    if split_backward is False:
        return schedule
    return split_each_backward(schedule, lambda a: a.microbatch % 2 == 1)


def unprofiled_plan(
    layout: ParallelLayout, microbatches: int, *, prefetch: int, split_backward: SplitBackward = False
) -> StepSchedule:
    """The plan of the profiling step (no stage times yet): `profiling_schedule` on unit durations."""
    problem = dataclasses.replace(layout, microbatches=microbatches).problem()
    return lowered_plan(layout, microbatches, profiling_schedule(problem, split_backward), prefetch=prefetch)


def serial_schedule(problem: Problem, split_backward: bool) -> Schedule:
    """Each model alone, one after the other on the same ranks: with 1F1B, or with split backward ZB-H1 (Qi et
    al., ICLR'24: 1F1B whose W's are deferred into the cool-down bubbles, at 1F1B's peak memory)."""
    if not split_backward:
        return serial_one_f_one_b(problem)
    return combine([zb_h1(problem, m.name) for m in problem.models])


def _serial_makespan(profiled: Problem, durations: DurationFn) -> float:
    return simulate(profiled, serial_one_f_one_b(profiled), durations).makespan


@dataclass(frozen=True)
class PlanOptions:
    """prefetch: receives are posted this many compute ops before their consumer; search_budget_s: seconds of
    annealing for the fused schedule (0 = the paper's greedy; shared between F/B and F/I/W under "auto");
    split_backward: plan F/B (False), F/I/W (True) or both, keeping the shorter prediction ("auto")."""

    prefetch: int = 1
    search_budget_s: float = 0.0
    split_backward: SplitBackward = False

    def split_choices(self) -> tuple[bool, ...]:
        """The backward forms to plan, F/B first (it wins a tie)."""
        if self.split_backward == "auto":
            return (False, True)
        return (bool(self.split_backward),)


def _form(schedule: Schedule) -> str:
    """How a plan's note names the schedule's backward form."""
    return "F/I/W (split backward)" if is_split(schedule) else "F/B"


def _shortest(
    profiled: Problem, durations: DurationFn, candidates: list[Schedule]
) -> tuple[Schedule, float, str]:
    """The candidate with the shortest predicted makespan (the first on a tie), its makespan, and a note comparing
    F/B and F/I/W when both were planned."""
    spans = [simulate(profiled, c, durations).makespan for c in candidates]
    forms = [_form(c) for c in candidates]
    best = min(range(len(candidates)), key=lambda i: spans[i])
    if len(candidates) == 1:
        return candidates[best], spans[best], forms[best]
    other = 1 - best
    note = f"{forms[best]}, the {forms[other]} one predicted {spans[other] * 1e3:.1f} ms"
    return candidates[best], spans[best], note


class Planner(Protocol):
    """A planning function: the plan for `microbatches` micro-batches per group from the profiled stage times."""

    def __call__(
        self,
        layout: ParallelLayout,
        profile: StageProfile,
        microbatches: int,
        options: PlanOptions,
        agree: Agree = ...,
    ) -> StepSchedule: ...


# what pipeline=fused runs with one trained model (logged by the strategy, also the validation's auto-resolution)
ACTOR_ONLY_RUN = (
    "the pipeline runs the Actor alone with 1F1B (or ZB-H1, split backward); inter-stage fusion (migration, early "
    "Ref/reward inference) is unchanged"
)
ACTOR_ONLY_NOTE = (
    f"intra-stage fusion needs two models (Actor and Critic); with a critic-free algorithm {ACTOR_ONLY_RUN}"
)


def plan_serial_1f1b(
    layout: ParallelLayout,
    profile: StageProfile,
    microbatches: int,
    options: PlanOptions,
    agree: Agree = here,
) -> StepSchedule:
    """The baseline: serial 1F1B, or with split backward per-model ZB-H1 one model after the other
    (`serial_schedule`, per `options.split_backward`), with its makespan predicted from the profiled stage times
    (no search)."""
    profiled = profile.problem(layout, microbatches)
    durations = profile.durations(layout, microbatches)
    candidates = [serial_schedule(profiled, split) for split in options.split_choices()]
    schedule, predicted, form = _shortest(profiled, durations, candidates)
    serial_s = _serial_makespan(profiled, durations)
    note = f"serial 1F1B {form}" if options.split_backward is not False else ""
    return lowered_plan(
        layout,
        microbatches,
        schedule,
        prefetch=options.prefetch,
        profile=profile,
        predicted_s=predicted,
        predicted_serial_s=serial_s,
        note=note,
    )


def plan_fused(
    layout: ParallelLayout,
    profile: StageProfile,
    microbatches: int,
    options: PlanOptions,
    agree: Agree = here,
) -> StepSchedule:
    """The fused schedule searched on the profiled stage times (`options.search_budget_s` seconds of annealing,
    0 = the paper's greedy), F/B, F/I/W or the shorter of both (`options.split_backward`); `agree` makes every
    rank use the same one. An Actor-only layout (a critic-free algorithm) has no second model to fill the bubbles
    with: it runs the Actor's 1F1B (`plan_serial_1f1b`)."""
    if len(layout.trained) == 1:
        plan = plan_serial_1f1b(layout, profile, microbatches, options, agree)
        return dataclasses.replace(plan, note=f"{ACTOR_ONLY_NOTE}{'; ' + plan.note if plan.note else ''}")
    profiled = profile.problem(layout, microbatches)
    durations = profile.durations(layout, microbatches)
    serial = _serial_makespan(profiled, durations)
    choices = options.split_choices()
    budget = options.search_budget_s / len(choices)

    compared: list[str] = []  # where the search ran: the F/B vs F/I/W comparison under "auto"

    def search() -> Schedule:
        candidates = []
        for split in choices:
            if budget > 0:
                config = SearchConfig(time_budget=budget, split_backward=split)
                candidates.append(solve(profiled, config, durations).schedule)
            else:
                candidates.append(greedy(profiled, durations, split_backward=split))
        best, _, form = _shortest(profiled, durations, candidates)
        compared.append(form)
        return best

    schedule = agree(search)
    predicted = simulate(profiled, schedule, durations).makespan
    form = compared[0] if compared else _form(schedule)
    note = (
        f"fused schedule from measured stage times ({microbatches} micro-batches), {form}: predicted "
        f"{predicted * 1e3:.1f} ms vs serial 1F1B {serial * 1e3:.1f} ms per mini-batch ({serial / predicted:.2f}x)"
    )
    return lowered_plan(
        layout,
        microbatches,
        schedule,
        prefetch=options.prefetch,
        profile=profile,
        predicted_s=predicted,
        predicted_serial_s=serial,
        note=note,
    )


PLANNERS: dict[str, Planner] = {"fused": plan_fused, "serial_1f1b": plan_serial_1f1b}


def planner_for(name: str) -> Planner:
    """The planning function of `pipeline=<name>`."""
    if name not in PLANNERS:
        raise ValueError(f"schedule={name!r} is not one of {list(PLANNERS)}")
    return PLANNERS[name]


def replay(plan: StepSchedule, action_seconds: Mapping[Action, float]) -> float:
    """The makespan the simulator gives `plan`'s schedule with each op's own measured seconds."""
    assert plan.profiled is not None, "replay needs a profiled plan"
    return simulate(plan.profiled, plan.schedule, durations=lambda a: action_seconds[a]).makespan
