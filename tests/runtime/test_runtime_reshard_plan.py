"""The resharding plan, pure (no process group): for training layouts up to 8 ranks and every generation tp,
each rank's pieces tile exactly its generation slice of every Actor tensor (no gap, no overlap), a piece comes
from a rank that holds it, nothing a rank holds is sent to it, and a sender on the receiver's node is preferred."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rlhfuse.models import ModelConfig, Transformer
from rlhfuse.runtime.reshard import Resharder
from rlhfuse.runtime.tensor_parallel import _split, full_shapes, shard_transformer
from rlhfuse.trainer.strategies.pipelines.config import PipelineConfig
from rlhfuse.trainer.strategies.pipelines.training import pipeline_layout

# 8 heads over 2 kv heads (split for tp <= 2, replicated beyond), vocabulary 130 (padded for tp 4 and 8)
CONFIG = ModelConfig.tiny(num_layers=4, vocab_size=130, num_heads=8, num_kv_heads=2)


def _training_model(layout: Any, rank: int) -> Transformer:
    """Rank `rank`'s trained Actor as the strategy holds it, on the meta device (its stages' shapes only)."""
    with torch.device("meta"):
        whole = Transformer(CONFIG, head="lm")
    if layout.tp == 1:
        return whole
    return shard_transformer(whole, layout.tp_rank(rank), layout.tp)


@pytest.mark.parametrize(
    ("world", "pp", "tp"), [(2, 2, 1), (4, 2, 2), (4, 1, 2), (8, 2, 2), (8, 4, 1), (8, 2, 4)]
)
def test_every_rank_gets_exactly_its_generation_slice(world: int, pp: int, tp: int) -> None:
    cfg = PipelineConfig(actor_pp=pp, critic_pp=pp, actor_tp=tp, critic_tp=tp, microbatches=pp)
    layout = pipeline_layout(cfg, world, 8, 4)
    for g in (d for d in (1, 2, 4, 8) if world % d == 0):
        with torch.device("meta"):
            gen_whole = Transformer(CONFIG, head="lm")
        for rank in range(world):
            model = _training_model(layout, rank)
            plan = Resharder(layout, rank, model, g, ranks_per_node=0).plan
            gen = _split(shard_transformer(gen_whole, rank % g, g)) if g > 1 else {}
            shapes = full_shapes(model) if tp > 1 else {k: v.shape for k, v in model.state_dict().items()}
            for i, entry in enumerate(plan.entries):
                name = entry.names[0]
                mine = [p for p in plan.pieces if p.dst == rank and p.entry == i]
                dim = mine[0].dim
                covered = torch.zeros(shapes[name][dim], dtype=torch.int64)
                for p in mine:
                    covered[p.lo : p.hi] += 1
                    holders = {r for t in range(tp) for r in layout.tp_grad_groups[("actor", entry.stage, t)]}
                    assert p.src in holders, (world, pp, tp, g, rank, name)
                    assert p.src_start <= p.lo < p.hi <= p.src_stop
                lo, hi = gen[name][1][rank % g] if name in gen else (0, shapes[name][dim])
                want = torch.zeros_like(covered)
                want[lo:hi] = 1
                assert torch.equal(covered, want), (world, pp, tp, g, rank, name)
                # a piece this rank's own training shard holds is never sent to it
                own = [p for p in mine if p.src != rank]
                t = layout.tp_rank(rank)
                if rank in layout.tp_grad_groups[("actor", entry.stage, t)]:
                    t_lo, t_hi = entry.train.bounds[t] if entry.train else (0, shapes[name][dim])
                    assert all(p.hi <= t_lo or p.lo >= t_hi for p in own), (rank, name)


def test_a_holder_on_the_receivers_node_is_preferred() -> None:
    """T=2, dp=2 on 2 nodes of 2 ranks, g=4: rank 1's quarter lies in training half 0 (held by ranks 0 and 2),
    rank 2's in half 1 (ranks 1 and 3): each is served from its own node; without node information the
    least-loaded holder is taken, which spreads the pieces over both holders, across nodes."""
    cfg = PipelineConfig(actor_pp=1, critic_pp=1, actor_tp=2, critic_tp=2, microbatches=1)
    layout = pipeline_layout(cfg, 4, 8, 4)
    assert layout.dp == 2
    model = _training_model(layout, 0)
    sources = {}
    for per_node in (2, 0):
        plan = Resharder(layout, 0, model, 4, ranks_per_node=per_node).plan
        sources[per_node] = {
            dst: {p.src for p in plan.pieces if p.dst == dst and p.src != dst and plan.entries[p.entry].train}
            for dst in (1, 2)
        }
    assert sources[2] == {1: {0}, 2: {3}}
    assert sources[0][1] | sources[0][2] > {0, 3}  # spread over both holders, across nodes
