"""Stage partitioning glue: the modules a rank runs, cut from the full Actor and Critic by `split_stages`.

Layers are split into contiguous ranges balanced by `layer_costs` (equal by default); the embedding sits on
the first stage, final norm and head on the last (see `rlhfuse.models.stages`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import nn

from rlhfuse.models import Transformer, split_stages
from rlhfuse.runtime.layout import ParallelLayout

StageKey = tuple[str, int, int]  # (model, replica, stage)


def stages_for_rank(
    layout: ParallelLayout,
    rank: int,
    models: Mapping[str, Transformer],
    layer_costs: Mapping[str, Sequence[float]] | None = None,
) -> dict[StageKey, nn.Module]:
    """(model, replica, stage) -> stage module for every stage placed on `rank`.

    Every rank holds full copies of the models with identical initial weights (same checkpoint or seed);
    a rank only runs, and only optimizes, the parameters of its own stages.
    """
    out: dict[StageKey, nn.Module] = {}
    for model, replica, stage in layout.stages_on(rank):
        m = models[model]
        if m.config.tie_word_embeddings and layout.stages(model) > 1:
            raise ValueError(
                f"{model} ties its embedding and LM head, which a {layout.stages(model)}-stage pipeline places on "
                "different ranks: untie them (tie_word_embeddings=false) or use pp=1 for this model"
            )
        costs = None if layer_costs is None else layer_costs.get(model)
        out[(model, replica, stage)] = split_stages(m, layout.stages(model), layer_costs=costs)[stage]
    return out
