"""The migration decision of inter-stage fusion (docs/paper.md §2), as pure functions of counts and sizes.

Shared by the planner's simulator and the generation engine (issue 5): the engine calls `should_migrate` after
every decode step with the number of unfinished samples, then `decide_migration` with the unfinished count of
each instance, and `choose_mechanism` with its two cost estimates. No state, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Mechanism = Literal["kv", "reprefill"]


@dataclass(frozen=True)
class MigrationDecision:
    """Where the tail samples go.

    Attributes:
        m: number of destination instances, max(m_speed, m_memory), at least 1 while samples remain.
        m_speed: ceil(Rt / BSmax): keep each destination's decode batch at or under the saturating size.
        m_memory: ceil(Rt x M_kv / C): the tail's KV caches at maximum length must fit.
        destinations: the m instances with the most unfinished samples (ties: lower index), so fewest move.
        moves: (source, destination, count) triples; every unfinished sample of a non-destination moves.
        loads: unfinished samples per destination after the moves, in `destinations` order.
        m_read: ceil(tail KV bytes now / read budget), the optional third rule (0 when not used): our extension,
            because a decode step also reads the KV cache, and consolidating the tail multiplies that read.
    """

    m: int
    m_speed: int
    m_memory: int
    destinations: tuple[int, ...]
    moves: tuple[tuple[int, int, int], ...]
    loads: tuple[int, ...]
    m_read: int = 0

    @property
    def moved(self) -> int:
        return sum(c for _, _, c in self.moves)


def should_migrate(unfinished: int, threshold: int) -> bool:
    """Trigger: the number of unfinished samples of the whole batch has dropped to Rt (or below)."""
    return 0 < unfinished <= threshold


def destination_count(
    remaining: int, bs_max: int, kv_bytes_per_sample: float, free_kv_bytes: float
) -> tuple[int, int, int]:
    """(m, m_speed, m_memory) for `remaining` tail samples; see `MigrationDecision`."""
    if bs_max < 1:
        raise ValueError(f"bs_max={bs_max} must be >= 1")
    if free_kv_bytes <= 0:
        raise ValueError(f"free_kv_bytes={free_kv_bytes} must be > 0: the instance has no room for KV cache")
    if remaining <= 0:
        return 0, 0, 0
    m_speed = math.ceil(remaining / bs_max)
    m_memory = math.ceil(remaining * kv_bytes_per_sample / free_kv_bytes)
    return max(1, m_speed, m_memory), m_speed, m_memory


def decide_migration(
    unfinished: Sequence[int],
    bs_max: int,
    kv_bytes_per_sample: float,
    free_kv_bytes: float,
    *,
    kv_read_bytes: float = 0.0,
    kv_read_budget: float | None = None,
) -> MigrationDecision:
    """Pick destinations and moves for instances holding `unfinished[i]` unfinished samples each.

    The paper's rule is m = max(m_speed, m_memory). With `kv_read_budget` (bytes of KV cache one destination
    may read per decode step, e.g. a fraction of its weight bytes), a third rule keeps the tail's current KV
    (`kv_read_bytes` in total) from slowing the destinations' steps: m >= ceil(kv_read_bytes / budget).

    Sources are emptied largest first, each sample to the currently least-loaded destination, so destination
    loads end up balanced; m is capped at the number of instances (when even that cannot hold the tail at
    maximum length, the destinations take it anyway and the engine must preempt, as without migration).
    """
    if any(u < 0 for u in unfinished):
        raise ValueError(f"unfinished counts must be >= 0 (got {list(unfinished)})")
    total = int(sum(unfinished))
    m, m_speed, m_memory = destination_count(total, bs_max, kv_bytes_per_sample, free_kv_bytes)
    m_read = 0
    if kv_read_budget is not None and total:
        if kv_read_budget <= 0:
            raise ValueError(
                f"kv_read_budget={kv_read_budget} must be > 0 (or None to use the paper's rule only)"
            )
        m_read = math.ceil(kv_read_bytes / kv_read_budget)
        m = max(m, m_read)
    m = min(m, len(unfinished))
    order = sorted(range(len(unfinished)), key=lambda i: (-unfinished[i], i))
    destinations = tuple(order[:m])
    loads = {d: int(unfinished[d]) for d in destinations}
    moves: dict[tuple[int, int], int] = {}
    for src in order[m:]:
        for _ in range(int(unfinished[src])):
            dst = min(destinations, key=lambda d: (loads[d], d))
            loads[dst] += 1
            moves[(src, dst)] = moves.get((src, dst), 0) + 1
    return MigrationDecision(
        m=m,
        m_speed=m_speed,
        m_memory=m_memory,
        destinations=destinations,
        moves=tuple((s, d, c) for (s, d), c in sorted(moves.items())),
        loads=tuple(loads[d] for d in destinations),
        m_read=m_read,
    )


def choose_mechanism(kv_transfer_seconds: float, reprefill_seconds: float) -> Mechanism:
    """Send the KV cache when that is no slower than recomputing it from prompt + generated tokens."""
    return "kv" if kv_transfer_seconds <= reprefill_seconds else "reprefill"


def threshold_from_fraction(fraction: float, batch: int) -> int:
    """Rt as a sample count for a fraction of the batch (the sweep runs 5%..95%)."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"migration fraction={fraction} must be in (0, 1)")
    return max(1, round(fraction * batch))
