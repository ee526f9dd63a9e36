"""`pipeline=fsdp` as a part: the launch of `pipeline=plain` (one process per generation instance) with the four
models, their gradients and optimizer states sharded over the processes (`training.ShardedStrategy`), inferring
row by row with the sharded models (`inference.ShardedInference`), saving through torch.distributed.checkpoint
(`checkpoint.FSDPCheckpointer`, loadable on another world size)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from rlhfuse.core.protocols import Callback, Inferencer
from rlhfuse.trainer.strategies.base import ExportTarget, StrategyPart, adapter_export

if TYPE_CHECKING:
    import torch

    from rlhfuse.models import ModelConfig
    from rlhfuse.trainer.components import BuildContext
    from rlhfuse.trainer.run_config import RLHFConfig
    from rlhfuse.trainer.strategies.fsdp.training import ShardedStrategy
    from rlhfuse.trainer.topology import Topology


@dataclass(frozen=True, kw_only=True)
class FSDPStrategy(StrategyPart):
    """`pipeline=fsdp`: the four models, gradients and optimizer states sharded over the processes (torch FSDP2);
    each rank infers its share of the rollout with the sharded models."""

    name: ClassVar[str] = "fsdp"
    reshardable: ClassVar[bool] = True
    whole_models: ClassVar[bool] = False
    cpu_offload: bool = False
    reshard_after_forward: bool = True

    @classmethod
    def problems(cls, cfg: RLHFConfig, layout: Topology, model: ModelConfig | None) -> list[str]:
        """One process per generation instance like plain, no stages, and its own keys."""
        from rlhfuse.trainer.rules import stageless_problems
        from rlhfuse.trainer.strategies.plain.launch import validate_plain_launch

        return validate_plain_launch(cfg) + stageless_problems(cfg) + offload_problems(cfg)

    @classmethod
    def launch_problems(cls, cfg: RLHFConfig) -> list[str]:
        from rlhfuse.trainer.topology import topology

        return cls.problems(cfg, topology(cfg), None)

    def build(self, ctx: BuildContext) -> ShardedStrategy:
        """`PlainStrategy`'s data parallelism over the sharded models. The generators copy a whole Actor
        (`Models.for_generation`), so one is kept aside before the Actor is sharded in place."""
        import torch

        from rlhfuse.core.optim import generation_dtype, resolve_precision
        from rlhfuse.distributed.fsdp import ShardingPolicy
        from rlhfuse.models import cast_copy
        from rlhfuse.trainer.strategies.fsdp.training import ShardedStrategy

        cfg, models = ctx.config, ctx.models
        device = ctx.fabric.device
        precision = resolve_precision(cfg.pipeline.optim.precision, device.type)
        if models.generation is None:
            models.generation = cast_copy(models.actor, generation_dtype(precision))
        models.generation.to(device)  # read into host memory (`load_device`), like the models sharded below
        policy = ShardingPolicy(
            # bf16-mixed: layers compute in bf16 (the shards, and the gradient reduction, stay fp32)
            param_dtype=torch.bfloat16 if precision == "bf16-mixed" else None,
            cpu_offload=cfg.pipeline.cpu_offload,
            reshard_after_forward=cfg.pipeline.reshard_after_forward,
        )
        frozen = [models.ref, models.reward if cfg.inferencer.use_reward_model else None]
        return ShardedStrategy(
            models.actor,
            models.critic,
            cfg.pipeline.optim,
            cfg.algorithm,
            frozen=frozen,
            policy=policy,
            fabric=ctx.fabric,
            total_steps=ctx.total_steps,
            micro_batch_size=cfg.data.micro_batch_size,
            micro_batch_tokens=cfg.data.micro_batch_tokens,
            temperature=cfg.generator.sampling.temperature,
            packing=cfg.data.packing,
            lora=cfg.model.lora if cfg.model.lora.enabled else None,
            group=ctx.topology.groups.world,
        )

    def load_device(self, device: torch.device) -> torch.device:
        """Host memory: each unit moves to the device as it is sharded, so no model is ever whole there."""
        import torch

        return torch.device("cpu")

    def inference(self, inferencer: Inferencer, strategy: Any) -> Inferencer:
        from rlhfuse.trainer.strategies.fsdp.inference import RowInferencer, ShardedInference

        if not isinstance(inferencer, RowInferencer):  # it splits the rollout by rows and runs them itself
            raise TypeError(
                f"FSDPStrategy infers with the sharded models row by row (`RowInferencer`: groups, infer_rows, "
                f"actor); the inferencer built, a {type(inferencer).__name__}, has not these: return one that has "
                "(ModelInference's build does)"
            )
        return ShardedInference(inferencer, strategy.group)

    def export(self, target: ExportTarget) -> Callback | None:
        from rlhfuse.distributed.fsdp import full_state
        from rlhfuse.trainer.callbacks import ExportShardedActor

        strategy = target.strategy

        def whole() -> Mapping[str, torch.Tensor]:  # collective: every rank gathers, rank 0 writes
            return full_state(strategy.actor)

        if target.config.model.lora.enabled:
            return adapter_export(target, whole, write=target.rank0)
        return ExportShardedActor(
            whole, strategy.actor.config, target.models.tokenizer, target.path, write=target.rank0
        )


def offload_problems(cfg: RLHFConfig) -> list[str]:
    """pipeline.cpu_offload moves shards between host and device, which a CPU run has not."""
    from rlhfuse.trainer.rules import uses_cuda

    if cfg.pipeline.cpu_offload and not uses_cuda(cfg):
        return [
            "pipeline.cpu_offload=true keeps the shards in host memory and copies each layer to the device, but "
            f"this run's device is the CPU (device={cfg.device}): the shards are in host memory already; set "
            "pipeline.cpu_offload=false"
        ]
    return []
