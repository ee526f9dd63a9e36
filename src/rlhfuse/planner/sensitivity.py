"""How much the paper-grid prediction depends on what it assumes (`rlhfuse-plan sensitivity`).

The grid's RLHFuse / RLHFuse-Base ratios rest on inputs that are assumptions, not measurements: the MFU and
memory-bandwidth factors of `Efficiency`, the fixed cost of a decode step, the response-length law, the batch each
generation instance holds and how much of the gradient reduction the backward hides. `sensitivity` moves each one
alone to a lower and a higher value, plans the grid again with everything else at the baseline, and reports the
band (lowest and highest over the grid's cells) of each ratio. One planning mechanism: every variation is a
`paper_grid` call with changed inputs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from rlhfuse.pipeline import SearchConfig
from rlhfuse.planner.grid import (
    GRID_SEARCH,
    PAPER_MAX_LENS,
    PAPER_PAIRS,
    PAPER_RANGES,
    Comparison,
    paper_grid,
)
from rlhfuse.planner.lengths import RESPONSES, LengthDistribution
from rlhfuse.planner.specs import DEFAULT_EFFICIENCY, ClusterSpec, Efficiency


@dataclass(frozen=True)
class GridInputs:
    """What a variation may change: the achieved-rate factors, the response lengths, the iteration's batch."""

    eff: Efficiency = DEFAULT_EFFICIENCY
    responses: LengthDistribution = RESPONSES
    global_batch: int = 512


@dataclass(frozen=True)
class Variation:
    name: str
    """The input moved (a row group of the table)."""
    value: str
    """Its value in this variation, as printed."""
    change: Callable[[GridInputs], GridInputs]


def _scaled_mfu(factor: float) -> Callable[[GridInputs], GridInputs]:
    def change(x: GridInputs) -> GridInputs:
        e = x.eff
        return replace(x, eff=replace(e, train_mfu=min(1.0, e.train_mfu * factor),
                                      prefill_mfu=min(1.0, e.prefill_mfu * factor),
                                      decode_mfu=min(1.0, e.decode_mfu * factor)))  # fmt: skip

    return change


def _eff(**values: float) -> Callable[[GridInputs], GridInputs]:
    return lambda x: replace(x, eff=replace(x.eff, **values))


def _lengths(**values: float) -> Callable[[GridInputs], GridInputs]:
    return lambda x: replace(x, responses=replace(x.responses, **values))


def _batch(factor: float) -> Callable[[GridInputs], GridInputs]:
    return lambda x: replace(x, global_batch=round(x.global_batch * factor))


VARIATIONS: tuple[Variation, ...] = (
    Variation("MFU (train, prefill, decode ceilings)", "x0.75", _scaled_mfu(0.75)),
    Variation("MFU (train, prefill, decode ceilings)", "x1.25", _scaled_mfu(1.25)),
    Variation("decode memory-bandwidth efficiency", "0.5", _eff(decode_mbu=0.5)),
    Variation("decode memory-bandwidth efficiency", "0.9", _eff(decode_mbu=0.9)),
    Variation("decode step overhead", "0.2 ms", _eff(decode_step_overhead=0.2e-3)),
    Variation("decode step overhead", "2 ms", _eff(decode_step_overhead=2e-3)),
    Variation("response length median", "65", _lengths(median=65.0)),
    Variation("response length median", "260", _lengths(median=260.0)),
    Variation("response length tail (log-normal sigma)", "0.7", _lengths(sigma=0.7)),
    Variation("response length tail (log-normal sigma)", "1.3", _lengths(sigma=1.3)),
    Variation("batch per generation instance", "x0.5 (global batch)", _batch(0.5)),
    Variation("batch per generation instance", "x2 (global batch)", _batch(2)),
    Variation("gradient-reduction overlap", "0 (none hidden)", _eff(grad_overlap=0.0)),
    Variation("gradient-reduction overlap", "0.5", _eff(grad_overlap=0.5)),
)
"""Each assumed input at a lower and a higher value than the baseline (`Efficiency`'s defaults, `RESPONSES`,
batch 512): MFU +-25%; decode MBU 0.5 / 0.9 (0.7); decode step overhead 0.2 / 2 ms (0.5 ms, the range of CUDA-graph
engines to eager ones); median response 65 / 260 tokens (130); sigma 0.7 / 1.3 (1.0); half and twice the samples
per instance (8-16 at batch 512 on 32-64 instances, far below BSmax); the gradient all-reduce hidden by none or
half of the last backward (all of it: the runtime's buckets)."""

