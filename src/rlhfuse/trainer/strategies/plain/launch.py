"""The launch of `pipeline=plain` (no pipelines): one process, or one process per generation instance.

`rlhfuse-train generator.instances=N` runs N processes (Lightning Fabric's launcher, gloo on CPU; under torchrun
the launched world): each rank is one generation instance holding full copies of the four models, generation is
fused with inference across the ranks (`rlhfuse.generation`) and `PlainStrategy` trains data-parallel over them.
`distributed.nproc_per_node` left at 1 follows `generator.instances`; set, it must agree.
`generator.in_process=true` keeps the N instances in this one process, stepped in turn (a correctness mode).
"""

from __future__ import annotations

from typing import Any

from rlhfuse.distributed import launched_world


def plain_world_size(cfg: Any) -> int:
    """Processes of a pipeline=plain run: torchrun's WORLD_SIZE when launched by it, else
    distributed.nproc_per_node when set above 1, else generator.instances x generator.tp (one process per rank of
    each instance; 1 with generator.in_process=true), plus the split placement's generation ranks
    (async.generation_ranks)."""
    launched = launched_world()
    if launched is not None:
        return launched
    if cfg.distributed.nproc_per_node > 1 or cfg.generator.in_process:
        return int(cfg.distributed.nproc_per_node)
    return int(cfg.generator.instances) * max(int(cfg.generator.tp), 1) + cfg.asynchronous.generation_ranks


def validate_plain_launch(cfg: Any) -> list[str]:
    """Problems of distributed.* and generator.instances with pipeline=plain (each naming the fix)."""
    g = cfg.generator
    problems: list[str] = []
    split = cfg.asynchronous.generation_ranks
    world = plain_world_size(cfg) - split  # the training processes
    source = "torchrun's WORLD_SIZE" if launched_world() is not None else "distributed.nproc_per_node"
    if split:
        source += f" less async.generation_ranks={split}"
    if g.in_process and world > 1:
        problems.append(
            f"generator.in_process=true steps every instance in this one process, but {source} gives {world} "
            "processes: set generator.in_process=false (one process per instance) or distributed.nproc_per_node=1"
        )
    elif world != g.instances * max(g.tp, 1) and not g.in_process:
        ranks = g.instances * max(g.tp, 1)
        per = f" x generator.tp={g.tp}" if g.tp > 1 else ""
        problems.append(
            f"pipeline=plain runs in one process per rank of each generation instance: {source} gives {world} "
            f"processes but generator.instances={g.instances}{per} ({world} != {ranks}): set generator.instances="
            f"{max(world // max(g.tp, 1), 1)}, or distributed.nproc_per_node={ranks}, or pipeline=fused / serial_1f1b"
        )
    elif world > 1 and cfg.data.mini_batch_size < world:
        problems.append(
            f"data.mini_batch_size={cfg.data.mini_batch_size} < {world} processes: each trains on its share "
            f"of every mini-batch, so raise data.mini_batch_size to >= {world} (or lower generator.instances)"
        )
    return problems
