"""Sharded data parallelism with torch's FSDP2 (`torch.distributed.fsdp.fully_shard`) and its checkpoints
(`torch.distributed.checkpoint`): the one module that drives them, for `pipeline=fsdp`.

`shard_model` shards a model in place over a process group: every decoder layer is one FSDP unit (its weights
all-gathered just before its forward and backward, freed after), the root unit holds the rest (embeddings, final
norm, heads). Gradients are reduce-scattered during backward, each unit as soon as its gradients are final, so the
reduction overlaps with the remaining backward as DDP's buckets do; the reduction *sums* (each rank's loss is
already weighted by its share of the whole mini-batch, as `PlainStrategy`'s all-reduce expects).

Every forward and backward of a sharded model is collective: all ranks of the group must run the same number of
them, in the same order. Where ranks do unequal work (the rollout: generation and inference are fused across the
ranks, each inferring the samples it finished or stole), `gathered` all-gathers every unit once, at a point every
rank reaches together, and keeps the whole weights until the block ends: forwards inside issue no collective.

`full_state` gathers a model's whole weights on every rank (the weight sync to each rank's generation copy);
`save_state` / `load_state` write and read sharded model and optimizer states with DCP, whose files load on any
world size (DCP reshards on load).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.distributed.tensor import DTensor

from rlhfuse.core.buckets import split_consecutive
from rlhfuse.core.optim import cast_to


@dataclass(frozen=True)
class ShardingPolicy:
    """How `shard_model` shards: the dtype units compute in (None: the weights' own; bf16 under bf16-mixed, the
    shards and the gradient reduction staying fp32), whether the shards and hence the optimizer states live in
    host memory (copied to the device for each all-gather), and whether a layer frees its gathered weights
    after its forward (true: ZeRO-3; false: kept until backward, ZeRO-2's memory)."""

    param_dtype: torch.dtype | None = None
    cpu_offload: bool = False
    reshard_after_forward: bool = True

    def mixed_precision(self) -> MixedPrecisionPolicy:
        reduce = None if self.param_dtype is None else torch.float32
        return MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=reduce)

    def offload(self) -> OffloadPolicy:
        # pinned host memory makes the copies asynchronous; pinning needs CUDA
        return CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if self.cpu_offload else OffloadPolicy()


def shard_model(
    model: nn.Module,
    layers: Iterable[nn.Module],
    policy: ShardingPolicy,
    *,
    device_type: str,
    group: Any = None,
    forward_methods: Sequence[str] = (),
) -> None:
    """Shard `model` in place over `group` (default: the world): each of `layers` one unit, the root the rest.
    `forward_methods` are the model's methods other than `forward` that run it whole (their calls gather and
    free like a forward)."""
    group = group if group is not None else dist.group.WORLD
    # The models return views (a value head's squeeze, a packed call's row); FSDP warns that an in-place op on
    # one would skip the backward's gather. Nothing in rlhfuse modifies a model's output in place.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    mesh = DeviceMesh.from_group(group, device_type)
    args: dict[str, Any] = dict(
        mesh=mesh, mp_policy=policy.mixed_precision(), offload_policy=policy.offload()
    )
    # A frozen model (the Ref, the Reward) has no backward to free what a forward kept gathered: its units free
    # their weights after every forward whatever the policy, or its layers (and its whole embedding table and
    # head) would stay on the rank after inference. The root unit (embeddings, final norm, heads) of a trained
    # model keeps its weights from its forward to its backward, which needs them at once (FSDP's default).
    trained = any(p.requires_grad for p in model.parameters())
    for layer in layers:
        fully_shard(layer, reshard_after_forward=policy.reshard_after_forward or not trained, **args)
    fully_shard(model, reshard_after_forward=not trained, **args)
    for name in forward_methods:
        register_fsdp_forward_method(model, name)
    for unit in units(model):
        # a sum: the losses are weighted by each rank's share already; a plain SUM reduction (no PREMUL_SUM op,
        # which gloo lacks; NCCL's zero-copy path wants SUM too) and a division by 1 after it
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)


def units(model: nn.Module) -> list[FSDPModule]:
    """The FSDP units of `model`, the root first."""
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def is_sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def set_gradient_sync(models: Iterable[nn.Module], enabled: bool) -> None:
    """Whether the next backward reduce-scatters the gradients (false: accumulate them unreduced, for all but the
    last micro-batch of a step)."""
    for model in models:
        assert isinstance(model, FSDPModule), type(model)
        model.set_requires_gradient_sync(enabled)


