"""Stage partitioning glue: the modules a rank runs, cut from the full Actor and Critic by `split_stages`, and
`RankStages`, a rank's share of both models (its stages, their checkpoint shard, weight gathering).

Layers are split into contiguous ranges balanced by `layer_costs` (equal by default); the embedding sits on
the first stage, final norm and head on the last (see `rlhfuse.models.stages`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

from rlhfuse import distributed
from rlhfuse.models import Transformer, split_stages
from rlhfuse.runtime.layout import MODELS, ParallelLayout

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


class RankStages:
    """This rank's share of the Actor and the Critic (full copies of both on every rank, same weights).

    local: the stages placed on this rank, the only ones it runs and optimizes (`stages_for_rank`); every: all
    stages of each model (the same split on every rank), to bring the full copies back in sync (`gather`).
    """

    def __init__(self, layout: ParallelLayout, rank: int, models: Mapping[str, Transformer]) -> None:
        self.layout, self.rank = layout, rank
        self.local = stages_for_rank(layout, rank, models)
        self.every = {m: split_stages(models[m], layout.stages(m)) for m in MODELS}

    def parameters(self, model: str) -> list[nn.Parameter]:
        """The parameters of this rank's stages of `model`, each once, in stage order."""
        seen: dict[int, nn.Parameter] = {}
        for (m, _, _), module in sorted(self.local.items()):
            if m == model:
                for p in module.parameters():
                    seen.setdefault(id(p), p)
        return list(seen.values())

    def layer_ranges(self) -> dict[str, list[tuple[int, int]]]:
        return {m: [stage.layer_range for stage in self.every[m]] for m in MODELS}

    def shard(self) -> dict[str, Tensor]:
        """This rank's stage weights, keyed `<model>.r<replica>.s<stage>.<parameter>`."""
        return {
            f"{m}.r{r}.s{s}.{name}": tensor
            for (m, r, s), module in sorted(self.local.items())
            for name, tensor in module.state_dict().items()
        }

    def load_shard(self, weights: Mapping[str, Tensor]) -> None:
        """The inverse of `shard`."""
        for (m, r, s), module in self.local.items():
            prefix = f"{m}.r{r}.s{s}."
            module.load_state_dict({k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)})

    def gather(self) -> None:
        """Collective: every stage of both models broadcast from its first owner, so that every rank's full
        copies hold the trained weights."""
        for m in MODELS:
            for s, stage in enumerate(self.every[m]):
                owner = self.layout.rank(m, 0, 0, s)
                params = list(stage.parameters())
                flat = torch.cat([p.detach().reshape(-1) for p in params])
                distributed.broadcast(flat, owner)  # on the stage's device (the layout's)
                if self.rank != owner:
                    offset = 0
                    with torch.no_grad():
                        for p in params:
                            p.copy_(flat[offset : offset + p.numel()].view_as(p))
                            offset += p.numel()
