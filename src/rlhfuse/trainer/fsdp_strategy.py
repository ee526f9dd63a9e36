"""`pipeline=fsdp`: sharded data parallelism (FSDP2, `rlhfuse.distributed.fsdp`) over one process per generation
instance, the launch and the rollout of `pipeline=plain`.

Each rank keeps 1/world of the Actor's, the Critic's, the Ref's and the Reward's weights, of the trained models'
gradients and of their optimizer states (`memory/param_bytes`, `memory/optimizer_bytes`), instead of whole copies.
The update is `PlainStrategy`'s (every rank trains its Karmarkar-Karp share of each mini-batch, each micro-batch
weighted by its share of the whole mini-batch; the gradient is the sum over ranks), with FSDP's reduce-scatter in
place of the bucketed all-reduce: each layer's gradients are reduced during the last micro-batch's backward as
soon as they are final. A layer's weights are gathered for its forward and backward and freed after, so every
training forward is collective: a rank with fewer micro-batches runs its last one again with weight 0, and a
non-finite loss does not skip a backward (every rank runs the same reductions; the step is then dropped on all).

The rollout keeps the models sharded (`ShardedInference`): each rank is one generation instance with a whole
Actor copy (the long tail migrates between them as under pipeline=plain), the samples are gathered on every rank,
then every rank infers its share with the sharded models in lockstep (their forwards gather one layer at a time,
so every rank runs as many). Inference does not overlap the generation tail here (no inter-stage fusion): the
price of never holding a whole Ref, Reward or Critic. The weight sync gathers the Actor on every rank (each rank
is a whole generation instance: it needs all of it) into the generator's copy.

Checkpoints (`FSDPCheckpointer`): the sharded model and optimizer states through torch.distributed.checkpoint
(every rank writes its shards; the files load on any world size), the schedulers and the trainer's state written
by rank 0, sealed by rank 0's meta.json (kind "fsdp") once every rank's part is written.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist  # the WORLD group handle only: collectives go through rlhfuse.distributed
from lightning.fabric import Fabric
from torch import Tensor

from rlhfuse import distributed
from rlhfuse.core.advantages import AlgorithmConfig
from rlhfuse.core.balance import karmarkar_karp, sample_costs
from rlhfuse.core.buckets import merged_weight_buckets
from rlhfuse.core.checkpoint import mismatch_error, prune_run, seal_fields, sha256
from rlhfuse.core.errors import CheckpointError
from rlhfuse.core.optim import OptimConfig, cast_to, set_peak_lr
from rlhfuse.core.protocols import Checkpointer
from rlhfuse.core.stats import TrainStats
from rlhfuse.core.types import Experience, Rollout, TrainBatch
from rlhfuse.distributed.fsdp import (
    ShardingPolicy,
    load_state,
    save_state,
    set_gradient_sync,
    set_sharded_state,
    shard_model,
    sharded_state,
    whole_state_buckets,
    whole_tensor,
)
from rlhfuse.models import Transformer, joined, metered
from rlhfuse.models.lora import LoraConfig
from rlhfuse.runtime.sharded_checkpoint import all_ok, open_sealed
from rlhfuse.trainer.plain_strategy import PlainStrategy

KIND, FORMAT = "fsdp", 1
DCP_DIR, STATE = "dcp", "state.pt"


class ShardedReduceScatter:
    """`GradientSync` of sharded models: FSDP reduce-scatters each layer's gradients in the last backward, as soon
    as they are final; the earlier backwards accumulate unreduced. Every pass gathers weights, so every rank runs
    as many: a rank with fewer micro-batches repeats its last one with weight 0 (it adds nothing)."""

    collective_passes = True

    def __init__(self, models: Sequence[torch.nn.Module], group: Any) -> None:
        self.models, self.group = list(models), group

    def align(self, micros: list[TrainBatch], weights: list[float]) -> tuple[list[TrainBatch], list[float]]:
        device = next(self.models[0].parameters()).device
        count = torch.tensor([float(len(micros))], dtype=torch.float64, device=device)
        distributed.all_reduce(count, op="max", group=self.group)
        extra = int(count.item()) - len(micros)
        return micros + [micros[-1]] * extra, weights + [0.0] * extra

    def before_backward(self, last: bool) -> None:
        set_gradient_sync(self.models, last)

    def finish(self) -> None:
        """Nothing left: the last backward reduced every layer (FSDP waits for them before `step`)."""

    def wait(self) -> None:
        """FSDP's reductions complete inside the backward's end."""


class ShardedStrategy:
    """`pipeline=fsdp`'s `Strategy`: the four models sharded in place over the world, the update
    `PlainStrategy`'s over the shards (its optimizers are built over the sharded parameters: their states are
    sharded too), with `ShardedReduceScatter` in place of the bucketed all-reduce."""

    def __init__(
        self,
        actor: Transformer,
        critic: Transformer | None,
        config: OptimConfig,
        algorithm: AlgorithmConfig,
        *,
        frozen: Sequence[Transformer | None],
        policy: ShardingPolicy,
        fabric: Fabric,
        total_steps: int,
        micro_batch_size: int,
        micro_batch_tokens: int = 0,
        temperature: float = 1.0,
        packing: bool = False,
        lora: LoraConfig | None = None,
    ) -> None:
        self.lora = lora  # the Actor's adapters (model.lora), None for a fully trained Actor
        # the Ref and the Reward (frozen: sharded weights, no gradients or optimizer)
        self.frozen = [m for m in frozen if m is not None and m is not actor and m is not critic]
        self.policy, self.config = policy, config
        device_type = fabric.device.type  # the models may still be in host memory: sharding moves them
        trained = [actor] if critic is None else [actor, critic]
        for model in (*trained, *self.frozen):
            shard_model(
                model, model.layers, policy, device_type=device_type, forward_methods=("packed_outputs",)
            )
        group = dist.group.WORLD
        self.update = PlainStrategy(
            actor,
            critic,
            config,
            algorithm,
            fabric=fabric,
            total_steps=total_steps,
            micro_batch_size=micro_batch_size,
            micro_batch_tokens=micro_batch_tokens,
            temperature=temperature,
            group=group,
            packing=packing,
            sync=ShardedReduceScatter(trained, group),
        )
        self.group = group
        self.checkpointer: Checkpointer = FSDPCheckpointer(self)
        self.weight_sync_bytes = 0.0
        self.weight_sync_extra_bytes = 0.0

    @property
    def actor(self) -> Transformer:
        return self.update.actor

    @property
    def critic(self) -> Transformer | None:
        return self.update.critic

    @property
    def algorithm(self) -> AlgorithmConfig:
        return self.update.algorithm

    def train_step(self, batch: TrainBatch) -> TrainStats:
        return self.update.train_step(batch)

    def optimizers_in_use(self) -> list[torch.optim.Optimizer]:
        return self.update.optimizers

    def actor_weights(self) -> Mapping[str, Tensor]:
        """Collective: `actor_weight_buckets()` all at once (the whole Actor on every rank)."""
        return joined(self.actor_weight_buckets())

    def actor_weight_buckets(self) -> Iterator[Mapping[str, Tensor]]:
        """Collective: the Actor's whole weights on every rank (each rank's generator copy is a whole instance),
        gathered bucket by bucket (pipeline.weight_sync_bucket_mb) in the generator's dtype (each shard cast
        before the gather): each rank receives the shards it lacks and holds one bucket of gathered tensors at a
        time. A LoRA Actor: only its adapted projections, each merged on the shards (W + scale B A on this
        rank's rows of W and B, the small A gathered) and then gathered whole; the copies' frozen rest never
        changes."""
        cap = self.config.weight_sync_bucket_bytes
        dtype = self.config.weight_sync_dtype(self.update.fabric.device.type)  # bf16: half the bytes
        if self.lora is None:
            buckets: Iterator[Mapping[str, Tensor]] = whole_state_buckets(self.actor, cap, dtype)
        else:
            buckets = (
                {n: whole_tensor(t.to(cast_to(t.dtype, dtype))) for n, t in b.items()}
                for b in merged_weight_buckets(self.actor, cap)
            )
        world = distributed.world_size(self.group)
        total = 0
        for bucket, peak in metered(buckets, self.actor):
            total += sum(t.numel() * t.element_size() for t in {id(t): t for t in bucket.values()}.values())
            self.weight_sync_bytes = float(total * (world - 1) / world)
            self.weight_sync_extra_bytes = float(peak)
            yield bucket

    def sharded_state(self) -> dict[str, Any]:
        """The trained models' and optimizers' states (DTensors: this rank's shards)."""
        return sharded_state(self.trained, self.trained_optimizers)

    def scheduler_state(self) -> dict[str, Any]:
        return {f"{name}_sched": sched.state_dict() for name, sched in self.schedulers.items()}

    def state_dict(self) -> dict[str, Any]:
        """The sharded weights and optimizer states, and the LR schedulers' states."""
        return {**self.sharded_state(), **self.scheduler_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict()`'s entries; the configured learning rates replace the checkpoint's."""
        set_sharded_state(state, self.trained, self.trained_optimizers)
        peaks = {"actor": self.config.actor_lr, "critic": self.config.critic_lr}
        for name, sched in self.schedulers.items():
            sched.load_state_dict(state[f"{name}_sched"])
            set_peak_lr(self.trained_optimizers[name], sched, peaks[name])  # a resume may change it

    @property
    def trained(self) -> dict[str, torch.nn.Module]:
        """The trained models by checkpoint name."""
        return dict(zip(("actor", "critic"), self.update.models, strict=False))

    @property
    def trained_optimizers(self) -> dict[str, torch.optim.Optimizer]:
        return dict(zip(self.trained, self.update.optimizers, strict=True))

    @property
    def schedulers(self) -> dict[str, torch.optim.lr_scheduler.LambdaLR]:
        found = {"actor": self.update.actor_sched}
        if self.update.critic_sched is not None:
            found["critic"] = self.update.critic_sched
        return found


class FSDPCheckpointer:
    """`pipeline=fsdp`'s `Checkpointer` (collective: every rank saves and loads its shards).

    Layout of `<run_dir>/checkpoints/iter_00000010/`:
        dcp/        torch.distributed.checkpoint's files: the trained models' and optimizers' sharded states
        state.pt    the LR schedulers' states and the trainer's (iteration, data position, RNG), by rank 0
        meta.json   written last, by rank 0: kind "fsdp", iteration, world size, the trained models and the
                    SHA-256 of every file
    Atomic as a whole: written into a temporary folder that rank 0 renames into place once every rank's shards
    are written; a failure on any rank leaves the previous checkpoints untouched.
    """

    def __init__(self, strategy: ShardedStrategy) -> None:
        self.strategy = strategy

    def save(
        self,
        directory: str | Path,
        iteration: int,
        extra: Mapping[str, Any],
        *,
        keep: int = 0,
        run: str | None = None,
    ) -> Path:
        s = self.strategy
        rank = distributed.rank()
        root = Path(directory)
        folder = open_sealed(root, iteration, "fsdp")
        error: str | None = None
        # collective; DCP raises the same error on every rank when one cannot write
        save_state(folder.path / DCP_DIR, s.sharded_state())
        if rank == 0:
            try:
                torch.save({**s.scheduler_state(), **extra}, folder.path / STATE)
                record = {
                    "kind": KIND,
                    "format": FORMAT,
                    "iteration": iteration,
                    "world_size": distributed.world_size(),
                    "models": list(s.trained),
                }
                folder.seal({**record, **seal_fields(run)})  # hashes every file: the DCP shards and STATE
                prune_run(root, run, keep)
            except OSError as err:
                folder.discard()
                error = f"cannot seal {folder.final}: {err}"
        all_ok(error, f"checkpoint of iteration {iteration} not written (previous checkpoints untouched)")
        return folder.final

    def load(self, path: str | Path) -> dict[str, Any]:
        """Check meta.json and every file, then restore the shards (written on any world size) and the
        schedulers; the configured learning rates replace the checkpoint's. Returns the saved state."""
        s = self.strategy
        path = Path(path)
        names = distributed.all_gather_json(str(path.resolve()), distributed.group_device())
        if len(set(names)) != 1:
            raise CheckpointError(
                f"ranks would resume from different checkpoints: {names} (use a shared folder)"
            )
        error: str | None = None
        try:
            check_fsdp_checkpoint(path, list(s.trained), s.algorithm.name)
        except CheckpointError as err:
            error = str(err)
        all_ok(error, "cannot resume")
        shards = s.sharded_state()
        load_state(path / DCP_DIR, shards)
        state: dict[str, Any] = torch.load(path / STATE, map_location="cpu", weights_only=True)
        try:
            s.load_state_dict({**shards, **state})
        except (RuntimeError, ValueError, KeyError) as err:
            raise mismatch_error(path, err) from None
        return state


def check_fsdp_checkpoint(path: Path, models: list[str], algorithm: str) -> dict[str, Any]:
    """meta.json of an fsdp checkpoint folder, every file present and matching its SHA-256, written for the
    same trained models; a CheckpointError naming the file and the fix otherwise."""
    meta_path = path / "meta.json"
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(
            f"{meta_path} cannot be read ({err}): not a complete checkpoint; resume from another one "
            "(resume=<checkpoint folder>) or remove it"
        ) from None
    if not isinstance(meta, dict) or meta.get("kind") != KIND:
        kind = meta.get("kind", "single-process") if isinstance(meta, dict) else "unknown"
        raise CheckpointError(
            f"{meta_path} is a {kind} checkpoint, not one of pipeline=fsdp: resume it with the pipeline that "
            "wrote it"
        )
    if meta.get("models") != models:
        raise CheckpointError(
            f"{meta_path} holds the models {meta.get('models')} but algorithm.name={algorithm} trains {models}: "
            "resume it with the algorithm that wrote it"
        )
    for name, digest in dict(meta.get("sha256", {})).items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint file {file} is missing")
        if sha256(file) != digest:
            raise CheckpointError(
                f"checkpoint file {file} does not match its SHA-256 in meta.json (corrupt or tampered)"
            )
    return meta


@runtime_checkable
class RowInferencer(Protocol):
    """What `ShardedInference` runs each rank's share of the rows with (`ModelInferencer` is one)."""

    actor: Transformer

    def groups(self, rollout: Rollout, rows: Sequence[int] | None = None) -> list[list[int]]: ...

    def infer_rows(
        self, rollout: Rollout, index_G: Tensor
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]: ...

    def prefetch(self) -> None: ...

    def release(self) -> None: ...


class ShardedInference:
    """`pipeline=fsdp`'s inference stage: every rank holds the whole rollout (the generation instances gather
    it), infers its share (Karmarkar-Karp by sequence cost, as training splits a mini-batch) with the sharded
    models, and the shares are summed back into the rollout's rows on every rank (each row computed by exactly
    one rank, zeros elsewhere: the sum is exact).

    The sharded models' forwards gather each layer from every rank, so every rank runs as many forward passes:
    one with fewer groups of rows runs its last group again (its results dropped). The models are never whole on
    a rank, so the rollout's memory is the generation copy, its KV cache and one gathered layer at a time."""

    def __init__(self, inferencer: RowInferencer, group: Any) -> None:
        self.inferencer, self.group = inferencer, group

    def prefetch(self) -> None:
        self.inferencer.prefetch()

    def release(self) -> None:
        self.inferencer.release()

    @torch.no_grad()
    def infer(self, rollout: Rollout) -> Experience:
        world, rank = distributed.world_size(self.group), distributed.rank(self.group)
        lengths = rollout.attention_mask_BT.sum(dim=1).tolist()  # the generator's host copy: no device sync
        mine = karmarkar_karp(sample_costs(lengths), world)[rank] if len(rollout) >= world else []
        if len(rollout) < world and rank < len(rollout):
            mine = [rank]
        groups = self.inferencer.groups(rollout, mine)
        device = next(self.inferencer.actor.parameters()).device
        count = torch.tensor([float(len(groups))], dtype=torch.float64, device=device)
        distributed.all_reduce(count, op="max", group=self.group)
        rollout = rollout.to(device)
        out: list[Tensor] = []
        for i in range(int(count.item())):
            real = i < len(groups)
            rows = groups[i] if real else (groups[-1] if groups else [0])  # a repeat: dropped
            index_G = torch.tensor(rows, device=device)
            part = self.inferencer.infer_rows(rollout, index_G)
            if not out:
                out = [torch.zeros((len(rollout), *p.shape[1:]), dtype=p.dtype, device=device) for p in part]
            if real:
                for whole, piece in zip(out, part, strict=True):
                    whole[index_G] = piece
        return Experience(rollout, *sum_over_ranks(out, self.group))


def sum_over_ranks(tensors: Sequence[Tensor], group: Any) -> list[Tensor]:
    """`tensors` summed over the ranks of `group` in one all-reduce (flattened into one float64 buffer on
    their device, so that every dtype's values survive the sum exactly when one rank holds each)."""
    flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors])
    distributed.all_reduce(flat, group=group)
    out, start = [], 0
    for t in tensors:
        out.append(flat[start : start + t.numel()].view(t.shape).to(t.dtype))
        start += t.numel()
    return out
