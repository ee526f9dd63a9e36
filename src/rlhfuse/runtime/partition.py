"""Stage partitioning glue: the modules a rank runs, cut from the Actor and Critic by `split_stages`, and
`RankStages`, a rank's share of both models (its stages, their checkpoint shard, weight sync).

The models are either sharded (built on the meta device with only this rank's stages materialised:
`rlhfuse.models.from_pretrained(stages=...)`, the default under the pipeline strategies) or full copies on every
rank (a per-rank inferencer reads whole models); `RankStages.sharded` says which.

Layers are split into contiguous ranges balanced by `layer_costs` (equal by default); the embedding sits on
the first stage, final norm and head on the last (see `rlhfuse.models.stages`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

from rlhfuse import distributed
from rlhfuse.models import Transformer, split_stages, stage_of
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
        self.models = dict(models)
        self.local = stages_for_rank(layout, rank, models)
        self.every = {m: split_stages(models[m], layout.stages(m)) for m in MODELS}
        # sharded: some stage lives on another rank only (its tensors here are meta: shape and dtype, no memory)
        self.sharded = any(p.is_meta for m in MODELS for p in models[m].parameters())
        missing = [k for k, mod in self.local.items() if any(p.is_meta for p in mod.parameters())]
        if missing:
            raise ValueError(
                f"rank {rank} runs stages {missing} but their weights were not loaded here: build the models with "
                "the layout's stages of this rank (rlhfuse.models.from_pretrained(stages=...))"
            )
        self.received_bytes = 0
        """Bytes this rank received in the last `full_state`."""

    def full_state(self, model: str) -> dict[str, Tensor]:
        """Collective: `model`'s whole state dict on every rank (every rank is a generation instance under the
        pipeline strategies), each stage broadcast once from its owner (first replica, fused group 0) in one
        flat buffer per dtype, allocated on the layout's device from the shapes the meta tensors keep. The
        owner's entries are its live tensors (detached, no copy); received stages are fresh tensors."""
        module = self.models[model]
        n, layers = self.layout.stages(model), module.config.num_layers
        state = module.state_dict(keep_vars=True)  # tied weights appear under both names, once in memory
        out: dict[str, Tensor] = {}
        device = torch.device(self.layout.device)
        self.received_bytes = 0
        for s in range(n):
            owner = self.layout.rank(model, 0, 0, s)
            names = [k for k in state if stage_of(k, layers, n) == s]
            unique: dict[int, list[str]] = {}
            for k in names:
                unique.setdefault(id(state[k]), []).append(k)
            groups: dict[torch.dtype, list[list[str]]] = {}
            for keys in unique.values():
                groups.setdefault(state[keys[0]].dtype, []).append(keys)
            for dtype, entries in sorted(groups.items(), key=lambda kv: str(kv[0])):
                tensors = [state[keys[0]] for keys in entries]
                if self.rank == owner:
                    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
                else:
                    flat = torch.empty(sum(t.numel() for t in tensors), dtype=dtype, device=device)
                    self.received_bytes += flat.numel() * flat.element_size()
                distributed.broadcast(flat, owner)
                offset = 0
                for keys, t in zip(entries, tensors, strict=True):
                    value = (
                        t.detach() if self.rank == owner else flat[offset : offset + t.numel()].view(t.shape)
                    )
                    offset += t.numel()
                    for k in keys:
                        out[k] = value
        return out

    def load_resident(self, model: str, state: Mapping[str, Tensor]) -> None:
        """Copy `state`'s entries into the tensors materialised on this rank (meta ones are held elsewhere)."""
        params = self.models[model].state_dict(keep_vars=True)
        with torch.no_grad():
            for name, target in params.items():
                if not target.is_meta:
                    target.copy_(state[name])

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
        copies hold the trained weights (full copies only: sharded models sync with `full_state`)."""
        if self.sharded:
            raise RuntimeError(
                "RankStages.gather syncs full copies; these models are sharded: use full_state"
            )
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
