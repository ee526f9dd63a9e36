"""Rt auto-tuning (docs/paper.md §2): simulate generation + inference for each Rt on this machine's measured costs and
the response lengths seen so far, and keep the fastest, or Rt = 0 (off) when none beats the serial rollout.

The simulator is the planner's, the one `rlhfuse-plan` runs at paper scale (`rlhfuse.planner.plan_simulator.gen_inf`
/ `gen_inf_sweep`), fed by `rlhfuse.planner.measured.MeasuredCosts`: a `CostProfile` measured on the running
engines (decode steps, prefill, and on fused runs the inference calls, the lockstep synchronisation and the
migration) instead of the cost model's datasheet figures. There is no second copy of the timeline here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from rlhfuse.generation.migration import BatchObservation, resolve_threshold
from rlhfuse.planner.lengths import LengthDistribution
from rlhfuse.planner.measured import CostProfile, MeasuredCosts
from rlhfuse.planner.plan_simulator import (
    RT_FRACTIONS,
    GenInfResult,
    Samples,
    gen_inf,
    gen_inf_sweep,
    unmigrated_generation,
)

__all__ = ["AutoThreshold", "CostProfile", "SimResult", "predicted_speedup", "rt_sweep", "simulate"]


@dataclass(frozen=True)
class SimResult:
    """Predicted seconds: generation end, last inference output (Gen+Inf), and what migration did."""

    generation_s: float
    gen_inf_s: float
    moved: int = 0
    destinations: int = 0

    @classmethod
    def of(cls, result: GenInfResult) -> SimResult:
        decision = result.generation.decision
        return cls(
            result.generation.end,
            result.end,
            0 if decision is None else decision.moved,
            0 if decision is None else decision.m,
        )


def _samples(lengths: Sequence[int], prompt_len: int) -> Samples:
    n = len(lengths)
    return Samples(np.full(n, prompt_len, dtype=np.int64), np.asarray(lengths, dtype=np.int64))


def simulate(
    lengths: Sequence[int],
    prompt_len: int,
    instances: int,
    rt: int,
    profile: CostProfile,
    *,
    bs_max: int,
    slots: int,
) -> SimResult:
    """One batch of responses of `lengths` tokens on `instances` instances (sample i on instance i mod
    instances); `rt` = 0 (or >= the batch): no migration (generate, then infer)."""
    costs = MeasuredCosts(profile, instances, bs_max, slots)
    samples = _samples(lengths, prompt_len)
    fused = 0 < rt < len(lengths)
    return SimResult.of(gen_inf(costs, samples, rt if fused else None))


def rt_sweep(
    distribution: LengthDistribution,
    *,
    batch: int,
    cap: int,
    prompt_len: int,
    instances: int,
    profile: CostProfile,
    bs_max: int,
    slots: int,
    fractions: Sequence[float] = RT_FRACTIONS,
    seed: int = 0,
) -> tuple[list[tuple[int, SimResult]], SimResult]:
    """(Rt, prediction) for each distinct Rt of `fractions`, and the serial prediction, on one stratified batch."""
    samples = _samples(distribution.sample(batch, cap, np.random.default_rng(seed)).tolist(), prompt_len)
    costs = MeasuredCosts(profile, instances, bs_max, slots)
    serial = SimResult.of(gen_inf(costs, samples, None, base=unmigrated_generation(costs, samples)))
    sweep = gen_inf_sweep(costs, samples, tuple(fractions))
    return [(r.rt or 0, SimResult.of(r)) for _, r in sweep], serial


_TIE = 1e-12  # relative: far below any measured cost difference, far above float rounding
MIN_GAIN = 0.02
"""migration=auto migrates only for a predicted gain above 2% of the serial Gen+Inf (below that the prediction's
error and the unmodelled costs of a fused run decide, and Rt = 0 costs nothing)."""
CHECK_EVERY = 4
"""migration=auto runs the other mode once every this many iterations (an Rt = 0 iteration while it migrates, the
sweep's Rt while it does not), so both are measured on this machine as it is now."""


@dataclass
class MeasuredRatio:
    """Seconds a mode took on real batches, each over what the simulator predicts the *serial* rollout of that
    batch takes (a per-batch yardstick: batches differ in lengths), the last `window` of them."""

    window: int
    ratios: list[float] = field(default_factory=list)

    def add(self, ratio: float) -> None:
        self.ratios = [*self.ratios, ratio][-self.window :]

    @property
    def median(self) -> float | None:
        return float(np.median(self.ratios)) if self.ratios else None


class AutoThreshold:
    """migration=auto: Rt from `rt_sweep` on the lengths of the last `window` iterations and measured costs
    (0 = off when the best Rt is not predicted to beat the serial rollout by `min_gain`); `initial` (a count or
    fraction) until there are lengths and costs. The fused-run costs (lockstep, migration, inference) are kept
    from the last fused iteration while Rt = 0 iterations measure only decoding. `last` holds the latest
    sweep's choice and predictions.

    The prediction is then checked against measurement: every batch's measured seconds, over the simulator's
    serial prediction for that batch, are kept for migrating (Rt > 0) and for Rt = 0 iterations; when both were
    measured and migrating did not measure at least `min_gain` faster, Rt = 0, whatever the sweep says. Once
    every `check_every` iterations the other mode runs, so a machine whose load changed is noticed; the worst
    case against `migration=off` is one migrating iteration after every `check_every` off."""

    def __init__(
        self,
        initial: float,
        *,
        instances: int,
        bs_max: int,
        window: int = 4,
        min_gain: float = MIN_GAIN,
        check_every: int = CHECK_EVERY,
    ) -> None:
        self.initial = initial
        self.instances = instances
        self.bs_max = bs_max
        self.window = window
        self.min_gain = min_gain
        self.check_every = check_every
        self.history: list[list[int]] = []
        self.profile: CostProfile | None = None
        self.prompt_len = 1
        self.cap = 1
        self.slots = 1
        self.chosen: int | None = None
        self.predicted: SimResult | None = None
        self.predicted_serial: SimResult | None = None
        self.migrating = MeasuredRatio(window)  # measured / predicted serial, Rt > 0 iterations
        self.serial = MeasuredRatio(window)  # the same, Rt = 0 iterations
        self.since_check = 0  # iterations run in the chosen mode since the other one last ran
        self.overruled = False  # the measurements turned the sweep's Rt down

    def threshold(self, batch_size: int) -> int:
        if self.chosen is None:
            return resolve_threshold(self.initial, batch_size)
        return min(self.chosen, batch_size - 1) if batch_size > 1 else 0

    def _merge(self, new: CostProfile | None) -> CostProfile | None:
        """The new decode/prefill figures; fused-run figures only where the new batch measured them."""
        old = self.profile
        if new is None or old is None:
            return new or old
        keep = old.inference_measured and not new.inference_measured
        return replace(
            new,
            lockstep_s=new.lockstep_s or old.lockstep_s,
            migration_s=new.migration_s or old.migration_s,
            inference_s_per_token=old.inference_s_per_token if keep else new.inference_s_per_token,
            inference_measured=new.inference_measured or old.inference_measured,
        )

    def _measure(self, batch: BatchObservation) -> None:
        """File the batch's measured seconds against the simulator's serial prediction for its lengths."""
        if batch.measured_s is None or self.profile is None or len(batch.response_lengths) < 2:
            return
        serial = simulate(
            batch.response_lengths, self.prompt_len, self.instances, 0, self.profile,
            bs_max=self.bs_max, slots=self.slots,
        )  # fmt: skip
        yardstick = serial.gen_inf_s if batch.fused else serial.generation_s
        if yardstick > 0:
            (self.migrating if batch.rt > 0 else self.serial).add(batch.measured_s / yardstick)

    def pays(self) -> bool | None:
        """Whether migrating measured at least `min_gain` faster than Rt = 0 (None: not both measured yet)."""
        migrating, serial = self.migrating.median, self.serial.median
        if migrating is None or serial is None:
            return None
        return migrating * (1 + self.min_gain) < serial

    def observe(self, batch: BatchObservation) -> None:
        self.history = [*self.history, list(batch.response_lengths)][-self.window :]
        self.profile = self._merge(batch.profile)
        self.prompt_len, self.cap, self.slots = (
            max(batch.prompt_len, 1),
            max(batch.cap, 1),
            max(batch.slots, 1),
        )
        self._measure(batch)
        observed = [n for lengths in self.history for n in lengths]
        if self.profile is None or len(observed) < 2 or len(batch.response_lengths) < 2:
            return
        sweep, serial = rt_sweep(
            LengthDistribution.fit(observed),
            batch=len(batch.response_lengths),
            cap=self.cap,
            prompt_len=self.prompt_len,
            instances=self.instances,
            profile=self.profile,
            bs_max=self.bs_max,
            slots=self.slots,
        )
        if not sweep:
            return
        # the smallest Rt among the fastest: predictions equal but for summation order count as ties
        fastest = min(result.gen_inf_s for _, result in sweep) * (1 + _TIE)
        rt, best = min((item for item in sweep if item[1].gen_inf_s <= fastest), key=lambda item: item[0])
        if best.gen_inf_s * (1 + self.min_gain) >= serial.gen_inf_s:  # no Rt pays on this machine: off
            rt, best = 0, serial
        predicted_rt, predicted = rt, best
        self.overruled = predicted_rt > 0 and self.pays() is False
        if self.overruled:  # predicted to pay, measured not to: off
            rt, best = 0, serial
        elif predicted_rt > 0 and self.serial.median is None and self.migrating.median is not None:
            rt, best = 0, serial  # measure Rt = 0 once before trusting the prediction
        # while the prediction says migration pays, the mode not chosen runs once every check_every iterations
        self.since_check = self.since_check + 1 if (rt > 0) == (batch.rt > 0) else 0
        if predicted_rt > 0 and self.since_check >= self.check_every:
            self.since_check = 0
            rt, best = (0, serial) if rt > 0 else (predicted_rt, predicted)
        self.chosen, self.predicted, self.predicted_serial = rt, best, serial


def predicted_speedup(serial: SimResult, fused: SimResult) -> float:
    return serial.gen_inf_s / fused.gen_inf_s if fused.gen_inf_s > 0 else math.nan