RATIOS = tuple(PAPER_RANGES)
"""throughput_ratio, gen_inf_ratio, train_ratio: the grid's ratios, banded."""


@dataclass(frozen=True)
class Band:
    """One variation's grid: the lowest and highest of each ratio over its cells."""

    name: str
    value: str
    low: dict[str, float]
    high: dict[str, float]
    seconds: float
    infeasible: tuple[str, ...] = ()
    """Cells the planner found no plan for under this variation (left out of the band), with why."""

    @classmethod
    def of(
        cls,
        name: str,
        value: str,
        comps: Sequence[Comparison],
        seconds: float,
        infeasible: Sequence[str] = (),
    ) -> Band:
        if not comps:
            raise ValueError(f"{name} {value}: no cell of the grid has a plan ({'; '.join(infeasible)})")
        return cls(
            name,
            value,
            {k: min(getattr(c, k) for c in comps) for k in RATIOS},
            {k: max(getattr(c, k) for c in comps) for k in RATIOS},
            seconds,
            tuple(infeasible),
        )

    def to_dict(self) -> dict[str, object]:
        return {"input": self.name, "value": self.value, "low": self.low, "high": self.high,
                "seconds": self.seconds, "infeasible": list(self.infeasible)}  # fmt: skip


def sensitivity(
    variations: Sequence[Variation] = VARIATIONS,
    *,
    base: GridInputs = GridInputs(),
    pairs: tuple[tuple[str, str], ...] = PAPER_PAIRS,
    max_lens: tuple[int, ...] = PAPER_MAX_LENS,
    cluster_spec: ClusterSpec | None = None,
    mini_batch: int = 64,
    seed: int = 0,
    even_pp: bool = False,
    search: SearchConfig | None = GRID_SEARCH,
) -> list[Band]:
    """The baseline's band, then each variation's (see the module docstring). Speculation is left out: it does
    not change the three ratios."""

    def grid(name: str, value: str, x: GridInputs) -> Band:
        start = time.perf_counter()
        comps, infeasible = [], []
        for pair in pairs:
            for max_len in max_lens:
                try:
                    comps += paper_grid(
                        (pair,), (max_len,), cluster_spec=cluster_spec, global_batch=x.global_batch,
                        mini_batch=mini_batch, eff=x.eff, seed=seed, responses=x.responses, even_pp=even_pp,
                        search=search, speculation=None,
                    )  # fmt: skip
                except ValueError as err:  # e.g. the KV cache of a larger batch does not fit
                    infeasible.append(
                        f"{pair[0]}/{pair[1]} len {max_len}: {str(err).split(' (pruned', 1)[0]}"
                    )
        return Band.of(name, value, comps, time.perf_counter() - start, infeasible)

    return [grid("baseline", "", base)] + [grid(v.name, v.value, v.change(base)) for v in variations]


def sensitivity_table(bands: Sequence[Band]) -> str:
    """One row per variation: each ratio's band over the grid, and how far it moved from the baseline's."""
    head = f"{'input':<40} {'value':<20} | " + " | ".join(f"{k.removesuffix('_ratio'):<23}" for k in RATIOS)
    rows = [head, "-" * len(head)]
    base = bands[0]
    for b in bands:
        cells = []
        for k in RATIOS:
            cell = f"{b.low[k]:.2f}-{b.high[k]:.2f}"
            if b is not base:
                cell += f" ({b.low[k] - base.low[k]:+.2f}/{b.high[k] - base.high[k]:+.2f})"
            cells.append(f"{cell:<23}")
        rows.append(f"{b.name:<40} {b.value:<20} | " + " | ".join(cells))
    rows.append("-" * len(head))
    for k in RATIOS:
        lo, hi = min(b.low[k] for b in bands), max(b.high[k] for b in bands)
        paper = PAPER_RANGES[k]
        rows.append(f"{k}: {lo:.2f}-{hi:.2f} over every variation (paper {paper[0]}-{paper[1]})")
    rows.append("(+a/+b): the change of the band's low / high end from the baseline's")
    rows += [f"no plan under {b.name} {b.value}: {cell}" for b in bands for cell in b.infeasible]
    return "\n".join(rows)
