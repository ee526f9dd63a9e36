"""Schedule IR: actions, per-rank ordered lists, placement; string, JSON and CSV forms.

An `Action` is one unit of work of one model replica's pipeline stage. The planner emits only F and B today;
the other kinds are reserved for the runtime, which lowers a schedule into compute plus communication:
I / W (split backward: input gradient, then weight gradient), SEND / RECV (activations and gradients between
stages), REDUCE_GRAD (data-parallel gradient reduction) and OPTIMIZER_STEP.

Label forms:
  - compact (docs/schedule-format.md, stage implied by the placement): `actor.0:F3`
  - full (stage explicit, placement-free): `actor.0.s5:F3`
"""

from __future__ import annotations

import csv
import io
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from rlhfuse.pipeline.problem import Problem


class Kind(str, Enum):
    F = "F"
    B = "B"
    I = "I"  # noqa: E741 - split backward, input-gradient half (the paper's naming)
    W = "W"
    SEND = "SEND"
    RECV = "RECV"
    REDUCE_GRAD = "REDUCE_GRAD"
    OPTIMIZER_STEP = "OPTIMIZER_STEP"

    def __str__(self) -> str:
        return self.value


COMPUTE_KINDS = (Kind.F, Kind.B, Kind.I, Kind.W)

_LABEL = re.compile(
    r"^(?P<model>[^.:\s]+)\.(?P<replica>\d+)(?:\.s(?P<stage>\d+))?:(?P<kind>[A-Z_]+?)(?P<mb>\d+)?$"
)


@dataclass(frozen=True, order=True)
class Action:
    """One unit of work: `kind` for micro-batch `microbatch` on `stage` of `replica` of `model`."""

    model: str
    replica: int
    stage: int
    kind: Kind
    microbatch: int

    def label(self) -> str:
        """The docs/schedule-format.md label (stage implied by the placement): `actor.0:F3`."""
        return f"{self.model}.{self.replica}:{self.kind.value}{self.microbatch}"

    def __str__(self) -> str:
        return f"{self.model}.{self.replica}.s{self.stage}:{self.kind.value}{self.microbatch}"


def parse_action(text: str, placement: Placement | None = None, rank: int | None = None) -> Action:
    """Parse a full label, or a compact one given the placement and the rank it sits on."""
    match = _LABEL.match(text.strip())
    if not match:
        raise ValueError(
            f"cannot parse action {text!r}: expected MODEL.REPLICA:F<mb> or MODEL.REPLICA.s<stage>:F<mb>"
        )
    try:
        kind = Kind(match["kind"])
    except ValueError as err:
        raise ValueError(
            f"unknown action kind {match['kind']!r} in {text!r}: use one of {[k.value for k in Kind]}"
        ) from err
    model, replica = match["model"], int(match["replica"])
    mb = int(match["mb"]) if match["mb"] is not None else -1
    if match["stage"] is not None:
        stage = int(match["stage"])
    else:
        if placement is None or rank is None:
            raise ValueError(f"compact action {text!r} needs the placement and its rank to find the stage")
        stage = placement.stage_on(model, replica, rank, text)
    return Action(model, replica, stage, kind, mb)


@dataclass(frozen=True)
class Placement:
    """Where each pipeline stage runs: `(model, replica, stage) -> rank`."""

    ranks: int
    table: tuple[tuple[str, tuple[tuple[int, ...], ...]], ...]

    @classmethod
    def of(cls, problem: Problem) -> Placement:
        return cls(problem.ranks, tuple((m.name, m.placement) for m in problem.models))

    def rank(self, model: str, replica: int, stage: int) -> int:
        for name, rows in self.table:
            if name == model:
                return rows[replica][stage]
        raise KeyError(f"model {model!r} is not placed (placed: {[n for n, _ in self.table]})")

    def stages_on(self, rank: int) -> list[tuple[str, int, int]]:
        """The (model, replica, stage) triples placed on `rank`."""
        return [
            (name, r, s)
            for name, rows in self.table
            for r, row in enumerate(rows)
            for s, k in enumerate(row)
            if k == rank
        ]

    def stage_on(self, model: str, replica: int, rank: int, context: str = "") -> int:
        stages = [s for (m, r, s) in self.stages_on(rank) if m == model and r == replica]
        if len(stages) != 1:
            raise ValueError(
                f"action {context!r} on rank {rank}: {model}.{replica} has {len(stages)} stages on that rank "
                f"({stages}); use the full label MODEL.REPLICA.s<stage>:F<mb>"
            )
        return stages[0]


