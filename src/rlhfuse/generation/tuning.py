"""Rt auto-tuning (DESIGN §2): simulate generation + inference for each Rt on this machine's measured costs and
the response lengths seen so far, and keep the fastest.

The simulator is deliberately small and fed by profiled costs rather than datasheets (the planner's
`rt_sweep` models paper-scale GPUs; this one models the engine that is actually running):

- decode step of b samples on one instance: `step_base_s + step_per_sample_s * b` (least-squares fit of the
  engines' measured steps), flat up to the fit's noise below BSmax as on an accelerator, linear on a CPU;
- prefill (and re-prefill) per token: measured; inference per token (Actor, Ref, Reward and Critic forward
  passes): `inference_s_per_token`, by default 4 prefills of the Actor's size;
- samples of a batch go round-robin to `instances` instances and decode with continuous batching;
- at Rt unfinished samples `decide_migration` moves the tail (re-prefill cost at the destinations), the
  freed instances run inference on the finished samples, the tail streaming in (one queue, shared evenly);
- serial: inference of every sample on every instance after the last sample finishes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rlhfuse.generation.engine import EngineStats
from rlhfuse.generation.migration import BatchObservation, resolve_threshold
from rlhfuse.planner.lengths import LengthDistribution
from rlhfuse.planner.migration import decide_migration, threshold_from_fraction

RT_FRACTIONS = tuple(round(0.05 * k, 2) for k in range(1, 20))  # 5% .. 95%


@dataclass(frozen=True)
class CostProfile:
    """Measured costs of one instance, in seconds."""

    step_base_s: float
    step_per_sample_s: float
    prefill_s_per_token: float
    inference_s_per_token: float

    def step(self, batch: int) -> float:
        return self.step_base_s + self.step_per_sample_s * batch

    @classmethod
    def fit(cls, stats: Sequence[EngineStats], *, inference_passes: float = 4.0) -> CostProfile | None:
        """From engine counters (None until there are decode steps of at least two batch sizes)."""
        sizes = np.array([b for s in stats for b in s.batch_sizes], dtype=np.float64)
        seconds = np.array([t for s in stats for t in s.step_seconds], dtype=np.float64)
        prefill_tokens = sum(s.prefill_tokens for s in stats)
        if len(np.unique(sizes)) < 2 or prefill_tokens == 0:
            return None
        slope, base = np.polyfit(sizes, seconds, 1)
        prefill = sum(s.prefill_seconds for s in stats) / prefill_tokens
        return cls(
            step_base_s=max(float(base), 0.0),
            step_per_sample_s=max(float(slope), 0.0),
            prefill_s_per_token=prefill,
            inference_s_per_token=inference_passes * prefill,
        )


@dataclass(frozen=True)
class SimResult:
    """Predicted seconds: generation end, last inference output (Gen+Inf), and what migration did."""

    generation_s: float
    gen_inf_s: float
    moved: int = 0
    destinations: int = 0


def _finish_times(lengths: Sequence[int], start: float, profile: CostProfile) -> list[float]:
    """Continuous batching of `lengths` on one instance from `start`: each sample's finish time."""
    if not lengths:
        return []
    order = sorted(lengths)
    ends: dict[int, float] = {}
    t, i, remaining = start, 0, len(order)
    for step in range(1, order[-1] + 1):
        t += profile.step(remaining)
        while i < len(order) and order[i] == step:
            ends.setdefault(step, t)
            i += 1
            remaining -= 1
    return [ends[n] for n in lengths]


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
    """One batch of responses of `lengths` tokens; `rt` = 0: no migration (serial generation, then inference)."""
    n = len(lengths)
    share = [list(lengths[i::instances]) for i in range(instances)]
    prefill = [profile.prefill_s_per_token * prompt_len * len(s) for s in share]
    finish = [_finish_times(s, prefill[i], profile) for i, s in enumerate(share)]
    work = [(prompt_len + length) * profile.inference_s_per_token for length in lengths]
    ends = sorted((t, i, k) for i, f in enumerate(finish) for k, t in enumerate(f))
    if rt <= 0 or rt >= n:
        gen_end = ends[-1][0]
        return SimResult(gen_end, gen_end + sum(work) / instances)
    # the moment Rt samples remain: the (n - rt)-th finish
    t_mig = ends[n - rt - 1][0]
    done = [(t, lengths[i + instances * k]) for t, i, k in ends[: n - rt]]
    tail: list[list[tuple[int, int]]] = []  # per instance: (steps left, length) of its unfinished samples
    for i, f in enumerate(finish):
        ran = _steps_by(share[i], prefill[i], t_mig, profile)
        tail.append([(max(share[i][k] - ran, 1), share[i][k]) for k, t in enumerate(f) if t > t_mig])
    decision = decide_migration([len(x) for x in tail], bs_max, kv_bytes_per_sample=1.0, free_kv_bytes=slots)
    loads = {d: list(tail[d]) for d in decision.destinations}
    reprefill_tokens = dict.fromkeys(decision.destinations, 0)
    for src, dst, count in decision.moves:
        items, tail[src] = tail[src][:count], tail[src][count:]
        loads[dst] += items
        reprefill_tokens[dst] += sum(prompt_len + length - left for left, length in items)
    finished_tail: list[tuple[float, int]] = []
    for d, items in loads.items():
        start = t_mig + reprefill_tokens[d] * profile.prefill_s_per_token
        ts = _finish_times([left for left, _ in items], start, profile)
        finished_tail += [(t, length) for t, (_, length) in zip(ts, items, strict=True)]
    gen_end = max([t_mig, *(t for t, _ in finished_tail)])
    servers = instances - decision.m
    if servers <= 0:  # every instance is a destination: inference after generation, as serial
        return SimResult(gen_end, gen_end + sum(work) / instances, decision.moved, decision.m)
    # freed instances infer the finished samples from t_mig, the tail streaming in (one fluid queue)
    busy = t_mig
    for t, length in sorted(done + finished_tail):
        busy = max(busy, t) + (prompt_len + length) * profile.inference_s_per_token / servers
    return SimResult(gen_end, busy, decision.moved, decision.m)


