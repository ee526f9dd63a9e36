"""Weight resharding, training layout -> generation layout: the most bytes a rank receives per weight sync
(`weight_sync/bytes_per_rank`) under `rlhfuse.runtime.reshard`'s plan, against a full gather (every rank
receiving the whole Actor but what it holds, as a whole generation copy per rank needs), for training layouts
pp x T on 8 ranks and generation tp g = 1, 2, 4, 8.

The plans are the runtime's own (`Resharder(...).plan`, pure: built from meta-device models, no process group),
for a width-512, 30-layer Actor (8 layers with --quick) with SmolLM2's vocabulary (49 152) and 8 query heads over
2 kv heads (so every g up to 8 splits it), in bf16. Bytes are counted, not timed: the figures are exact on any
machine. Inter-node bytes (all ranks together) assume nodes of 4 consecutive ranks.
"""

from __future__ import annotations

from typing import Any

import torch

from rlhfuse.models import ModelConfig, Transformer
from rlhfuse.runtime.reshard import Resharder
from rlhfuse.runtime.tensor_parallel import shard_transformer
from rlhfuse.trainer.strategies.pipelines.config import PipelineConfig
from rlhfuse.trainer.strategies.pipelines.training import pipeline_layout

WORLD, PER_NODE = 8, 4


def _model(config: ModelConfig, layout: object, rank: int) -> Transformer:
    with torch.device("meta"):
        whole = Transformer(config, head="lm").to(torch.bfloat16)
    tp = layout.tp  # type: ignore[attr-defined]
    return whole if tp == 1 else shard_transformer(whole, layout.tp_rank(rank), tp)  # type: ignore[attr-defined]


def run(quick: bool = False) -> dict[str, Any]:
    """Figures: actor_mib; per training layout (`pp2_T1`, ...) and generation tp (`g1`, ...): max_mib_per_rank,
    full_gather_mib, ratio, inter_node_mib."""
    layers = 8 if quick else 30
    config = ModelConfig(
        vocab_size=49152, hidden_size=512, intermediate_size=1536, num_layers=layers, num_heads=8,
        num_kv_heads=2, max_position_embeddings=2048, tie_word_embeddings=False,
    )  # fmt: skip
    with torch.device("meta"):
        whole_bytes = sum(t.numel() * 2 for t in Transformer(config, head="lm").state_dict().values())
    print(f"Actor {whole_bytes / 2**20:.1f} MiB (bf16, {layers} layers); {WORLD} ranks, nodes of {PER_NODE}")
    figures: dict[str, Any] = {"actor_mib": whole_bytes / 2**20}
    print(
        f"{'training':>12} {'g':>3} {'max MiB/rank':>13} {'full gather':>12} {'ratio':>6} {'inter-node MiB':>15}"
    )
    for pp, tp in ((2, 1), (4, 1), (2, 2), (4, 2), (2, 4)):
        cfg = PipelineConfig(actor_pp=pp, critic_pp=pp, actor_tp=tp, critic_tp=tp, microbatches=pp)
        layout = pipeline_layout(cfg, WORLD, 16, 2)
        models = [_model(config, layout, r) for r in range(WORLD)]
        held = [
            sum(
                t.numel() * t.element_size()
                for n, t in models[r].state_dict().items()
                if r in layout.grad_groups[("actor", _stage(n, layers, pp))]
            )
            for r in range(WORLD)
        ]
        gather = max(whole_bytes - h for h in held)  # whole copy per rank: all it does not hold
        for g in (1, 2, 4, 8):
            plan = Resharder(layout, 0, models[0], g, ranks_per_node=PER_NODE).plan
            sizes = {i: 2 for i in range(len(plan.entries))}
            most = max(plan.received_bytes(r, sizes) for r in range(WORLD))
            inter = sum(
                plan.piece_numel(p) * 2 for p in plan.pieces if p.src // PER_NODE != p.dst // PER_NODE
            )
            print(
                f"{f'pp={pp} T={tp}':>12} {g:>3} {most / 2**20:>13.2f} {gather / 2**20:>12.2f} "
                f"{most / gather:>6.2f} {inter / 2**20:>15.2f}"
            )
            figures.setdefault(f"pp{pp}_T{tp}", {})[f"g{g}"] = {
                "max_mib_per_rank": most / 2**20,
                "full_gather_mib": gather / 2**20,
                "ratio": most / gather,
                "inter_node_mib": inter / 2**20,
            }
    return figures


def _stage(name: str, layers: int, pp: int) -> int:
    from rlhfuse.models import stage_of

    return stage_of(name, layers, pp)
