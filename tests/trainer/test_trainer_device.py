"""The run's compute device follows the device rule (`rlhfuse.distributed.rank_device`): this rank's GPU,
cuda:LOCAL_RANK, under torchrun; one device named for several processes is refused before anything is built;
and no path in src/ names a CUDA device without an index (which is whatever device is current: GPU 0 on every
rank until `torch.cuda.set_device`)."""

import re
from pathlib import Path

import pytest
import torch

import rlhfuse
from rlhfuse.trainer import compose_config, validate
from rlhfuse.trainer.device_choice import claim_device, resolve_device

SRC = Path(rlhfuse.__file__).parent


def test_without_cuda_auto_is_the_cpu_and_cuda_is_refused_with_the_fix(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match=r"device='cuda:1' but CUDA is not available here: set device=cpu"):
        resolve_device("cuda:1")
    claim_device(torch.device("cpu"))  # nothing to claim off CUDA


@pytest.mark.parametrize("local_rank, expected", [(None, 0), ("3", 3), ("6", 2)])
def test_with_cuda_each_rank_takes_its_local_gpu(monkeypatch, local_rank, expected) -> None:
    """What torchrun sets (LOCAL_RANK) and what the node has (4 GPUs), as the rule reads them."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    assert resolve_device("auto") == resolve_device("cuda") == torch.device("cuda", expected)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)  # named: that device


def test_one_gpu_named_for_several_processes_is_refused_with_the_fix() -> None:
    cfg = compose_config(["device=cuda:1", "generator=engine", "generator.instances=2"])
    with pytest.raises(ValueError, match=r"device=cuda:1 puts all 2 processes on one GPU: set device=auto"):
        validate(cfg)


# a CUDA device without an index, or the fixed first one: the current device, GPU 0 on every rank
_INDEXLESS = re.compile(r'torch\.device\(\s*"cuda"\s*(\)|if\b)|\.cuda\(\s*\)|"cuda:0"|device\s*=\s*"cuda"')


def test_no_path_in_src_names_a_cuda_device_without_its_index() -> None:
    found = [
        f"{path.relative_to(SRC)}:{n}: {line.strip()}"
        for path in sorted(SRC.rglob("*.py"))
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if _INDEXLESS.search(line)
    ]
    assert found == [], (
        "use rlhfuse.trainer.device_choice.resolve_device / rlhfuse.distributed.rank_device:\n"
        + "\n".join(found)
    )
