"""Host syncs per decode step: the engine's decode steps (the one decode loop of every rlhfuse generator: the
sampling generator's plain mode included) read the device at most once (the sampled tokens), counted by
`SyncCounter` on the CPU (which stands in for the GPU: every read counts).

Before the host-side bookkeeping (main at 5c2ba0a), on these cases: the engine's plain decode step made 18-26
syncs greedy and 12-16 sampled (one stop check per running sample, plus the cache addressing), its verify step
12-53, and the sampling generator's own loop (since replaced by the engine's) 12; after, every one of them
makes exactly 1."""

from __future__ import annotations

import itertools

import pytest
import torch

from rlhfuse.core.sampling import SamplingConfig
from rlhfuse.core.syncs import SyncCounter
from rlhfuse.core.types import PromptBatch
from rlhfuse.generation import GenerationEngine, SamplingParams, requests_for
from rlhfuse.generation.batched import SamplingGenerator
from rlhfuse.models import ModelConfig, Transformer

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
