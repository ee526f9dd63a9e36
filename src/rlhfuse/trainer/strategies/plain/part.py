"""`pipeline=plain` as a part: whole models on every rank; one process, or data parallelism over one process per
generation instance (`launch`), trained by `PlainStrategy` (`training`), inferring with whole models
(`inference.ModelInferencer`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from rlhfuse.trainer.strategies.base import StrategyPart

if TYPE_CHECKING:
    from rlhfuse.trainer.components import BuildContext
    from rlhfuse.trainer.strategies.plain.training import PlainStrategy


@dataclass(frozen=True, kw_only=True)
class DataParallelStrategy(StrategyPart):
    """`pipeline=plain`: whole models on every rank; one process, or data parallelism over one process per
    generation instance (`generator.instances`)."""

    name: ClassVar[str] = "plain"

    def build(self, ctx: BuildContext) -> PlainStrategy:
        from rlhfuse.trainer.strategies.plain.training import PlainStrategy

        return PlainStrategy(
            ctx.models.actor,
            ctx.models.critic,
            ctx.config.pipeline.optim,
            ctx.config.algorithm,
            fabric=ctx.fabric,
            total_steps=ctx.total_steps,
            micro_batch_size=ctx.config.data.micro_batch_size,
            micro_batch_tokens=ctx.config.data.micro_batch_tokens,
            temperature=ctx.config.generator.sampling.temperature,
            # data-parallel: one rank per instance (the training ranks: not the split placement's generation rank)
            group=ctx.topology.training_group,
            packing=ctx.config.data.packing,
        )