def full_state(model: nn.Module) -> dict[str, Tensor]:
    """Collective: `model`'s whole state dict on every rank (each rank receives the shards it lacks)."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {name: t for name, t in state.items() if isinstance(t, Tensor)}


def whole_state_buckets(
    model: nn.Module, cap_bytes: int, dtype: torch.dtype | None = None
) -> Iterator[dict[str, Tensor]]:
    """Collective (every rank consumes every bucket): `full_state(model)` in buckets of consecutive tensors of at
    most `cap_bytes` whole (a larger one alone), each gathered when it is asked for, so a rank holds one bucket's
    gathered tensors at a time rather than the whole model. Tied names share one gathered tensor. `dtype`: the
    floating-point tensors cast to it on their shards before the gather (a bf16 generator receives half the
    bytes of fp32 training weights)."""
    names: dict[int, list[str]] = {}
    tensors: dict[int, Tensor] = {}
    for name, t in model.state_dict().items():
        if isinstance(t, Tensor):
            names.setdefault(id(t), []).append(name)
            tensors.setdefault(id(t), t)
    order = list(tensors)
    sent = {k: cast_to(tensors[k].dtype, dtype) for k in order}
    # whole shapes, the same on every rank
    sizes = [tensors[k].numel() * torch.empty((), dtype=sent[k]).element_size() for k in order]
    for run in split_consecutive(sizes, cap_bytes):
        bucket: dict[str, Tensor] = {}
        for k in (order[i] for i in run):
            whole = whole_tensor(tensors[k].detach().to(sent[k]))
            bucket.update(dict.fromkeys(names[k], whole))
        yield bucket


def whole_tensor(t: Tensor) -> Tensor:
    """Collective for a sharded (DTensor) `t`: the whole tensor on every rank (each rank receives the shards it
    lacks); `t` itself otherwise."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def local_tensor(t: Tensor) -> Tensor:
    """What this rank holds of `t`: its shard for a sharded (DTensor) parameter, `t` itself otherwise."""
    return t.to_local() if isinstance(t, DTensor) else t


def grad_norm_value(norm: Tensor) -> float:
    """`clip_grad_norm_`'s result as a number (over sharded gradients it is a replicated DTensor)."""
    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)


def sharded_state(
    models: Mapping[str, nn.Module], optimizers: Mapping[str, torch.optim.Optimizer]
) -> dict[str, Any]:
    """The models' and optimizers' sharded state dicts (`name` and `name_optim`; an optimizer is keyed by the
    name of the model it steps); of a model, its trained tensors (a LoRA Actor's adapters)."""
    state: dict[str, Any] = {
        name: get_model_state_dict(model, options=_TRAINED) for name, model in models.items()
    }
    for name, optim in optimizers.items():
        state[f"{name}_optim"] = get_optimizer_state_dict(models[name], optim)
    return state


# A model's trained tensors only: a LoRA Actor's adapters (its frozen base is the SFT checkpoint, reloaded on
# resume), every tensor of a fully trained one.
_TRAINED = StateDictOptions(ignore_frozen_params=True, strict=False)


def set_sharded_state(
    state: Mapping[str, Any], models: Mapping[str, nn.Module], optimizers: Mapping[str, torch.optim.Optimizer]
) -> None:
    """Load `sharded_state`'s entries back into the models and optimizers."""
    for name, model in models.items():
        set_model_state_dict(model, state[name], options=_TRAINED)
    for name, optim in optimizers.items():
        set_optimizer_state_dict(models[name], optim, state[f"{name}_optim"])


def save_state(path: str | Path, state: Mapping[str, Any]) -> None:
    """Collective: write a sharded state (`sharded_state`) into the folder `path`, every rank its shards."""
    dcp.save(dict(state), checkpoint_id=str(path))


def load_state(path: str | Path, state: dict[str, Any]) -> None:
    """Collective: read `save_state`'s folder (written on any world size) into `state`, a sharded state of the
    same entries (its tensors are overwritten in place, resharded for this world)."""
    dcp.load(state, checkpoint_id=str(path))
