"""The fused-pipeline scheduling problem: models, their placement on ranks, durations and the memory cap.

A `Problem` is what the solver reads (docs/schedule-format.md, "Problem"): a few pipeline-parallel models
(the Actor and the Critic), each with `stages` stages and `replicas` replicas placed on `ranks` devices, each
replica running `microbatches` micro-batches of forward (F) then backward (B) work. Durations and activation
sizes may be one number for every stage (the FORMAT) or one per stage (measured by profiling the runtime).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Number = int | float


@dataclass(frozen=True)
class ModelSpec:
    """One pipeline-parallel model.

    Attributes:
        name: model name used in action labels (`actor`, `critic`).
        stages: pipeline stages of one replica.
        replicas: data-parallel replicas, each placed on its own block of ranks.
        microbatches: micro-batches run by *each* replica.
        forward: forward time of one micro-batch on stage s, one value per stage (any unit).
        backward: backward time of one micro-batch on stage s, one value per stage.
        activation: memory one in-flight micro-batch holds on stage s (added by F, freed by B).
        placement: placement[r][s] is the rank running stage s of replica r.
    """

    name: str
    stages: int
    replicas: int
    microbatches: int
    forward: tuple[float, ...]
    backward: tuple[float, ...]
    activation: tuple[float, ...]
    placement: tuple[tuple[int, ...], ...]

    def uniform(self) -> bool:
        """True when every stage has the same durations and activation (the FORMAT's scalar form)."""
        return len(set(self.forward)) == 1 and len(set(self.backward)) == 1 and len(set(self.activation)) == 1


@dataclass(frozen=True)
class Problem:
    """A fused pipeline problem.

    Attributes:
        name: free text, copied to the result's `problem` key.
        ranks: number of devices.
        models: the co-located models (usually the Actor and the Critic).
        memory_cap: hard limit on any rank's peak activation, or None for no limit.
        comm_latency: time added to every dependency between two different ranks (0 in the FORMAT's model).
        reference: published figures carried along for reports (ignored by solvers).
    """

    name: str
    ranks: int
    models: tuple[ModelSpec, ...]
    memory_cap: float | None = None
    comm_latency: float = 0.0
    reference: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def model(self, name: str) -> ModelSpec:
        for spec in self.models:
            if spec.name == name:
                return spec
        raise KeyError(f"no model named {name!r} in problem {self.name!r} (models: {self.model_names()})")

    def model_names(self) -> list[str]:
        return [spec.name for spec in self.models]

    def rank_of(self, model: str, replica: int, stage: int) -> int:
        return self.model(model).placement[replica][stage]

    def to_dict(self) -> dict[str, Any]:
        """The docs/schedule-format.md problem object (scalars where a model is uniform over its stages)."""

        def compact(values: tuple[float, ...]) -> Number | list[Number]:
            plain = [_plain_number(v) for v in values]
            return plain[0] if len(set(plain)) == 1 else plain

        out: dict[str, Any] = {
            "name": self.name,
            "ranks": self.ranks,
            "models": [
                {
                    "name": m.name,
                    "stages": m.stages,
                    "replicas": m.replicas,
                    "microbatches": m.microbatches,
                    "forward": compact(m.forward),
                    "backward": compact(m.backward),
                    "activation": compact(m.activation),
                    "placement": [list(p) for p in m.placement],
                }
                for m in self.models
            ],
            "memory_cap": self.memory_cap,
        }
        if self.comm_latency:
            out["comm_latency"] = self.comm_latency
        if self.reference:
            out["reference"] = dict(self.reference)
        return out


def _plain_number(value: float) -> Number:
    return int(value) if float(value).is_integer() else float(value)


def _per_stage(
    raw: Any, stages: int, where: str, problems: list[str], *, positive: bool
) -> tuple[float, ...]:
    values: list[Any]
    if isinstance(raw, bool) or raw is None:
        problems.append(f"{where} must be a number or a list of {stages} numbers (got {raw!r})")
        return (1.0,) * max(stages, 1)
    if isinstance(raw, int | float):
        values = [raw] * stages
    elif isinstance(raw, list):
        values = raw
        if len(values) != stages:
            problems.append(
                f"{where} has {len(values)} per-stage values but stages={stages}: give one number or {stages}"
            )
            return (1.0,) * max(stages, 1)
    else:
        problems.append(f"{where} must be a number or a list of {stages} numbers (got {raw!r})")
        return (1.0,) * max(stages, 1)
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, int | float):
            problems.append(f"{where}[{i}] must be a number (got {v!r})")
            v = 1.0
        elif v < 0 or (positive and v == 0):
            problems.append(f"{where}[{i}] must be {'> 0' if positive else '>= 0'} (got {v})")
        out.append(float(v))
    return tuple(out)


