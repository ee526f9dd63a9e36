"""Pure planning of a pipelined training step: profiled stage times -> `StepSchedule` (the schedule, its
lowered program and the predicted makespans). Nothing here touches a process group; the one collective choice
(rank 0 searches the fused schedule, the other ranks receive it) is passed in as `agree`.

Two planning functions, chosen once from the `pipeline` config name through `PLANNERS`:
    plan_fused        the fused Actor+Critic schedule (the paper's greedy, or annealing within a time budget)
    plan_serial_1f1b  the baseline: both models with 1F1B one after the other on the same ranks
An Actor-only layout (a critic-free algorithm: `ParallelLayout.trained == ("actor",)`) plans one model: both
run the Actor's 1F1B (nothing to fuse it with).
Before the profiling step there are no stage times: `unprofiled_plan` is serial 1F1B on unit durations.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from rlhfuse.pipeline import SearchConfig, greedy, serial_one_f_one_b, simulate, solve
from rlhfuse.pipeline.ir import Action, Schedule
from rlhfuse.pipeline.problem import Problem
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
    merged stages sum theirs in `problem`)."""

    microbatches: int
    forward: Mapping[str, tuple[float, ...]]
    backward: Mapping[str, tuple[float, ...]]

    @staticmethod
    def from_means(
        layout: ParallelLayout, microbatches: int, mean: Mapping[tuple[str, int, str], float]
    ) -> StageProfile:
        """From the mean seconds per (model, stage, "F" | "B") over every rank."""

        def times(kind: str) -> dict[str, tuple[float, ...]]:
            return {
                m: tuple(max(mean[(m, s, kind)], MIN_STAGE_SECONDS) for s in range(layout.stages(m)))
                for m in layout.trained
            }

        return StageProfile(microbatches, times("F"), times("B"))

    def problem(self, layout: ParallelLayout, microbatches: int) -> Problem:
        """The layout's problem with these stage times, scaled to `microbatches` micro-batches of the same
        mini-batch (a micro-batch's time taken as proportional to its share); a merged stage's time is the sum
        of its sub-stages' (`ParallelLayout.merge`)."""
        scale = self.microbatches / microbatches

        def merged(times: tuple[float, ...], model: str) -> list[float]:
            # a merged stage runs its sub-stages one after the other: its time is their sum
            out = [
                sum(times[s] for s in layout.sub_stages(model, i)) for i in range(layout.merged_stages(model))
            ]
            return [t * scale if scale != 1 else t for t in out]

        forward, backward = (
            {m: merged(times[m], m) for m in layout.trained} for times in (self.forward, self.backward)
        )
        layout = dataclasses.replace(layout, microbatches=microbatches)
        return layout.problem(forward=forward, backward=backward, name="profiled")

    def to_json(self) -> str:
        return json.dumps(
            {
                "microbatches": self.microbatches,
                "forward": {m: list(t) for m, t in self.forward.items()},
                "backward": {m: list(t) for m, t in self.backward.items()},
            }
        )

    @staticmethod
    def from_json(text: str) -> StageProfile:
        raw = json.loads(text)
        forward, backward = ({m: tuple(t) for m, t in raw[kind].items()} for kind in ("forward", "backward"))
        return StageProfile(int(raw["microbatches"]), forward, backward)


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


def unprofiled_plan(layout: ParallelLayout, microbatches: int, *, prefetch: int) -> StepSchedule:
    """Serial 1F1B on unit durations: the plan of the profiling step (no stage times yet)."""
    return lowered_plan(layout, microbatches, prefetch=prefetch)


def _serial_makespan(profiled: Problem) -> float:
    return simulate(profiled, serial_one_f_one_b(profiled)).makespan


@dataclass(frozen=True)
class PlanOptions:
    """prefetch: receives are posted this many compute ops before their consumer; search_budget_s: seconds of
    annealing for the fused schedule (0 = the paper's greedy)."""

    prefetch: int = 1
    search_budget_s: float = 0.0


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
    "the pipeline runs the Actor alone with 1F1B; inter-stage fusion (migration, early Ref/reward inference) is "
    "unchanged"
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
    """The baseline: serial 1F1B, with its makespan predicted from the profiled stage times (no search)."""
    serial = _serial_makespan(profile.problem(layout, microbatches))
    return lowered_plan(
        layout,
        microbatches,
        prefetch=options.prefetch,
        profile=profile,
        predicted_s=serial,
        predicted_serial_s=serial,
    )


def plan_fused(
    layout: ParallelLayout,
    profile: StageProfile,
    microbatches: int,
    options: PlanOptions,
    agree: Agree = here,
) -> StepSchedule:
    """The fused schedule searched on the profiled stage times (`options.search_budget_s` seconds of annealing,
    0 = the paper's greedy); `agree` makes every rank use the same one. An Actor-only layout (a critic-free
    algorithm) has no second model to fill the bubbles with: it runs the Actor's 1F1B (`plan_serial_1f1b`)."""
    if len(layout.trained) == 1:
        return dataclasses.replace(
            plan_serial_1f1b(layout, profile, microbatches, options, agree), note=ACTOR_ONLY_NOTE
        )
    profiled = profile.problem(layout, microbatches)
    serial = _serial_makespan(profiled)

    def search() -> Schedule:
        if options.search_budget_s > 0:
            return solve(profiled, SearchConfig(time_budget=options.search_budget_s)).schedule
        return greedy(profiled)

    schedule = agree(search)
    predicted = simulate(profiled, schedule).makespan
    note = (
        f"fused schedule from measured stage times ({microbatches} micro-batches): predicted "
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
