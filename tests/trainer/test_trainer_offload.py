"""Ref/Reward weights in host memory between rollouts (`inferencer.offload_frozen`): the swap mechanism with a
`meta` target (weights on the device only between acquire and release, back on the very host copies after it,
ties kept), and unchanged inference outputs on CPU; on the stand-in device, one side stream reused across
prefetches, every device copy recorded on the compute stream, and the CPU's inference outputs."""

import torch

from rlhfuse.core.inference import InferencerConfig
from rlhfuse.core.protocols import Inferencer
from rlhfuse.data.synthetic import build_tokenizer
from rlhfuse.models import ModelConfig, Transformer
from rlhfuse.testing.data import two_row_rollout
from rlhfuse.trainer.offload import OffloadedModel
from rlhfuse.trainer.strategies.plain.inference import ModelInferencer


def _model(head: str = "lm", seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    config = ModelConfig.tiny(
        vocab_size=24, hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1
    )
    return Transformer(config, head)


def _devices(model: torch.nn.Module) -> set[str]:
    return {p.device.type for p in model.parameters()}


def test_swap_lives_on_host_between_uses_and_keeps_ties() -> None:
    model = _model()
    model.lm_head.weight = model.embed_tokens.weight  # tied, as with tie_word_embeddings
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    swap = OffloadedModel(model, "meta")
    host_ptrs = {n: t.data_ptr() for n, t in swap.host.items()}
    assert swap.on_host and _devices(model) == {"cpu"}
    for _ in range(2):  # two rollouts
        swap.prefetch()  # staged on the device while the module still computes on the host copies
        assert swap.on_host and _devices(model) == {"cpu"}
        assert swap._staged is not None and {t.device.type for t in swap._staged.values()} == {"meta"}
        assert swap.acquire() is model
        assert _devices(model) == {"meta"} and not swap.on_host
        assert model.lm_head.weight is model.embed_tokens.weight
        swap.release()
        assert swap.on_host and _devices(model) == {"cpu"} and swap._staged is None
        # the very host copies (nothing copied back from the device), values unchanged
        assert {n: p.data_ptr() for n, p in model.named_parameters()} == host_ptrs
        for n, p in model.named_parameters():
            assert torch.equal(p, before[n])
        assert model.lm_head.weight is model.embed_tokens.weight
    swap.acquire()  # without a prefetch: copies now
    assert _devices(model) == {"meta"}
    swap.release()
    assert _devices(model) == {"cpu"}


def test_offloaded_inference_outputs_are_unchanged() -> None:
    rollout = two_row_rollout()
    outputs = []
    for offload in (False, True):
        inf = ModelInferencer(
            InferencerConfig(truncated_score=None, offload_frozen=offload),
            actor=_model("lm", 0), ref=_model("lm", 1), critic=_model("value", 2),
            reward_model=_model("value", 3), rewards=None, tokenizer=build_tokenizer(), temperature=1.0,
        )  # fmt: skip
        assert isinstance(inf, Inferencer) and len(inf.offloaded) == (2 if offload else 0)
        inf.prefetch()
        exp = inf.infer(rollout)
        inf.release()
        assert all(m.on_host for m in inf.offloaded)
        outputs.append(exp)
    for name in ("logprobs_BR", "ref_logprobs_BR", "values_BR", "scores_B"):
        assert torch.equal(getattr(outputs[0], name), getattr(outputs[1], name)), name


def test_swap_onto_the_standin_device_reuses_one_side_stream_and_records_its_copies() -> None:
    """On the stand-in device (a non-CPU device that refuses CPU tensors in its ops): the copies run on the
    model's one side stream, made at the first prefetch and reused by every later one, and each device copy is
    recorded on the compute stream when acquired (so the caching allocator keeps it until the reads finish)."""
    from rlhfuse.testing.standin import recording, standin_device

    device = standin_device()
    model = _model()
    model.lm_head.weight = model.embed_tokens.weight
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    swap = OffloadedModel(model, device)
    assert swap.side_stream is None and swap.on_host
    streams = []
    for _ in range(2):  # two rollouts
        with recording() as rec:
            swap.prefetch()
            assert swap.on_host and rec.record_streams == 0  # staged, not yet used
            streams.append(swap.side_stream)
            swap.acquire()
            swap.acquire()  # a second inference chunk: recorded once per staged copy
        assert rec.record_streams == len(swap.host) and _devices(model) == {"standin"}
        assert model.lm_head.weight is model.embed_tokens.weight
        with torch.no_grad():  # the frozen model computes on the device: no CPU weight left behind
            model(torch.tensor([[1, 2, 3]], device=device))
        swap.release()
        assert swap.on_host and _devices(model) == {"cpu"}
        for n, p in model.named_parameters():
            assert torch.equal(p, before[n])
    assert streams[0] is not None and streams[0] is streams[1]


def test_offloaded_inference_on_the_standin_device_matches_the_cpu() -> None:
    from rlhfuse.testing.standin import standin_device

    device = standin_device()
    rollout = two_row_rollout()
    outputs = []
    for target, offload in (("cpu", False), (device, True)):
        inf = ModelInferencer(
            InferencerConfig(truncated_score=None, offload_frozen=offload),
            actor=_model("lm", 0).to(target), ref=_model("lm", 1), critic=_model("value", 2).to(target),
            reward_model=_model("value", 3), rewards=None, tokenizer=build_tokenizer(), temperature=1.0,
        )  # fmt: skip
        inf.prefetch()
        outputs.append(inf.infer(rollout))
        inf.release()
        assert all(m.on_host for m in inf.offloaded)
    for name in ("logprobs_BR", "ref_logprobs_BR", "values_BR", "scores_B"):
        torch.testing.assert_close(getattr(outputs[1], name).cpu(), getattr(outputs[0], name), msg=name)
