"""Host syncs per decode step: the engine's decode steps (the one decode loop of every rlhfuse generator: the
sampling generator's plain mode included) read the device at most once (the sampled tokens), counted by
`SyncCounter` on the CPU (which stands in for the GPU: every read counts).

Before the host-side bookkeeping (main at 5c2ba0a), on these cases: the engine's plain decode step made 18-26
syncs greedy and 12-16 sampled (one stop check per running sample, plus the cache addressing), its verify step
12-53, and the sampling generator's own loop (since replaced by the engine's) 12; after, every one of them
makes exactly 1."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from rlhfuse.core.sampling import SamplingConfig
from rlhfuse.core.syncs import SyncCounter
from rlhfuse.core.types import Experience, PromptBatch
from rlhfuse.generation import GenerationEngine, SamplingParams, requests_for
from rlhfuse.generation.batched import SamplingGenerator
from rlhfuse.generation.engine import EngineStats, SampleRequest, WholeVocabulary
from rlhfuse.generation.fusion import _Inference
from rlhfuse.models import ModelConfig, Transformer
from rlhfuse.testing.standin import recording, standin_device

EOS, PAD, MAX_NEW = 2, 0, 16
PROMPTS = [[1, 5, 6, 7, 8], [1, 9], [1, 10, 11, 12]]
# several stop tokens: rows leave the batch at different steps, so steps that release slots are counted too
STOPS = (EOS, 6, 14)


def _model() -> Transformer:
    torch.manual_seed(0)
    config = ModelConfig.tiny(
        vocab_size=24, hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1
    )
    return Transformer(config, head="lm").eval()


def _prompts() -> PromptBatch:
    width = max(map(len, PROMPTS))
    ids = torch.full((len(PROMPTS), width), PAD)
    mask = torch.zeros((len(PROMPTS), width), dtype=torch.long)
    for b, p in enumerate(PROMPTS):
        ids[b, width - len(p) :] = torch.tensor(p)
        mask[b, width - len(p) :] = 1
    return PromptBatch(ids, mask, torch.arange(len(PROMPTS)))


def _engine_step_syncs(temperature: float, speculative: str) -> tuple[list[int], int]:
    """Syncs of each engine step after the first (which admits every sample), and samples finished in them."""
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=temperature, stop_token_ids=STOPS)
    engine = GenerationEngine(
        _model(), params, num_slots=12, max_len=5 + MAX_NEW, speculative=speculative, speculative_tokens=3
    )
    engine.add(requests_for(_prompts(), samples_per_prompt=4, seed=1, iteration=0))
    engine.step()
    assert not engine.waiting, "every sample is admitted by the first step: later steps only decode"
    counts, finished = [], 0
    while engine.has_work():
        with SyncCounter(device="cpu") as counter:
            finished += len(engine.step())
        counts.append(counter.count)
    return counts, finished


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
@pytest.mark.parametrize("speculative", ["off", "ngram"])
def test_an_engine_decode_step_reads_the_device_at_most_once(temperature, speculative):
    counts, finished = _engine_step_syncs(temperature, speculative)
    assert finished > 1 and len(counts) > 3, "the case must release slots over several steps"
    assert max(counts) <= 1, f"syncs per decode step: {counts}"


def test_the_sampling_generator_decode_step_reads_the_device_at_most_once():
    """Each model call after the prefill starts a step; the syncs between two calls are one step's."""
    model = _model()
    config = SamplingConfig(max_new_tokens=MAX_NEW, temperature=1.0, stop_token_ids=STOPS[1:])
    generator = SamplingGenerator(
        model, config, eos_token_id=EOS, pad_token_id=PAD, samples_per_prompt=4, seed=1
    )
    marks: list[int] = []
    with SyncCounter(device="cpu") as counter:
        hook = generator.model.register_forward_pre_hook(lambda *_: marks.append(counter.count))
        try:
            (rollout,) = generator.generate(_prompts(), iteration=0)
        finally:
            hook.remove()
    per_step = [b - a for a, b in itertools.pairwise(marks[1:])]
    lengths = rollout.response_mask_BR.sum(1)
    assert len(per_step) > 3 and int(lengths.min()) < int(lengths.max()), "rows must stop at different steps"
    assert max(per_step) <= 1, f"syncs per decode step: {per_step}"


class _Float64Ops(TorchDispatchMode):
    """Records the ops that produce a float64 tensor as wide as the vocabulary ([..., V])."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.seen = vocab, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if (
                isinstance(t, torch.Tensor)
                and t.dtype == torch.float64
                and t.dim()
                and t.shape[-1] == self.vocab
            ):
                self.seen.add(str(func))
        return out


def test_a_cuda_engine_filters_and_samples_in_float32():
    """A CUDA engine's token choice works in `sampling_dtype(cuda)` = float32: no [B, V] pass of its decode
    steps runs in float64 (every one did); here it runs on the CPU, with the float64 engine's tokens."""
    model = _model()
    vocab = model.config.vocab_size
    tokens = {}
    for dtype in (torch.float64, torch.float32):
        params = SamplingParams(
            max_new_tokens=MAX_NEW, temperature=0.8, top_k=12, top_p=0.9, stop_token_ids=STOPS
        )
        engine = GenerationEngine(
            model, params, num_slots=12, max_len=5 + MAX_NEW, choice=WholeVocabulary(dtype)
        )
        with _Float64Ops(vocab) as wide:
            done = engine.run(requests_for(_prompts(), samples_per_prompt=4, seed=1, iteration=0))
        tokens[dtype] = [r.tokens for r in done]
        assert bool(wide.seen) == (dtype is torch.float64), (dtype, wide.seen)
    assert isinstance(GenerationEngine(model, params, num_slots=1, max_len=21).choice, WholeVocabulary)
    assert tokens[torch.float32] == tokens[torch.float64]


class _Scored:
    """An inferencer whose results live on the stand-in device (as on a GPU): log-probs, values, scores, rules."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def infer(self, rollout):
        b, r = rollout.response_ids_BR.shape
        values = torch.arange(b * r, dtype=torch.float32).view(b, r).to(self.device)
        return Experience(
            rollout,
            values,
            values + 1,
            values + 2,
            torch.arange(b, dtype=torch.float32).to(self.device),
            torch.ones(b, 2).to(self.device),
        )


def test_fused_inference_reads_a_micro_batchs_scores_once():
    """A fused rollout's inference call keeps each sample's results: its scores and rule scores are read from
    the device once per micro-batch (they were read sample by sample, a wait each)."""
    device = standin_device()
    samples = [
        SampleRequest(row=i, prompt_index=i, sample_index=0, group=i, prompt_P=torch.tensor([1, 5]), seed=i,
                      tokens=[3] * (i + 1))
        for i in range(6)
    ]  # fmt: skip
    infer = _Inference(_Scored(device), SimpleNamespace(stats=EngineStats()), 0, budget=1000, most=8)
    with recording() as reads:
        infer.one(samples)
    assert reads.host_reads <= 2, reads
    assert [r.score for r in infer.rows] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert all(r.rule_scores == (1.0, 1.0) and r.values_N.device == device for r in infer.rows)
    assert [len(r.logprobs_N) for r in infer.rows] == [1, 2, 3, 4, 5, 6]
