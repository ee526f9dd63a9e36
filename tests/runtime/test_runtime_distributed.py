"""`rlhfuse.distributed`: the typed collectives carry tensors, dataclasses, JSON and byte strings exactly (2 gloo
ranks), and the device rule refuses CPU tensors on an NCCL group before NCCL does."""

from __future__ import annotations

import pathlib
import sys
from typing import Any

import pytest
import torch
from runtime_helpers import random_batch, run_distributed

from rlhfuse import distributed
from rlhfuse.core.types import TrainBatch
from rlhfuse.core.wire import pack_tensors, unpack_tensors

REPO = str(pathlib.Path(__file__).resolve().parents[2])  # benchmarks/ (the gpu-check script) lives there
if REPO not in sys.path:
    sys.path.append(REPO)


def _collectives(rank: int, world: int) -> None:
    device = distributed.rank_device()
    assert device == torch.device("cpu") and distributed.group_device() == device  # gloo: the CPU
    # a dataclass with a None field, from rank 0 (rank 1 passes nothing)
    sent = random_batch(5, seed=3)
    got = distributed.broadcast_dataclass(sent if rank == 0 else None, TrainBatch, 0, device)
    for name in vars(sent):
        a, b = getattr(sent, name), getattr(got, name)
        assert (a is None and b is None) or (a.dtype == b.dtype and torch.equal(a, b)), name
    # tensors of several dtypes, bf16 included (gloo never sees bf16: bytes on the wire), from rank 1
    mine = [
        torch.arange(6, dtype=torch.bfloat16).view(2, 3) * (rank + 1),
        torch.tensor([rank], dtype=torch.int64),
    ]
    out = distributed.broadcast_tensors(mine if rank == 1 else None, 1, device)
    assert out[0].dtype == torch.bfloat16 and torch.equal(
        out[0], torch.arange(6, dtype=torch.bfloat16).view(2, 3) * 2
    )
    assert out[1].tolist() == [1]
    # JSON values and byte strings of different lengths (empty included)
    assert distributed.broadcast_json({"a": [1, 2.5]} if rank == 0 else None, 0, device) == {"a": [1, 2.5]}
    assert distributed.all_gather_json(None if rank == 0 else ["x" * 300], device) == [None, ["x" * 300]]
    assert distributed.all_gather_bytes(b"" if rank == 0 else b"abc", device) == [b"", b"abc"]
    # codec messages of uneven sizes
    parts = distributed.all_gather_packed(pack_tensors([rank] * (rank + 1), [torch.ones(rank * 3)]), device)
    assert [unpack_tensors(p)[0] for p in parts] == [[0], [1, 1]]
    assert [unpack_tensors(p)[1][0].numel() for p in parts] == [0, 3]
    # in-place reductions and a barrier
    x = torch.tensor([float(rank + 1)], dtype=torch.float64)
    distributed.all_reduce(x, op="max")
    assert x.item() == 2.0
    distributed.all_reduce(x)
    assert x.item() == 4.0
    distributed.barrier(device)
    assert [t.item() for t in distributed.all_gather(torch.tensor([rank * 10]))] == [0, 10]


def test_collectives_carry_tensors_dataclasses_json_and_bytes_exactly() -> None:
    run_distributed(_collectives, 2, timeout=90.0)


def test_a_cpu_tensor_on_an_nccl_group_is_refused_by_name() -> None:
    with pytest.raises(
        ValueError, match=r"all_reduce: a cpu tensor \(3,\) torch.float32 handed to an NCCL group"
    ):
        distributed.check_device(torch.zeros(3), "all_reduce", backend_name="nccl")
    distributed.check_device(torch.zeros(3), "all_reduce", backend_name="gloo")  # gloo moves CPU memory


def test_the_device_rule_and_single_process_fallbacks(monkeypatch: Any) -> None:
    assert distributed.rank_device("gloo") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert distributed.rank_device("nccl") == torch.device("cpu")  # no CUDA here: nothing else to use
    assert distributed.rank_device() == torch.device("cpu")
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert distributed.rank_device("nccl") == torch.device("cuda", 3)
    # no process group: one rank, in-place ops are no-ops, gathers return this rank's part
    assert not distributed.is_initialized() and distributed.world_size() == 1 and distributed.rank() == 0
    assert distributed.all_gather_json({"k": 1}, torch.device("cpu")) == [{"k": 1}]


def _gpu_check_collectives(rank: int, world: int) -> None:
    import benchmarks.gpu_check as gpu_check

    detail = gpu_check.check_collectives(torch.device("cpu"))
    assert "backend gloo, device cpu" in detail, detail


def test_the_gpu_checks_run_their_device_independent_paths_on_cpu(monkeypatch: Any, capsys: Any) -> None:
    """`make gpu-check`'s collective, GAE-kernel and engine checks run here on gloo / CPU (the Triton interpreter),
    so the script that runs where a GPU is lent is known to work but for its CUDA-only lines; without CUDA the
    script prints one line and checks nothing."""
    import benchmarks.gpu_check as gpu_check

    run_distributed(_gpu_check_collectives, 1, timeout=90.0)
    rows = gpu_check.run_checks(torch.device("cpu"), ["gae kernel", "engine"])
    assert [row.status for row in rows] == ["PASS", "PASS"], rows
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main([]) == 0
    assert capsys.readouterr().out.strip() == (
        "gpu-check: no CUDA device here (torch.cuda.is_available() is False): nothing was checked"
    )
