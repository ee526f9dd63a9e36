"""What `VLLMInstance` asks of `vllm.LLM` for each backend (runs without vLLM: `vllm.LLM` is replaced by a
recorder of its arguments and calls, so only those are checked, not vLLM itself — `make test-vllm` runs the real
engine on CPU): CUDA graphs on a GPU unless `generator.vllm_cuda_graphs=false`, always eager on the CPU; the
`external_launcher` executor for an engine in a multi-process job; sleep and wake around training where the
platform has a sleep mode, a level-2 sleeper reloading its weights as it wakes."""

import os
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
        _RecordedLLM.events.append(("reload", float(self.reloaded[0][1].sum())))

    def reset_prefix_cache(self) -> None:
        pass

    def sleep(self, level: int) -> None:
        _RecordedLLM.events.append(("sleep", level))

    def wake_up(self) -> None:
        _RecordedLLM.events.append(("wake", 0))

    events: ClassVar[list[tuple[str, float]]] = []


SLEEP_MODE = types.SimpleNamespace(
    current_platform=types.SimpleNamespace(is_sleep_mode_available=lambda: True)
)


@pytest.fixture
def recorded(monkeypatch):
    _RecordedLLM.calls, _RecordedLLM.events = [], []
    vllm = types.SimpleNamespace(LLM=_RecordedLLM, platforms=SLEEP_MODE)
    monkeypatch.setattr(vllm_engine, "import_vllm", lambda: vllm)
    # a GPU engine checks its memory fraction against what is free: 70 of 80 GiB here
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 << 30, 80 << 30))
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


def test_an_engine_in_a_multi_process_job_runs_on_the_external_launcher(recorded, monkeypatch):
    # the engine names this rank to vLLM in the environment (env://): undone after the test, or a later
    # rlhfuse-train launched from this process would take itself for an already launched rank (setenv first:
    # monkeypatch restores what it changed, and a delenv of an absent variable changes nothing)
    for name in ("RANK", "LOCAL_RANK"):
        monkeypatch.setenv(name, "unset")
        monkeypatch.delenv(name)
    params = SamplingParams(max_new_tokens=4, temperature=0.0, stop_token_ids=(1,))
    vllm_engine.VLLMInstance("unused", ModelConfig.tiny(), params, max_len=16, max_num_seqs=2)
    vllm_engine.VLLMInstance(
        "unused", ModelConfig.tiny(), params, max_len=16, max_num_seqs=2, external_launcher=True
    )
    alone, launched = recorded
    assert "distributed_executor_backend" not in alone
    assert launched["distributed_executor_backend"] == "external_launcher"
    assert launched["tensor_parallel_size"] == 1
    assert os.environ["RANK"] == os.environ["LOCAL_RANK"] == "0"  # env:// names this rank
    vllm_engine.VLLMInstance(
        "unused", ModelConfig.tiny(), params, max_len=16, max_num_seqs=2, external_launcher=True,
        tensor_parallel=2, device="cuda",
    )  # fmt: skip
    assert recorded[-1]["tensor_parallel_size"] == 2  # one engine over 2 ranks of the job's world
    with pytest.raises(ValueError, match=r"generator.tp=2: a tensor-parallel vLLM engine spans"):
        vllm_engine.VLLMInstance(
            "unused", ModelConfig.tiny(), params, max_len=16, max_num_seqs=2, tensor_parallel=2
        )


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_instances_sleep_through_training_and_a_level_2_sleeper_reloads_its_weights(recorded, device):
    """A GPU engine sleeps at level 2 after the rollout and wakes at the weight sync, which it reloads then
    (the new weights); before any weights were handed over it sleeps at level 1 (nothing to reload from); a
    busy engine never sleeps; the CPU backend has no sleep mode: nothing happens."""
    params = SamplingParams(max_new_tokens=4, temperature=0.0, stop_token_ids=(1,))
    instance = vllm_engine.VLLMInstance(
        "unused", ModelConfig.tiny(), params, max_len=16, max_num_seqs=2, device=device
    )
    events = _RecordedLLM.events
    assert instance.release(level=2) is (device == "cuda")
    instance.wake_up()
    instance.load_weights([("model.norm.weight", torch.ones(3))])
    assert instance.release(level=2) is (device == "cuda")
    instance.load_weights([("model.norm.weight", 2 * torch.ones(3))])  # the sync after training
    instance.wake_up()  # the next batch: awake already
    if device == "cpu":
        assert events == [("reload", 3.0), ("reload", 6.0)]
        return
    assert events == [
        ("sleep", 1), ("wake", 0), ("reload", 3.0), ("sleep", 2), ("wake", 0), ("reload", 6.0)
    ]  # fmt: skip
    instance.running["r0"] = object()  # a sample in flight
    assert instance.release(level=2) is False


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_gpu_engine_is_built_and_wakes_after_torch_returned_its_cached_memory(
    recorded, device, monkeypatch
):
    """What a training step freed stays reserved by torch's caching allocator, out of reach of vLLM's own
    allocator (and counted as used by the memory check): a GPU engine empties torch's cache before it is built
    and before every wake-up, the weight sync's of a level-2 sleeper included; the CPU backend never."""
    events = _RecordedLLM.events
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append(("empty_cache", 0)))
    params = SamplingParams(max_new_tokens=4, temperature=0.0, stop_token_ids=(1,))
    instance = vllm_engine.VLLMInstance(
        "unused", ModelConfig.tiny(), params, max_len=16, max_num_seqs=2, device=device
    )
    instance.release(level=1)
    instance.wake_up()  # the next batch
    instance.load_weights([("model.norm.weight", torch.ones(3))])
    instance.release(level=2)
    instance.load_weights([("model.norm.weight", 2 * torch.ones(3))])  # the sync after training wakes it
    if device == "cpu":
        assert ("empty_cache", 0) not in events
        return
    assert events == [
        ("empty_cache", 0), ("sleep", 1), ("empty_cache", 0), ("wake", 0), ("reload", 3.0), ("sleep", 2),
        ("empty_cache", 0), ("wake", 0), ("reload", 6.0),
    ]  # fmt: skip