def _int_field(raw: Mapping[str, Any], key: str, where: str, problems: list[str], minimum: int = 1) -> int:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        problems.append(f"{where}.{key} must be an integer >= {minimum} (got {value!r})")
        return minimum
    if value < minimum:
        problems.append(f"{where}.{key} must be >= {minimum} (got {value})")
        return minimum
    return value


def problem_from_dict(raw: Mapping[str, Any]) -> Problem:
    """Build and validate a Problem from the docs/schedule-format.md JSON object.

    All problems are collected and raised as one ValueError naming each key, the value seen and the fix.
    """
    problems: list[str] = []
    if not isinstance(raw, Mapping):
        raise ValueError(f"a problem must be a JSON object (got {type(raw).__name__})")
    name = raw.get("name", "unnamed")
    ranks = _int_field(raw, "ranks", "problem", problems)
    models_raw = raw.get("models")
    if not isinstance(models_raw, list) or not models_raw:
        problems.append(f"problem.models must be a non-empty list of model objects (got {models_raw!r})")
        models_raw = []
    models: list[ModelSpec] = []
    seen: dict[tuple[str, int, int], int] = {}
    for i, m in enumerate(models_raw):
        where = f"models[{i}]"
        if not isinstance(m, Mapping):
            problems.append(f"{where} must be an object (got {m!r})")
            continue
        mname = m.get("name")
        if not isinstance(mname, str) or not mname or any(c in mname for c in ".: ,"):
            problems.append(
                f"{where}.name must be a non-empty string without '.', ':', ',' or spaces (got {mname!r})"
            )
            mname = f"model{i}"
        where = f"models[{i}] ({mname})"
        stages = _int_field(m, "stages", where, problems)
        replicas = _int_field(m, "replicas", where, problems)
        micro = _int_field(m, "microbatches", where, problems)
        fwd = _per_stage(m.get("forward"), stages, f"{where}.forward", problems, positive=True)
        bwd = _per_stage(m.get("backward"), stages, f"{where}.backward", problems, positive=True)
        act = _per_stage(m.get("activation", 0.0), stages, f"{where}.activation", problems, positive=False)
        placement_raw = m.get("placement")
        placement: list[tuple[int, ...]] = []
        if not isinstance(placement_raw, list) or len(placement_raw) != replicas:
            problems.append(
                f"{where}.placement must list {replicas} replica(s), each a list of {stages} ranks "
                f"(got {placement_raw!r})"
            )
        else:
            used_by: dict[int, int] = {}
            for r, row in enumerate(placement_raw):
                if not isinstance(row, list) or len(row) != stages:
                    problems.append(f"{where}.placement[{r}] must be a list of {stages} ranks (got {row!r})")
                    continue
                for s, rank in enumerate(row):
                    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < ranks:
                        problems.append(
                            f"{where}.placement[{r}][{s}] must be a rank in 0..{ranks - 1} (got {rank!r}); "
                            "raise problem.ranks or fix the placement"
                        )
                    else:
                        # Two stages of one replica on one rank is interleaved 1F1B: allowed; two replicas of
                        # one model on one rank contradict the data-parallel layout (one block per replica).
                        other = used_by.setdefault(rank, r)
                        if other != r:
                            problems.append(
                                f"{where}.placement[{r}][{s}] puts replica {r} on rank {rank}, which replica "
                                f"{other} already uses: give each replica its own ranks"
                            )
                        seen[(mname, r, rank)] = s
                placement.append(tuple(int(x) if isinstance(x, int) else 0 for x in row))
        if any(m2.name == mname for m2 in models):
            problems.append(f"{where}.name {mname!r} is used twice: give each model its own name")
        models.append(
            ModelSpec(mname, stages, replicas, micro, fwd, bwd, act, tuple(placement) or ((0,) * stages,))
        )
    cap = raw.get("memory_cap")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int | float) or cap <= 0):
        problems.append(f"problem.memory_cap must be null or a number > 0 (got {cap!r})")
        cap = None
    latency = raw.get("comm_latency", 0.0)
    if isinstance(latency, bool) or not isinstance(latency, int | float) or latency < 0:
        problems.append(f"problem.comm_latency must be a number >= 0 (got {latency!r})")
        latency = 0.0
    if problems:
        raise ValueError(f"invalid problem {name!r}:\n  - " + "\n  - ".join(problems))
    problem = Problem(
        name=str(name),
        ranks=ranks,
        models=tuple(models),
        memory_cap=None if cap is None else float(cap),
        comm_latency=float(latency),
        reference=dict(raw.get("reference") or {}),
    )
    _check_cap(problem)
    return problem


