"""Rt auto-tuning (DESIGN §2): simulate generation + inference for each Rt on this machine's measured costs and
the response lengths seen so far, and keep the fastest.

The simulator is the planner's (`rlhfuse.planner.simulate`: continuous batching per instance, the tail at Rt,
`decide_migration`, a fluid inference queue) fed by profiled costs rather than datasheets (the planner's
`rt_sweep` models paper-scale GPUs with its cost model; this one the engine that is actually running):

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
from rlhfuse.planner.migration import decide_migration
from rlhfuse.planner.simulate import (
    RT_FRACTIONS,
    Samples,
    StepTime,
    continuous_batching,
    decode_instances,
    drain_time,
    rt_values,
    tail_at,
)


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
        # plain decode steps only (a speculative verify step computes several positions per sample)
        plain = [
            (b, t)
            for s in stats
            for b, t, n in zip(s.batch_sizes, s.step_seconds, s.step_positions or [1] * len(s.batch_sizes))
            if n == 1
        ]
        sizes = np.array([b for b, _ in plain], dtype=np.float64)
        seconds = np.array([t for _, t in plain], dtype=np.float64)
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
    """One batch of responses of `lengths` tokens; `rt` = 0: no migration (serial generation, then inference).

    The planner's simulator (`rlhfuse.planner.simulate`: `decode_instances`, `tail_at`, `drain_time`) fed with
    this machine's measured costs: decode steps from `profile.step`, prefill and re-prefill per token, every
    moved sample re-prefilled on its destination, inference as one queue over the freed instances."""
    n = len(lengths)
    samples = Samples(np.full(n, prompt_len, dtype=np.int64), np.asarray(lengths, dtype=np.int64))
    per_instance = np.bincount(np.arange(n) % instances, minlength=instances)
    prefill_end = profile.prefill_s_per_token * prompt_len * per_instance.astype(np.float64)
    base = decode_instances(_step_time(profile), samples, instances, prefill_end)
    work = samples.seq * profile.inference_s_per_token
    no_latency = np.zeros(n)
    if rt <= 0 or rt >= n:
        gen_end = float(base.finish.max())
        return SimResult(gen_end, drain_time(np.full(n, gen_end), work, instances, gen_end, no_latency))
    tail = tail_at(base, samples, rt)
    decision = decide_migration(tail.counts, bs_max, kv_bytes_per_sample=1.0, free_kv_bytes=slots)
    members, incoming = tail.moves(base, decision)
    finish = base.finish.copy()
    ctx_now = samples.prompt + tail.generated
    for d, mem in members.items():
        start = tail.t_mig + float(ctx_now[incoming[d]].sum()) * profile.prefill_s_per_token
        idx = np.asarray(mem, dtype=np.int64)
        finish[idx], _ = continuous_batching(
            _step_time(profile), ctx_now[idx], samples.response[idx] - tail.generated[idx], start
        )
    gen_end = float(finish.max())
    servers = instances - decision.m
    if servers <= 0:  # every instance is a destination: inference after generation, as serial
        serial_end = drain_time(np.full(n, gen_end), work, instances, gen_end, no_latency)
        return SimResult(gen_end, serial_end, decision.moved, decision.m)
    # freed instances infer the finished samples from t_mig, the tail streaming in (one fluid queue)
    return SimResult(
        gen_end, drain_time(finish, work, servers, tail.t_mig, no_latency), decision.moved, decision.m
    )


def _step_time(profile: CostProfile) -> StepTime:
    return lambda alive, ctx: profile.step_base_s + profile.step_per_sample_s * alive


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
    return [
        (rt, simulate(lengths, prompt_len, instances, rt, profile, bs_max=bs_max, slots=slots))
        for _, rt in rt_values(fractions, batch)
    ], serial


_TIE = 1e-12  # relative: far below any measured cost difference, far above float rounding


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
        # the smallest Rt among the fastest: predictions equal but for summation order count as ties
        fastest = min(result.gen_inf_s for _, result in sweep) * (1 + _TIE)
        rt, best = min((item for item in sweep if item[1].gen_inf_s <= fastest), key=lambda item: item[0])
        if serial.gen_inf_s <= best.gen_inf_s * (1 + _TIE):  # no Rt pays on this machine: migration off
            rt, best = 0, serial
        self.chosen, self.predicted, self.predicted_serial = rt, best, serial


def predicted_speedup(serial: SimResult, fused: SimResult) -> float:
    return serial.gen_inf_s / fused.gen_inf_s if fused.gen_inf_s > 0 else math.nan
