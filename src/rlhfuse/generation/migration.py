"""Migration policies (when to move the long tail: Rt) and the mechanism choice, on top of the pure decision
functions of `rlhfuse.planner.migration_decision` (trigger, destination count, destinations, KV vs re-prefill).

- `NoMigration` (`migration=off`, alias `none`): every instance decodes its own samples to the end.
- `FixedThreshold` (`migration=fixed`): Rt = `migration.threshold` (a sample count, or a fraction of the batch).
- `AutoThreshold` (`migration=auto`): Rt from the planner's simulator (`rt_sweep`) fed with the response-length
  distribution observed in earlier iterations (`LengthDistribution.fit`, refit every iteration) and this
  machine's measured costs; `migration.threshold` until the first lengths are observed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from rlhfuse.planner.migration_decision import Mechanism, choose_mechanism, threshold_from_fraction

if TYPE_CHECKING:
    from rlhfuse.generation.tuning import CostProfile

MECHANISMS = ("kv", "reprefill", "auto")


@dataclass(frozen=True)
class BatchObservation:
    """What a finished batch tells a policy: response lengths, mean prompt length, the length cap
    (max_new_tokens), KV slots per instance and the engines' measured costs (None until measurable)."""

    response_lengths: Sequence[int]
    prompt_len: int
    cap: int
    slots: int
    profile: CostProfile | None
    # what the batch took, measured: generation + inference seconds of a fused rollout (generation alone when
    # inference ran apart, `fused=False`), under the threshold `rt` it ran with; None: not measured
    measured_s: float | None = None
    rt: int = 0
    fused: bool = True


@runtime_checkable
class MigrationPolicy(Protocol):
    """When the tail of a batch migrates."""

    def threshold(self, batch_size: int) -> int:
        """Rt for a batch of `batch_size` samples: migrate when that many (or fewer) remain; 0 = never."""
        ...

    def observe(self, batch: BatchObservation) -> None:
        """A finished iteration (a policy may re-tune on it)."""
        ...


def resolve_threshold(value: float, batch_size: int) -> int:
    """A count (value >= 1) or a fraction of the batch (0 < value < 1) as a sample count; 0 = never."""
    if value <= 0 or batch_size < 2:
        return 0
    if value < 1:
        return threshold_from_fraction(value, batch_size)
    return min(int(value), batch_size)


class NoMigration:
    def threshold(self, batch_size: int) -> int:
        return 0

    def observe(self, batch: BatchObservation) -> None:
        return None


class FixedThreshold:
    def __init__(self, value: float) -> None:
        if value <= 0:
            raise ValueError(
                f"migration.threshold={value} must be > 0: a sample count (>= 1) or a fraction of the batch (< 1)"
            )
        self.value = value

    def threshold(self, batch_size: int) -> int:
        return resolve_threshold(self.value, batch_size)

    def observe(self, batch: BatchObservation) -> None:
        return None


def pick_mechanism(
    choice: str,
    *,
    kv_bytes: float,
    link_bytes_per_s: float,
    reprefill_tokens: int,
    prefill_s_per_token: float,
) -> Mechanism:
    """`kv` or `reprefill` as configured, or by cost (`auto`): bytes over the link vs tokens to recompute."""
    if choice == "kv":
        return "kv"
    if choice == "reprefill":
        return "reprefill"
    if choice != "auto":
        raise ValueError(f"migration.mechanism={choice!r} is not one of {list(MECHANISMS)}")
    return choose_mechanism(kv_bytes / link_bytes_per_s, reprefill_tokens * prefill_s_per_token)