def min_feasible_cap(problem: Problem) -> float:
    """The least memory cap some schedule meets: the largest activation one micro-batch holds on one rank.

    A micro-batch's F on stage s holds its activation until its B on stage s, and every later stage's F and B
    of that micro-batch run in between; so a rank running several stages of one replica holds all of them at
    once, whatever the schedule. Running every micro-batch alone (all F, then all B, one micro-batch at a
    time) holds nothing more, so this is also enough.
    """
    need = 0.0
    for m in problem.models:
        for row in m.placement:
            per_rank: dict[int, float] = {}
            for s, rank in enumerate(row):
                per_rank[rank] = per_rank.get(rank, 0.0) + m.activation[s]
            need = max(need, max(per_rank.values(), default=0.0))
    return need


def _check_cap(problem: Problem) -> None:
    """A cap below what one micro-batch holds on some rank can never be met: say so before any search."""
    if problem.memory_cap is None:
        return
    need = min_feasible_cap(problem)
    if need > problem.memory_cap + 1e-9:
        raise ValueError(
            f"invalid problem {problem.name!r}: memory_cap={problem.memory_cap} is below {need:g}, the "
            "activation one micro-batch holds on one rank (all the stages of one replica placed there), so no "
            f"schedule can meet it; raise memory_cap to at least {need:g} or set it to null"
        )


def load_problem(path: str | Path) -> Problem:
    """Read one docs/schedule-format.md problem from a JSON file."""
    with open(path) as fh:
        return problem_from_dict(json.load(fh))


def load_problems(path: str | Path) -> list[Problem]:
    """Read a file holding one problem, a list of problems, or `{"problems": [...]}` (table3.json)."""
    with open(path) as fh:
        raw = json.load(fh)
    if isinstance(raw, Mapping) and "problems" in raw:
        raw = raw["problems"]
    if isinstance(raw, list):
        return [problem_from_dict(p) for p in raw]
    return [problem_from_dict(raw)]


def reversed_blocks(ranks: int, stages: int) -> list[list[int]]:
    """The FORMAT's placement of a smaller model: ranks // stages replicas, each reversed over its block."""
    if ranks % stages:
        raise ValueError(f"stages={stages} must divide ranks={ranks} to place reversed replicas in blocks")
    return [list(range(b * stages + stages - 1, b * stages - 1, -1)) for b in range(ranks // stages)]


def make_problem(
    models: Sequence[Mapping[str, Any]],
    *,
    ranks: int | None = None,
    name: str = "runtime",
    memory_cap: float | None = None,
    comm_latency: float = 0.0,
) -> Problem:
    """Build a Problem from runtime parameters (what a trainer knows before planning).

    Each entry of `models` has `name`, `stages`, `microbatches` (per replica), `forward`, `backward` (a number,
    or a list with one measured time per stage from profiling), optional `activation` (number or per stage),
    optional `replicas` and `placement`. The first model defaults to ranks 0..S-1 in order; later models
    default to the paper's heterogeneous mapping: ranks // stages replicas, each reversed over its block.
    """
    if not models:
        raise ValueError("make_problem needs at least one model")
    ranks = ranks if ranks is not None else max(int(m["stages"]) for m in models)
    raw_models = []
    for i, m in enumerate(models):
        stages = int(m["stages"])
        entry = dict(m)
        if "placement" not in entry:
            if i == 0 and stages == ranks:
                entry["placement"] = [list(range(stages))]
            else:
                entry["placement"] = reversed_blocks(ranks, stages)
        entry.setdefault("replicas", len(entry["placement"]))
        entry.setdefault("activation", 1.0)
        for key in ("forward", "backward", "activation"):
            if not isinstance(entry[key], int | float):
                entry[key] = list(entry[key])
        raw_models.append(entry)
    return problem_from_dict(
        {
            "name": name,
            "ranks": ranks,
            "models": raw_models,
            "memory_cap": memory_cap,
            "comm_latency": comm_latency,
        }
    )


def scale_check_problem(ranks: int = 64) -> Problem:
    """The scale check of the schedule search: a 65B/33B-like Actor of `ranks` stages and two reversed Critic
    replicas of `ranks // 2` stages (the Table-3 16/8 shape, widened), one micro-batch per Actor stage."""
    return make_problem(
        [
            {
                "name": "actor",
                "stages": ranks,
                "microbatches": ranks,
                "forward": 2,
                "backward": 4,
                "activation": 1.64,
            },
            {
                "name": "critic",
                "stages": ranks // 2,
                "microbatches": ranks // 2,
                "forward": 2,
                "backward": 4,
                "activation": 2.0,
            },
        ],
        name=f"dry-run {ranks} ranks pp{ranks}/{ranks // 2} mb{ranks}",
    )