def test_a_memory_fraction_that_training_leaves_no_room_for_is_refused_naming_the_key():
    gib = 1 << 30
    vllm_engine.check_memory_fraction(0.5, free_bytes=60 * gib, total_bytes=80 * gib)
    with pytest.raises(ValueError) as err:
        vllm_engine.check_memory_fraction(0.9, free_bytes=40 * gib, total_bytes=80 * gib)
    message = str(err.value)
    assert "generator.vllm_gpu_memory_utilization=0.9" in message and "<=0.49" in message


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "mode", "records"),
    [
        (0.7, 0, 1.0, "processed_logprobs", True),  # after temperature, nothing filtered: the trainer's
        (0.0, 0, 1.0, "processed_logprobs", True),
        (1.0, 20, 0.9, "raw_logprobs", True),  # raw = log softmax(logits), the trainer's at temperature 1
        (0.7, 0, 0.9, "raw_logprobs", False),  # neither mode gives log softmax(logits / 0.7): none recorded
    ],
)
def test_the_engine_asks_vllm_for_the_log_probs_the_trainer_computes(recorded, temperature, top_k, top_p, mode,
                                                                      records):  # fmt: skip
    params = SamplingParams(max_new_tokens=4, temperature=temperature, top_k=top_k, top_p=top_p)
    instance = vllm_engine.VLLMInstance("unused", ModelConfig.tiny(), params, max_len=16, max_num_seqs=2)
    (kwargs,) = recorded
    assert kwargs["logprobs_mode"] == mode
    assert vllm_engine.records_logprobs(instance.logprobs_mode, params) is records
