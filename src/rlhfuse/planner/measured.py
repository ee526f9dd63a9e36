"""The Gen+Inf simulator fed by measured costs (`migration=auto`, docs/paper.md §2): a `CostProfile` of the running
engine and `MeasuredCosts`, the `RolloutCosts` the planner's `gen_inf` / `gen_inf_sweep` read. The planner's
paper-scale presets go through the same functions with `ModeledCosts` (the analytical cost model).

- decode step of b samples on one instance: `step_base_s + step_per_sample_s * b` (a least-squares fit of the
  engines' plain decode steps), plus `lockstep_s` per step in a fused run until the migration (the count
  synchronisation and pacing at the slowest rank, measured on the fused runs);
- prefill (and re-prefill) per token: measured; inference per token (Actor, Ref, Reward and Critic forward
  passes): measured on the fused runs' inference calls, or 4 prefills of the Actor's size until then;
- the migration pauses the destinations for `migration_s` (measured) plus the re-prefill of what they receive;
- each instance is one inference server; a sample's inference runs on one server (latency = its work).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from rlhfuse.planner.migration_decision import Mechanism, MigrationDecision, decide_migration
from rlhfuse.planner.plan_simulator import RolloutCosts, Samples, Tail, Unmigrated

INFERENCE_PASSES = 4.0
"""Forward passes of the inference stage, in Actor prefills, before inference has been measured."""


@dataclass(frozen=True)
class CostProfile:
    """Measured costs of one instance, in seconds. `lockstep_s` / `migration_s`: the fused run's extra cost per
    decode step before the migration, and of the migration itself (0 until a fused run measured them)."""

    step_base_s: float
    step_per_sample_s: float
    prefill_s_per_token: float
    inference_s_per_token: float
    lockstep_s: float = 0.0
    migration_s: float = 0.0
    inference_measured: bool = False
    """inference_s_per_token timed on inference calls (not the prefill-based default)."""

    def step(self, batch: int) -> float:
        return self.step_base_s + self.step_per_sample_s * batch

    @classmethod
    def fit(cls, stats: Sequence[Any], *, inference_passes: float = INFERENCE_PASSES) -> CostProfile | None:
        """From engine counters (`rlhfuse.generation.EngineStats`; None until there are plain decode steps of at
        least two batch sizes). Fused-run counters (`inference_seconds` / `inference_tokens`, `lockstep_seconds`
        / `lockstep_steps`, `migration_seconds` / `migrations`) replace the defaults when present."""
        plain = [
            (b, t)
            for s in stats
            for b, t, n in zip(s.batch_sizes, s.step_seconds, s.step_positions or [1] * len(s.batch_sizes))
            if n == 1  # a speculative verify step computes several positions per sample
        ]
        sizes = np.array([b for b, _ in plain], dtype=np.float64)
        seconds = np.array([t for _, t in plain], dtype=np.float64)
        prefill_tokens = sum(s.prefill_tokens for s in stats)
        if len(np.unique(sizes)) < 2 or prefill_tokens == 0:
            return None
        slope, base = np.polyfit(sizes, seconds, 1)
        prefill = sum(s.prefill_seconds for s in stats) / prefill_tokens

        def ratio(num: str, den: str) -> float | None:
            d = sum(getattr(s, den, 0) for s in stats)
            return sum(getattr(s, num, 0.0) for s in stats) / d if d else None

        inference = ratio("inference_seconds", "inference_tokens")
        return cls(
            step_base_s=max(float(base), 0.0),
            step_per_sample_s=max(float(slope), 0.0),
            prefill_s_per_token=prefill,
            inference_s_per_token=inference if inference is not None else inference_passes * prefill,
            lockstep_s=max(ratio("lockstep_seconds", "lockstep_steps") or 0.0, 0.0),
            migration_s=max(ratio("migration_seconds", "migrations") or 0.0, 0.0),
            inference_measured=inference is not None,
        )

    @classmethod
    def of(cls, costs: RolloutCosts, samples: Samples) -> CostProfile:
        """Profile another `RolloutCosts` (e.g. the cost model's) as the engine profiles itself: decode steps of
        1..max(batch) samples at the batch's mean context, least-squares fitted; prefill and inference per token
        of the batch. What lets the tuner and the planner be compared on the same setting."""
        n = len(samples)
        per_instance = -(-n // costs.instances)
        alive = np.arange(1, per_instance + 1, dtype=np.float64)
        mean_ctx = float(samples.seq.mean())
        slope, base = np.polyfit(alive, costs.step_time(alive, alive * mean_ctx), 1)
        one = np.zeros(n, dtype=np.int64)
        prefill = float(costs.prefill_end(samples, one)[0]) / float(samples.prompt.sum())
        work, _ = costs.inference(samples.seq, fused=True)
        return cls(
            step_base_s=max(float(base), 0.0),
            step_per_sample_s=max(float(slope), 0.0),
            prefill_s_per_token=prefill,
            # work is in server-seconds of the cost model's servers: per instance, divide by its servers
            inference_s_per_token=float(work.sum()) / costs.servers([0]) / float(samples.seq.sum()),
            lockstep_s=costs.lockstep_s,
            inference_measured=True,
        )


@dataclass(frozen=True)
class MeasuredCosts:
    """`RolloutCosts` of `instances` engine instances (one per rank) with `profile`'s measured figures;
    `bs_max` and `slots` (KV slots per instance) bound the migration's destinations."""

    profile: CostProfile
    instances: int
    bs_max: int
    slots: int

    @property
    def lockstep_s(self) -> float:
        return self.profile.lockstep_s

    def step_time(self, alive: NDArray, ctx: NDArray) -> NDArray:
        out: NDArray = self.profile.step_base_s + self.profile.step_per_sample_s * np.asarray(
            alive, np.float64
        )
        return out

    def prefill_end(self, samples: Samples, instance: NDArray) -> NDArray:
        prompt = np.bincount(instance, weights=samples.prompt, minlength=self.instances)
        out: NDArray = self.profile.prefill_s_per_token * prompt
        return out

    def decide(self, samples: Samples, tail: Tail) -> MigrationDecision:
        # memory in slots: a sample holds one slot of the `slots` an instance has
        return decide_migration(tail.counts, self.bs_max, kv_bytes_per_sample=1.0, free_kv_bytes=self.slots)

    def move_seconds(self, ctx: Sequence[NDArray]) -> tuple[float, float, Mechanism | None]:
        reprefill = max((float(c.sum()) * self.profile.prefill_s_per_token for c in ctx), default=0.0)
        return self.profile.migration_s, self.profile.migration_s + reprefill, "reprefill"

    def inference(self, seq: NDArray, *, fused: bool) -> tuple[NDArray, NDArray]:
        work = np.asarray(seq, dtype=np.float64) * self.profile.inference_s_per_token
        return work, work

    def inference_tp(self, *, fused: bool) -> int:
        return 1

    def servers(self, freed: Sequence[int] | None) -> int:
        return self.instances if freed is None else len(freed)

    def weights_ready(
        self, base: Unmigrated, freed: Sequence[int] | None, freed_at: float | None, hidden_until: float,
        *, fused: bool,
    ) -> tuple[float, float]:  # fmt: skip
        return 0.0, hidden_until  # every model stays on the device
