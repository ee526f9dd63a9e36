"""Several nodes: `torchrun --nnodes=2` on this machine, two "nodes" of one rank each meeting at a c10d rendezvous
on localhost, runs the trainer as a user's multi-node job does (the same command on each node): the fused
pipelines over the two nodes, and two generation instances with migration=auto, one per node. Each job writes its
metrics and ends with the summary line on the first node; the second node's rank prints no summary."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from rlhfuse.testing.processes import free_port, launch_env

pytestmark = pytest.mark.distributed


def _two_nodes(tmp_path: Path, args: list[str]) -> tuple[list[subprocess.CompletedProcess[str]], list[dict]]:
    torchrun = Path(sys.executable).with_name("torchrun")
    train = Path(sys.executable).with_name("rlhfuse-train")
    port = free_port()
    run = tmp_path / "run"
    env = launch_env()
    cmd = [
        str(torchrun), "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=rlhfuse-{port}", str(train),
        *args, f"model.warmstart.cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={run}",
    ]  # fmt: skip
    nodes = [
        subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path
        )
        for _ in range(2)
    ]
    done = []
    try:
        for node in nodes:
            out, _ = node.communicate(timeout=200)
            done.append(subprocess.CompletedProcess(node.args, node.returncode, out, ""))
    finally:
        for node in nodes:
            node.kill()
    rows = (
        [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        if run.exists()
        else []
    )
    return done, rows


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "args",
    [
        ["pipeline=fused", "distributed.nproc_per_node=2", "model.num_layers=2"],
        ["generator=engine", "generator.instances=2", "migration=auto"],
    ],
    ids=["fused", "instances-migration-auto"],
)
def test_two_nodes_of_one_rank_run_the_job(tmp_path: Path, args: list[str]) -> None:
    done, rows = _two_nodes(tmp_path, ["experiment=smoke", "iterations=2", "distributed.timeout_s=90", *args])
    outputs = "\n".join(p.stdout[-3000:] for p in done)
    assert [p.returncode for p in done] == [0, 0], outputs
    summaries = [p.stdout for p in done if "rlhfuse-train: done in" in p.stdout]
    assert len(summaries) == 1, outputs  # the first node's rank 0 only
    assert len(rows) == 2 and all(math.isfinite(r["loss/policy"]) for r in rows), rows
