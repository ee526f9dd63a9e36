"""What `VLLMInstance` asks of `vllm.LLM` for each backend (runs without vLLM: `vllm.LLM` is replaced by a
recorder of its arguments, so only the arguments are checked, not vLLM itself — `make test-vllm` runs the real
engine on CPU): CUDA graphs on a GPU unless `generator.vllm_cuda_graphs=false`, always eager on the CPU."""

import types
from typing import ClassVar

import pytest

from rlhfuse.generation import SamplingParams, vllm_engine
from rlhfuse.models import ModelConfig


class _RecordedLLM:
    calls: ClassVar[list[dict]] = []

    def __init__(self, model: str, **kwargs) -> None:
        _RecordedLLM.calls.append(kwargs)
        self.llm_engine = None


@pytest.fixture
def recorded(monkeypatch):
    _RecordedLLM.calls = []
    monkeypatch.setattr(vllm_engine, "import_vllm", lambda: types.SimpleNamespace(LLM=_RecordedLLM))
    monkeypatch.setattr(vllm_engine, "check_vllm_supported", lambda config, device: None)
    return _RecordedLLM.calls


@pytest.mark.parametrize(
    ("device", "cuda_graphs", "eager"), [("cpu", True, True), ("cuda", True, False), ("cuda", False, True)]
)
def test_cuda_graphs_on_a_gpu_unless_turned_off(recorded, device, cuda_graphs, eager):
    config = ModelConfig.tiny()
    params = SamplingParams(max_new_tokens=4, temperature=0.0, stop_token_ids=(1,))
    vllm_engine.VLLMInstance(
        "unused", config, params, max_len=16, max_num_seqs=2, device=device, cuda_graphs=cuda_graphs
    )
    (kwargs,) = recorded
    assert kwargs["enforce_eager"] is eager
    assert ("gpu_memory_utilization" in kwargs) == (device == "cuda")
