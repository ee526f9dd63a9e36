"""What `VLLMInstance` asks of `vllm.LLM` for each backend (runs without vLLM: `vllm.LLM` is replaced by a
recorder of its arguments, so only the arguments are checked, not vLLM itself — `make test-vllm` runs the real
engine on CPU): CUDA graphs on a GPU unless `generator.vllm_cuda_graphs=false`, always eager on the CPU."""

import types
from typing import ClassVar

import pytest
import torch

from rlhfuse.generation import SamplingParams, vllm_engine
from rlhfuse.models import ModelConfig


class _RecordedLLM:
    calls: ClassVar[list[dict]] = []

    def __init__(self, model: str, **kwargs) -> None:
        _RecordedLLM.calls.append(kwargs)
        self.llm_engine = None
        self.reloaded: list[tuple[str, torch.Tensor]] = []

    def collective_rpc(self, method: str, kwargs: dict) -> None:
        assert method == "reload_weights"
        self.reloaded = list(kwargs["weights_iterator"])

    def reset_prefix_cache(self) -> None:
        pass


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


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_weight_sync_copies_to_the_host_only_for_the_cpu_backend(recorded, device):
    """CPU: float32 host tensors for vLLM's float32 model; GPU: the Actor's own tensors, cast by vLLM's loaders on
    the device (a bf16 tensor stands in for a bf16 Actor on the GPU)."""
    params = SamplingParams(max_new_tokens=4, temperature=0.0, stop_token_ids=(1,))
    instance = vllm_engine.VLLMInstance(
        "unused", ModelConfig.tiny(), params, max_len=16, max_num_seqs=2, device=device
    )
    weight = torch.ones(3, dtype=torch.bfloat16)
    instance.load_weights([("model.norm.weight", weight)])
    ((name, sent),) = instance.llm.reloaded
    assert name == "model.norm.weight"
    if device == "cpu":
        assert sent.dtype == torch.float32
    else:
        assert sent.dtype == torch.bfloat16 and sent.data_ptr() == weight.data_ptr()  # no copy
