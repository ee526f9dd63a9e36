"""The world's gloo control group (`WorldGroups.cpu`, `rlhfuse.distributed.cpu_group`) is made at start-up, on
every rank, by `build_trainer`: making a process group is collective, so a group first asked for mid-run (the
fused rollout's progress messages, the pipelines' control messages) would be made at whatever point each rank
had reached, and would hang or pair the wrong calls. After the build, asking for it makes no group."""

from __future__ import annotations

import concurrent.futures
import multiprocessing as mp
import os
from pathlib import Path

import pytest


def _ask_after_start_up(folder: str) -> str:
    """Build the smoke job with pipeline=fsdp (a process group of one rank: the start-up path of a multi-process
    run), then ask for the world's control group with `new_group` refused."""
    os.environ["RLHFUSE_NCCL_ORDER"] = "1"  # control messages apart from device ones, as under NCCL
    import torch
    import torch.distributed as dist

    from rlhfuse import distributed
    from rlhfuse.distributed import ordering
    from rlhfuse.trainer import build_trainer, compose_config

    torch.set_num_threads(1)
    cfg = compose_config(
        ["experiment=smoke", "pipeline=fsdp", "device=cpu", f"model.warmstart.cache_dir={folder}/cache"]
    )
    build_trainer(cfg, run_dir=f"{folder}/run", log=lambda _: None)
    assert dist.is_initialized() and distributed.world_size() == 1

    def refused(*args: object, **kwargs: object) -> None:
        raise AssertionError("a process group made after start-up: the world's control group was not ready")

    dist.new_group = refused  # type: ignore[assignment]
    control = distributed.cpu_group()
    assert ordering.is_control(control), control
    backend = str(dist.get_backend(control))
    dist.destroy_process_group()
    return backend


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_the_worlds_control_group_is_made_at_start_up_not_mid_run(tmp_path: Path) -> None:
    # its own process: the build's process group, Fabric's environment and the watchdog stay out of this one
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        assert pool.submit(_ask_after_start_up, str(tmp_path)).result(timeout=150) == "gloo"