def _steps_by(lengths: Sequence[int], start: float, until: float, profile: CostProfile) -> int:
    """Decode steps an instance with `lengths` has completed by time `until`."""
    order = sorted(lengths)
    t, i, remaining, step = start, 0, len(order), 0
    while remaining and step < order[-1]:
        t_next = t + profile.step(remaining)
        if t_next > until:
            break
        t, step = t_next, step + 1
        while i < len(order) and order[i] == step:
            i += 1
            remaining -= 1
    return step


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
    lengths = distribution.sample(batch, cap, np.random.default_rng(seed)).tolist()
    serial = simulate(lengths, prompt_len, instances, 0, profile, bs_max=bs_max, slots=slots)
    out: list[tuple[int, SimResult]] = []
    for fraction in fractions:
        rt = min(threshold_from_fraction(fraction, batch), batch - 1)
        if out and out[-1][0] == rt:
            continue
        out.append((rt, simulate(lengths, prompt_len, instances, rt, profile, bs_max=bs_max, slots=slots)))
    return out, serial


class AutoThreshold:
    """migration=auto: Rt from `rt_sweep` on the lengths of the last `window` iterations and measured costs
    (0 = off when the serial prediction is no slower than the best Rt); `initial` (a count or fraction) until
    there are lengths and costs. `last` holds the latest sweep's choice and predictions."""

    def __init__(self, initial: float, *, instances: int, bs_max: int, window: int = 4) -> None:
        self.initial = initial
        self.instances = instances
        self.bs_max = bs_max
        self.window = window
        self.history: list[list[int]] = []
        self.profile: CostProfile | None = None
        self.prompt_len = 1
        self.cap = 1
        self.slots = 1
        self.chosen: int | None = None
        self.predicted: SimResult | None = None
        self.predicted_serial: SimResult | None = None

    def threshold(self, batch_size: int) -> int:
        if self.chosen is None:
            return resolve_threshold(self.initial, batch_size)
        return min(self.chosen, batch_size - 1) if batch_size > 1 else 0

    def observe(self, batch: BatchObservation) -> None:
        self.history = [*self.history, list(batch.response_lengths)][-self.window :]
        self.profile = batch.profile or self.profile
        self.prompt_len, self.cap, self.slots = (
            max(batch.prompt_len, 1),
            max(batch.cap, 1),
            max(batch.slots, 1),
        )
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
        rt, best = min(sweep, key=lambda item: (item[1].gen_inf_s, item[0]))
        if serial.gen_inf_s <= best.gen_inf_s:  # no Rt pays on this machine: migration off (Rt = 0)
            rt, best = 0, serial
        self.chosen, self.predicted, self.predicted_serial = rt, best, serial


def predicted_speedup(serial: SimResult, fused: SimResult) -> float:
    return serial.gen_inf_s / fused.gen_inf_s if fused.gen_inf_s > 0 else math.nan
