"""Timeline picture of a schedule (the paper's Figure 10): per-rank F/B boxes and activation memory over time."""

from __future__ import annotations

from pathlib import Path

from rlhfuse.pipeline.ir import Kind, Schedule
from rlhfuse.pipeline.problem import Problem
from rlhfuse.pipeline.simulate import SimResult, simulate

# One hue per model; forwards light, backwards dark, so F/B and the two models read at a glance.
_COLOURS = [("#9ecae1", "#2171b5"), ("#fdae6b", "#d94801"), ("#a1d99b", "#238b45"), ("#bcbddc", "#6a51a3")]


def plot_timeline(
    problem: Problem,
    schedule: Schedule,
    path: str | Path,
    *,
    reference_memory: float | None = None,
    title: str | None = None,
    sim: SimResult | None = None,
) -> Path:
    """Write a PNG: one row of boxes per rank (micro-batch numbers inside), memory per rank below.

    `reference_memory` draws a dashed line (e.g. the serial 1F1B peak) under the memory curves.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    sim = sim or simulate(problem, schedule)
    names = problem.model_names()
    colour = {name: _COLOURS[i % len(_COLOURS)] for i, name in enumerate(names)}
    ranks = problem.ranks
    fig, (ax, mem_ax) = plt.subplots(
        2, 1, figsize=(max(10.0, sim.makespan / 12), 2.0 + 0.42 * ranks + 2.5), sharex=True,
        gridspec_kw={"height_ratios": [max(ranks, 2), 5]},
    )  # fmt: skip
    label_boxes = ranks <= 32
    for k, rank in enumerate(schedule.ranks):
        for a in rank:
            start, end = sim.start[a], sim.end[a]
            light, dark = colour[a.model]
            ax.broken_barh([(start, end - start)], (k - 0.42, 0.84), facecolors=light if a.kind is Kind.F else dark,
                           edgecolors="white", linewidth=0.4)  # fmt: skip
            if label_boxes and end - start >= sim.makespan / 400:
                ax.text((start + end) / 2, k, str(a.microbatch), ha="center", va="center", fontsize=5.5,
                        color="black" if a.kind is Kind.F else "white")  # fmt: skip
    ax.set_ylim(ranks - 0.5, -0.5)
    ax.set_ylabel("rank")
    ax.set_yticks(range(ranks))
    ax.tick_params(axis="y", labelsize=6)
    handles = []
    for name in names:
        handles += [
            Patch(color=colour[name][0], label=f"{name} F"),
            Patch(color=colour[name][1], label=f"{name} B"),
        ]
    ax.legend(
        handles=handles,
        loc="lower right",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=7,
        ncol=len(handles),
        frameon=False,
    )
    ax.set_title(
        title or f"{problem.name}: makespan {sim.makespan:g}, peak activation {sim.peak:.2f}", fontsize=9
    )
    ax.grid(axis="x", alpha=0.3)
    cmap = plt.get_cmap("viridis")
    for k, steps in enumerate(sim.memory):
        if not steps:
            continue
        xs, ys = [0.0], [0.0]
        for t, level in steps:
            xs += [t, t]
            ys += [ys[-1], level]
        xs.append(sim.makespan)
        ys.append(ys[-1])
        width = 1.6 if sim.peak_per_rank[k] == sim.peak else 0.7
        mem_ax.plot(xs, ys, color=cmap(k / max(ranks - 1, 1)), linewidth=width, alpha=0.8)
    if reference_memory is not None:
        mem_ax.axhline(reference_memory, color="red", linestyle="--", linewidth=1.2,
                       label=f"serial 1F1B peak {reference_memory:.2f}")  # fmt: skip
        mem_ax.legend(loc="upper right", fontsize=7)
    mem_ax.set_ylabel("activation")
    mem_ax.set_xlabel("time")
    mem_ax.set_xlim(0, sim.makespan)
    mem_ax.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return out
