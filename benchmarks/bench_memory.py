"""Per-rank memory of whole training runs, as the trainer logs it (`python -m benchmarks.run memory`):
`memory/param_bytes` (parameters and buffers a rank holds, its generation copy included),
`memory/optimizer_bytes` and `weight_sync/bytes_per_rank`, for one process (`pipeline=plain`) against sharded
data parallelism on 2 processes (`pipeline=fsdp generator.instances=2`), with and without LoRA.

Jobs: `experiment=smoke` (the embedded tiny PPO job: Actor, Ref, Critic, Reward, generation copy) and, when
`make real-model` has converted it, SmolLM2-135M-Instruct under `experiment=smollm2_arith` (GRPO: Actor, Ref,
generation copy). One iteration each, on a smaller batch than the experiments' (the bytes do not depend on the
batch: weights, optimizer states and the weight sync only). Bytes are counted, not timed: the figures do not
depend on the machine or its load. --quick runs the smoke rows only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from rlhfuse.models.convert import is_converted

SMALL = ("iterations=1", "logger=quiet", "checkpoint.export_hf=false")
SMOLLM2 = (
    "experiment=smollm2_arith", "data.prompts_per_iteration=4", "data.mini_batch_size=16",
    "generator.max_new_tokens=8",
)  # fmt: skip
FSDP = ("pipeline=fsdp", "generator.instances=2")
LORA = ("model.lora.rank=8",)
QV = ("model.lora.rank=8", "model.lora.target_modules=[q_proj,v_proj]")
SMOKE2 = ("experiment=smoke", "model.num_layers=2")
PP2 = (
    "pipeline.actor_pp=2",
    "pipeline.critic_pp=2",
    "pipeline.microbatches=2",
    "distributed.nproc_per_node=2",
)
ROWS: dict[str, tuple[str, ...]] = {
    "smoke_plain": ("experiment=smoke",),
    "smoke_fsdp": ("experiment=smoke", *FSDP),
    "smoke_lora_plain": ("experiment=smoke", *LORA),
    "smoke_lora_qv_plain": ("experiment=smoke", *QV),
    # the smoke job at 2 layers: one process, the fused pipeline (pp=2, each rank its stages), the same with
    # whole model copies per rank (per-rank inference), and an Actor with LoRA r=4 pipelined or data-parallel
    "smoke2_plain": SMOKE2,
    "smoke2_fused_pp2": (*SMOKE2, "pipeline=fused", *PP2),
    "smoke2_fused_pp2_whole_copies": (
        *SMOKE2,
        "pipeline=fused",
        *PP2,
        "generator=engine",
        "generator.instances=2",
    ),
    "smoke2_lora4_serial_pp2": (*SMOKE2, "model.lora.rank=4", "pipeline=serial_1f1b", *PP2),
    "smoke2_lora4_dp2": (*SMOKE2, "model.lora.rank=4", "generator.instances=2"),
    "smollm2_plain": SMOLLM2,
    "smollm2_fsdp": (*SMOLLM2, *FSDP),
    "smollm2_lora_plain": (*SMOLLM2, *LORA),
    "smollm2_lora_fsdp": (*SMOLLM2, *LORA, *FSDP),
    "smollm2_lora_qv_plain": (*SMOLLM2, *QV),
    "smollm2_fsdp_one_bucket": (*SMOLLM2, *FSDP, "pipeline.weight_sync_bucket_mb=4096"),
}
KEYS = ("memory/param_bytes", "memory/optimizer_bytes", "weight_sync/bytes_per_rank")
EXTRA = ("weight_sync/peak_extra_bytes", "time/weight_sync")
"""Also recorded per row: the sync's peak memory beside the models and its seconds (the one timed figure)."""


def _run(overrides: tuple[str, ...], run_dir: Path) -> dict[str, float]:
    command = ("-m", "rlhfuse.trainer.train_command", *overrides, *SMALL, f"hydra.run.dir={run_dir}")
    cmd = [sys.executable, *command]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    last = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    return {key: last.get(key, 0.0) for key in (*KEYS, *EXTRA)}


def run(quick: bool = False) -> dict[str, Any]:
    """Figures per row (`smoke_plain`, `smoke_fsdp`, `smollm2_plain`, ...): param_bytes, optimizer_bytes,
    sync_bytes_per_rank and the same in MB (10^6 bytes: param_mb, optimizer_mb, sync_mb), sync_peak_extra_mb and
    weight_sync_s (the last iteration's); per fsdp row its ratio to the plain row (param_ratio,
    optimizer_ratio)."""
    rows = {name: o for name, o in ROWS.items() if name.startswith("smoke") or (not quick and is_converted())}
    if not quick and not is_converted():
        print("SmolLM2 rows skipped: the real model is not converted (make real-model)")
    figures: dict[str, Any] = {}
    print(f"{'run':<20} {'param_bytes':>14} {'optimizer_bytes':>16} {'sync bytes/rank':>16}")
    with tempfile.TemporaryDirectory(prefix="rlhfuse-bench-memory-") as tmp:
        for name, overrides in rows.items():
            try:
                got = _run(overrides, Path(tmp) / name)
            except RuntimeError as exc:  # one failed row does not lose the others
                print(f"{name:<20} failed: {str(exc).strip().splitlines()[-1]}", flush=True)
                figures[name] = {"failed": str(exc).strip().splitlines()[-1]}
                continue
            param, optimizer, sync = (got[k] for k in KEYS)
            row = {
                "param_bytes": param, "optimizer_bytes": optimizer, "sync_bytes_per_rank": sync,
                "param_mb": param / 1e6, "optimizer_mb": optimizer / 1e6, "sync_mb": sync / 1e6,
                "sync_peak_extra_mb": got["weight_sync/peak_extra_bytes"] / 1e6,
                "weight_sync_s": got["time/weight_sync"],
            }  # fmt: skip
            plain = figures.get(name.replace("_fsdp", "_plain"), {})
            if name.endswith("_fsdp") and "param_bytes" in plain:
                row |= {
                    "param_ratio": param / plain["param_bytes"],
                    "optimizer_ratio": optimizer / plain["optimizer_bytes"],
                }
            figures[name] = row
            print(f"{name:<20} {param:>14,.0f} {optimizer:>16,.0f} {sync:>16,.0f}", flush=True)
    return figures
