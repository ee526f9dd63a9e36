"""Per-rank weight memory under sharded construction, and weight-sync traffic, for pp = 1, 2, 4 (tp = 1: tensor
parallelism is not built yet).

Each rank of each layout loads the four models exactly as `rlhfuse-train` does under pipeline=fused
(`rlhfuse.models.from_pretrained(stages=...)`: meta init, only its stages read from the safetensors files) plus
the full generation copy, in this one process one rank after the other (no process group is needed to build a
rank's shard). Printed per layout: the most parameter bytes a rank holds (`memory/param_bytes`) as a ratio of a
single process's four whole models + generation copy, the same without the generation copy (the trained and
frozen models only), and the most bytes a rank receives for one weight sync (`weight_sync/bytes_per_rank`:
the Actor stages it does not own) vs the former sync (every stage of both models broadcast to every rank).
"""

from __future__ import annotations

import pathlib
import tempfile

import torch

from rlhfuse.models import ModelConfig, Transformer, from_pretrained, resident_bytes, save_pretrained
from rlhfuse.runtime.config import PipelineConfig
from rlhfuse.runtime.strategy import pipeline_layout


def _rank_bytes(root: pathlib.Path, pp: int, rank: int) -> tuple[int, int, int, int]:
    """(trained + frozen bytes, generation copy bytes, bytes received by a sync, bytes the former sync received:
    every Actor and Critic stage this rank does not own) of one rank."""
    layout = pipeline_layout(PipelineConfig(actor_pp=pp, critic_pp=pp, microbatches=pp), pp, 8, 4)
    held = layout.held_stages(rank)
    actor = from_pretrained(root / "sft", stages=(pp, held["actor"]))
    models = [
        actor,
        from_pretrained(root / "sft", stages=(pp, held["actor"])),
        from_pretrained(root / "rm", head="value", stages=(pp, held["critic"])),
        from_pretrained(root / "rm", head="value", stages=(pp, held["critic"])),
    ]
    generation = from_pretrained(root / "sft")

    def elsewhere(model: Transformer) -> int:
        return sum(p.numel() * p.element_size() for p in model.parameters() if p.is_meta)

    received = elsewhere(actor)
    return resident_bytes(*models), resident_bytes(generation), received, received + elsewhere(models[2])


def run(quick: bool = False) -> None:
    layers = 4 if quick else 8
    cfg = ModelConfig.tiny(
        vocab_size=512, hidden_size=128 if quick else 512, intermediate_size=256 if quick else 1536,
        num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=32 if quick else 128,
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        torch.manual_seed(0)
        save_pretrained(Transformer(cfg, head="lm"), root / "sft")
        save_pretrained(Transformer(cfg, head="value"), root / "rm")
        single_models, single_gen, _, _ = _rank_bytes(root, 1, 0)
        print(
            f"width {cfg.hidden_size}, {layers} layers, vocab {cfg.vocab_size}: one process holds "
            f"{single_models / 2**20:.1f} MiB of trained + frozen weights + {single_gen / 2**20:.1f} MiB "
            "generation copy"
        )
        print(f"{'pp':>3} {'param_bytes':>12} {'ratio':>6} {'models only':>12} {'ratio':>6} {'sync/rank':>10} "
              f"{'vs full gather':>14}")  # fmt: skip
        for pp in (1, 2, 4):
            per_rank = [_rank_bytes(root, pp, r) for r in range(pp)]
            most = max(m + g for m, g, _, _ in per_rank)
            models_only = max(m for m, _, _, _ in per_rank)
            sync = max(s for _, _, s, _ in per_rank)
            former = max(f for _, _, _, f in per_rank)
            print(
                f"{pp:>3} {most / 2**20:>10.1f}Mi {most / (single_models + single_gen):>6.3f} "
                f"{models_only / 2**20:>10.1f}Mi {models_only / single_models:>6.3f} {sync / 2**20:>8.2f}Mi "
                f"{sync / former if former else 0.0:>14.3f}"
            )
