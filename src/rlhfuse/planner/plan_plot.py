"""Figure-8-style charts: per setting, stacked bars of the iteration breakdown of RLHFuse-Base and RLHFuse;
and the Rt sweep (Figure 9). matplotlib with the Agg backend (no display needed)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rlhfuse.planner.grid import Comparison
from rlhfuse.planner.plan_search import Plan

SEGMENTS = (
    ("gen_inf", "Gen.+Inf.", "#4C72B0"),
    ("training", "Train", "#DD8452"),
    ("others", "Others", "#55A868"),
)


def breakdown_chart(comparisons: Sequence[Comparison], path: str | Path, title: str | None = None) -> Path:
    """One pair of stacked bars (Base, RLHFuse) per comparison, labelled `actor/critic len`, with the
    throughput ratio above each pair."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(comparisons) + 2), 4.2))
    width = 0.38
    labels = []
    for i, comp in enumerate(comparisons):
        for j, plan in enumerate((comp.base, comp.rlhfuse)):
            bottom = 0.0
            b = plan.breakdown
            for key, name, color in SEGMENTS:
                value = getattr(b, key)
                ax.bar(
                    i + (j - 0.5) * width, value, width * 0.95, bottom=bottom, color=color,
                    alpha=0.55 if j == 0 else 1.0, label=name if i == 0 and j == 1 else None,
                    edgecolor="black", linewidth=0.4,
                )  # fmt: skip
                bottom += value
        top = max(comp.base.breakdown.total, comp.rlhfuse.breakdown.total)
        ax.text(i, top * 1.02, f"{comp.throughput_ratio:.2f}x", ha="center", va="bottom", fontsize=8)
        labels.append(f"{comp.rlhfuse.models.name}\n{comp.rlhfuse.workload.max_len}")
    ax.set_xticks(range(len(comparisons)), labels, fontsize=7)
    ax.set_ylabel("predicted seconds per iteration")
    ax.set_title(title or "Iteration breakdown: RLHFuse-Base (light, left) vs RLHFuse (right)", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def rt_sweep_chart(plans: Sequence[Plan], path: str | Path) -> Path:
    """Gen+Inf seconds against the migration fraction Rt / batch, one line per plan (Figure 9)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for plan in plans:
        if plan.sweep:
            xs, ys = zip(*plan.sweep)
            ax.plot(
                [100 * x for x in xs],
                ys,
                marker="o",
                ms=3,
                label=f"{plan.models.name} len {plan.workload.max_len}",
            )
    ax.set_xlabel("migration threshold Rt (% of batch)")
    ax.set_ylabel("predicted Gen.+Inf. seconds")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
