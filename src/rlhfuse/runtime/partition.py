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
from typing import Any

import torch
from torch import Tensor, nn

from rlhfuse import distributed
from rlhfuse.models import Transformer, split_stages, stage_of
from rlhfuse.models.lora import load_trained_state, trained_state
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
    for model, replica, stage in layout.trained_stages_on(rank):
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
    """This rank's share of the trained models (`layout.trained`: the Actor and the Critic, or the Actor alone
    for a critic-free algorithm), sharded or full copies on every rank (same weights).

    local: the stages placed on this rank, the only ones it runs and optimizes (`stages_for_rank`); every: all
    stages of each model (the same split on every rank), to bring the full copies back in sync (`gather`).
    """

    def __init__(
        self,
        layout: ParallelLayout,
        rank: int,
        models: Mapping[str, Transformer],
        tp_group: Any = None,
        tp_groups: Mapping[str, Any] | None = None,
    ) -> None:
        self.layout, self.rank, self.tp_group = layout, rank, tp_group
        # model -> this rank's tp group of that model (`ProcessGroups.model_tp`; default: tp_group for both)
        self.tp_groups = {m: (tp_groups or {}).get(m, tp_group) for m in layout.trained}
        self.models = dict(models)
        self.local = stages_for_rank(layout, rank, models)
        self.every = {m: split_stages(models[m], layout.stages(m)) for m in layout.trained}
        # sharded: some stage lives on another rank only (its tensors here are meta: shape and dtype, no memory),
        # or the models are tensor-parallel shards (`rlhfuse.runtime.tensor_parallel.shard_transformer`)
        self.sharded = layout.tp > 1 or any(p.is_meta for m in layout.trained for p in models[m].parameters())
        # (tp > 1 with one model at tp = 1: that model's stages are still split over the pipeline ranks' ranks)
        missing = [k for k, mod in self.local.items() if any(p.is_meta for p in mod.parameters())]
        if missing:
            raise ValueError(
                f"rank {rank} runs stages {missing} but their weights were not loaded here: build the models with "
                "the layout's stages of this rank (rlhfuse.models.from_pretrained(stages=...))"
            )
        self.received_bytes = 0
        """Bytes this rank received in the last `full_state`."""

    def _whole_state(self, model: str) -> dict[str, Tensor]:
        """`model`'s state dict as whole tensors (tp > 1: the held stages' shards reassembled over the tp group,
        `unshard_state`; meta tensors of the whole shape for the stages held elsewhere)."""
        module = self.models[model]
        if self.layout.model_tp(model) == 1:
            return module.state_dict(keep_vars=True)
        from rlhfuse.runtime.tensor_parallel import unshard_state

        return unshard_state(module, self.tp_groups[model])

    def senders(self, model: str, stage: int) -> dict[int, int]:
        """rank -> the rank that sends it `stage` of `model`, for every rank not holding that stage: the holders
        (every replica and data-parallel copy of the stage, identical weights) taken in turn, so the traffic is
        spread over them and a rank that holds the stage receives nothing."""
        holders = sorted(set(self.layout.grad_groups[(model, stage)]))
        needers = [r for r in range(self.layout.world_size) if r not in holders]
        return {r: holders[i % len(holders)] for i, r in enumerate(needers)}

    def shard_senders(self, model: str, stage: int) -> dict[int, int]:
        """`senders` per tp position: rank -> the rank that sends it its tp shard of `stage`, a holder of the same
        shard (same tp position), for every rank of that position not holding the stage."""
        out: dict[int, int] = {}
        layout = self.layout
        for t in range(layout.model_tp(model)):
            holders = sorted(set(layout.tp_grad_groups[(model, stage, t)]))
            needers = [
                r for r in range(layout.world_size) if layout.tp_rank(r, model) == t and r not in holders
            ]
            out.update({r: holders[i % len(holders)] for i, r in enumerate(needers)})
        return out

    def _exchange(
        self, model: str, shards: bool = False, state: Mapping[str, Tensor] | None = None
    ) -> list[tuple[list[list[str]], list[Tensor], bool]]:
        """Collective: every stage of `model` to the ranks that lack it (point to point, holders -> needers,
        one flat buffer per stage and dtype on the layout's device; shards=True: each rank's tensor-parallel shard
        of the stage, from a holder of the same shard, `shard_senders`). Per (stage, dtype): the state-dict names of
        each distinct tensor, this rank's values (its own tensors, or views of the received buffer) and whether
        they were received. Counts `received_bytes`. `state`: these tensors of `model` instead of its state
        (names of its parameters' stages; real on the stages held here, meta elsewhere)."""
        module = self.models[model]
        n, layers = self.layout.stages(model), module.config.num_layers
        # tied weights appear under both names, once in memory
        if state is None:
            state = module.state_dict(keep_vars=True) if shards else self._whole_state(model)
        device = torch.device(self.layout.device)
        works: list[distributed.Work] = []
        keep: list[Tensor] = []
        out: list[tuple[list[list[str]], list[Tensor], bool]] = []
        self.received_bytes = 0
        for s in range(n):
            plan = self.shard_senders(model, s) if shards else self.senders(model, s)
            unique: dict[int, list[str]] = {}
            for k in state:
                if stage_of(k, layers, n) == s:
                    unique.setdefault(id(state[k]), []).append(k)
            groups: dict[torch.dtype, list[list[str]]] = {}
            for keys in unique.values():
                groups.setdefault(state[keys[0]].dtype, []).append(keys)
            for dtype, entries in sorted(groups.items(), key=lambda kv: str(kv[0])):
                tensors = [state[keys[0]] for keys in entries]
                if self.rank in plan:  # this rank lacks the stage: receive it
                    flat = torch.empty(sum(t.numel() for t in tensors), dtype=dtype, device=device)
                    works.append(distributed.irecv(flat, plan[self.rank]))
                    self.received_bytes += flat.numel() * flat.element_size()
                    views, offset = [], 0
                    for t in tensors:
                        views.append(flat[offset : offset + t.numel()].view(t.shape))
                        offset += t.numel()
                    out.append((entries, views, True))
                    continue
                mine = [dst for dst, src in sorted(plan.items()) if src == self.rank]
                if mine:
                    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
                    keep.append(flat)
                    works += [distributed.isend(flat, dst) for dst in mine]
                out.append((entries, [t.detach() for t in tensors], False))
        distributed.wait_all(works)
        return out

    def full_state(self, model: str, state: Mapping[str, Tensor] | None = None) -> dict[str, Tensor]:
        """Collective: `model`'s whole state dict on every rank (every rank is a generation instance under the
        pipeline strategies): each rank receives only the stages it does not hold, each once, from a holder
        (`senders`), into buffers allocated on the layout's device from the shapes the meta tensors keep; its own
        stages are its live tensors (detached, no copy). `state`: these tensors of a tp = 1 `model` only (real on
        the stages held here, meta of the whole shape elsewhere: a LoRA Actor's merged projections)."""
        if state is not None and self.layout.model_tp(model) > 1:
            raise ValueError(f"full_state of given tensors reassembles whole tensors; {model} is tp-sharded")
        return _by_name(self._exchange(model, state=state))

    def shard_state(self, model: str) -> dict[str, Tensor]:
        """Collective: this rank's tensor-parallel shard of every stage of `model` (a generation instance of the
        training tp degree over the same consecutive ranks): each rank receives only the shards of the stages it
        does not hold, from a holder of the same shard, never a whole tensor (`shard_senders`)."""
        return _by_name(self._exchange(model, shards=True))

    def load_resident(self, model: str, state: Mapping[str, Tensor]) -> None:
        """Copy `state`'s entries (whole tensors) into the tensors materialised on this rank (meta ones are held
        elsewhere; tp > 1: this rank's slice of each, `shard_state`)."""
        params = self.models[model].state_dict(keep_vars=True)
        if self.layout.model_tp(model) > 1:
            from rlhfuse.runtime.tensor_parallel import shard_state

            state = shard_state(self.models[model], self.layout.tp_rank(self.rank, model), state)
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
        return {m: [stage.layer_range for stage in self.every[m]] for m in self.layout.trained}

    def shard(self) -> dict[str, Tensor]:
        """This rank's trained stage weights (a LoRA Actor's adapters only: its base is the SFT checkpoint,
        reloaded on resume), keyed `<model>.r<replica>.s<stage>.<parameter>`."""
        return {
            f"{m}.r{r}.s{s}.{name}": tensor
            for (m, r, s), module in sorted(self.local.items())
            for name, tensor in trained_state(module).items()
        }

    def load_shard(self, weights: Mapping[str, Tensor]) -> None:
        """The inverse of `shard` (a shard missing a tensor, or holding others, is an error naming them)."""
        for (m, r, s), module in self.local.items():
            prefix = f"{m}.r{r}.s{s}."
            load_trained_state(
                module, {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}
            )

    def gather(self) -> None:
        """Collective: every rank's full copies of both models brought up to the trained weights: each rank
        receives the stages it does not hold (`senders`) into them in place (full copies only: sharded models
        sync with `full_state`). `received_bytes` counts both models."""
        if self.sharded:
            raise RuntimeError(
                "RankStages.gather syncs full copies; these models are sharded: use full_state"
            )
        total = 0
        for m in self.layout.trained:
            state = self.models[m].state_dict(keep_vars=True)
            for entries, values, received in self._exchange(m):
                if received:
                    with torch.no_grad():
                        for keys, value in zip(entries, values, strict=True):
                            state[keys[0]].copy_(value)
            total += self.received_bytes
        self.received_bytes = total


def _by_name(exchanged: list[tuple[list[list[str]], list[Tensor], bool]]) -> dict[str, Tensor]:
    """`RankStages._exchange`'s result as a state dict: each tensor under every name it has (tied weights)."""
    return {
        k: value
        for entries, values, _ in exchanged
        for keys, value in zip(entries, values, strict=True)
        for k in keys
    }