@dataclass(frozen=True)
class Schedule:
    """Per-rank ordered action lists: rank k runs `ranks[k]` in order."""

    ranks: tuple[tuple[Action, ...], ...]

    @classmethod
    def from_lists(cls, lists: Iterable[Iterable[Action]]) -> Schedule:
        return cls(tuple(tuple(rank) for rank in lists))

    def labels(self) -> list[list[str]]:
        """docs/schedule-format.md `ranks` value: compact labels per rank."""
        return [[a.label() for a in rank] for rank in self.ranks]

    def __str__(self) -> str:
        return "\n".join(
            f"rank {k:>3}: " + " ".join(a.label() for a in rank) for k, rank in enumerate(self.ranks)
        )

    def actions(self) -> Iterable[tuple[int, int, Action]]:
        for k, rank in enumerate(self.ranks):
            for i, a in enumerate(rank):
                yield k, i, a

    # --- JSON --------------------------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps({"ranks": [[str(a) for a in rank] for rank in self.ranks]})

    @classmethod
    def from_json(cls, text: str, placement: Placement | None = None) -> Schedule:
        return schedule_from_labels(json.loads(text)["ranks"], placement)

    # --- CSV: one row per action, as torchtitan / torch.distributed.pipelining load schedules ---------------
    def to_csv(self) -> str:
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(["rank", "step", "model", "replica", "stage", "kind", "microbatch"])
        for k, i, a in self.actions():
            writer.writerow([k, i, a.model, a.replica, a.stage, a.kind.value, a.microbatch])
        return out.getvalue()

    @classmethod
    def from_csv(cls, text: str) -> Schedule:
        rows = list(csv.DictReader(io.StringIO(text)))
        if not rows:
            return cls(())
        nranks = 1 + max(int(r["rank"]) for r in rows)
        lists: list[list[tuple[int, Action]]] = [[] for _ in range(nranks)]
        for r in rows:
            action = Action(
                r["model"], int(r["replica"]), int(r["stage"]), Kind(r["kind"]), int(r["microbatch"])
            )
            lists[int(r["rank"])].append((int(r["step"]), action))
        return cls(tuple(tuple(a for _, a in sorted(rank)) for rank in lists))


def schedule_from_labels(ranks: Sequence[Sequence[str]], placement: Placement | None = None) -> Schedule:
    """Parse docs/schedule-format.md `ranks` (compact labels need the placement) or full labels."""
    return Schedule(tuple(tuple(parse_action(t, placement, k) for t in rank) for k, rank in enumerate(ranks)))


def schedule_to_result(
    problem: Problem,
    schedule: Schedule,
    *,
    makespan: float,
    peak: float,
    lower_bound: float,
    serial: float,
    seconds: float,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The docs/schedule-format.md result object (keys exactly as written there), plus optional extra keys."""

    def plain(x: float) -> int | float:
        return int(x) if float(x).is_integer() else round(float(x), 6)

    out: dict[str, Any] = {
        "problem": problem.name,
        "makespan": plain(makespan),
        "peak_activation": round(float(peak), 6),
        "lower_bound": plain(lower_bound),
        "serial_1f1b": plain(serial),
        "search_seconds": round(seconds, 3),
        "ranks": schedule.labels(),
    }
    if extra:
        out.update(extra)
    return out
