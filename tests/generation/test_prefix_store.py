"""Finished samples' KV kept for a prompt that continues one (`generator.prefix_cache`): the store's longest
strict prefix, its bound and one state per sample; the engine prefills only the new tokens and samples what it
would have sampled after a whole prefill; kept states go when the weights change."""

from __future__ import annotations

import torch

from rlhfuse.generation import GenerationEngine, SamplingParams
from rlhfuse.generation.engine import SampleRequest
from rlhfuse.generation.prefix_store import PrefixStore
from rlhfuse.models import ModelConfig, SlotState, Transformer


def _state(n: int, pad: int = 0) -> SlotState:
    valid = torch.tensor([False] * pad + [True] * n)
    return SlotState(torch.arange(pad + n).float().view(1, 1, -1, 1), torch.zeros(1, 1, pad + n, 1), valid)


def test_the_store_gives_the_longest_kept_prefix_once_and_keeps_its_bound() -> None:
    store = PrefixStore(3)
    store.put([1, 2], _state(2, pad=2))  # the batch's left padding is dropped
    store.put([1, 2, 3], _state(3))
    # [1, 2, 3] itself leaves nothing to prefill: the shorter kept prefix is the one taken
    length, state = store.take([1, 2, 3])
    assert length == 2 and state.k_LHTD.flatten().tolist() == [2.0, 3.0] and state.valid_T.all()
    length, state = store.take([1, 2, 3, 4])
    assert (
        length == 3 and state.length == 3 and store.take([1, 2, 3, 4]) is None and store.take([5, 6]) is None
    )
    for _ in range(2):  # a group's greedy samples: one state each
        store.put([7, 8], _state(2))
    assert store.size == 2 and store.take([7, 8, 9])[0] == 2 and store.take([7, 8, 9])[0] == 2
    for n in range(1, 6):
        store.put(list(range(n)), _state(n))
    assert store.size == 3 and store.take([0, 1, 2]) is None  # the oldest dropped
    store.clear()
    assert store.size == 0 and not store.entries


def test_a_continued_prompt_prefills_only_its_new_tokens_and_samples_the_same() -> None:
    torch.manual_seed(0)
    config = ModelConfig.tiny(
        vocab_size=40, hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1
    )
    model = Transformer(config, head="lm").eval()
    params = SamplingParams(max_new_tokens=6, temperature=1.0, stop_token_ids=(2,))
    prompts = [torch.tensor([1, 5, 6, 7]), torch.tensor([1, 9])]

    def first(store: PrefixStore | None) -> tuple[list[SampleRequest], list[SampleRequest], int]:
        engine = GenerationEngine(model, params, num_slots=4, max_len=32, prefixes=store)
        turn1 = [SampleRequest(b, b, 0, b, p, seed=10 + b) for b, p in enumerate(prompts)]
        engine.run(turn1)
        # the next turn: each prompt continued by its sampled tokens and an answer of two tokens
        turn2 = [
            SampleRequest(
                b, b, 0, 100 + b, torch.cat([r.prompt_P, torch.tensor([*r.tokens, 30, 31])]), seed=20 + b
            )
            for b, r in enumerate(turn1)
        ]
        before = engine.stats.prefill_tokens
        engine.run(turn2)
        return turn1, turn2, engine.stats.prefill_tokens - before

    _, whole, whole_prefill = first(None)
    store = PrefixStore(8)
    turn1, kept, kept_prefill = first(store)
    assert store.hits == 2 and kept_prefill == whole_prefill - store.reused_tokens
    assert store.reused_tokens == sum(len(r.prompt_P) + len(r.tokens) - 1 for r in turn1)
    assert [r.tokens for r in kept] == [r.tokens for r in whole]
    for a, b in zip(kept, whole, strict=True):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def test_a_pools_kept_states_go_when_the_weights_change() -> None:
    from rlhfuse.generation.generation_config import EngineOptions
    from rlhfuse.generation.generator import EnginePool

    model = Transformer(
        ModelConfig.tiny(vocab_size=40, hidden_size=32, intermediate_size=64), head="lm"
    ).eval()
    pool = EnginePool(model, EngineOptions(prefix_cache=4))
    assert pool.prefixes is not None and EnginePool(model, EngineOptions()).prefixes is None
    pool.prefixes.put([1, 2], _state(2))
    pool.load_weight_buckets([model.state_dict()])
    assert pool.prefixes.size == 0


def test_continued_prompts_whose_padding_would_pass_the_cache_extend_one_by_one() -> None:
    torch.manual_seed(0)
    config = ModelConfig.tiny(
        vocab_size=40, hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1
    )
    model = Transformer(config, head="lm").eval()
    params = SamplingParams(max_new_tokens=2, temperature=0.0, stop_token_ids=())
    long_prompt, short_prompt = torch.arange(3, 23), torch.tensor([1, 9])
    outs = []
    for store in (None, PrefixStore(4)):
        engine = GenerationEngine(model, params, num_slots=2, max_len=36, prefixes=store)
        turn1 = [
            SampleRequest(0, 0, 0, 0, long_prompt, seed=1),
            SampleRequest(1, 1, 0, 1, short_prompt, seed=2),
        ]
        engine.run(turn1)
        # the long one continued by 2 tokens, the short one by 30: one padded extend would need 21 + 30 > 36
        more = [torch.tensor([30, 31]), torch.arange(4, 34) % 40]
        turn2 = [
            SampleRequest(b, b, 0, 10 + b, torch.cat([r.prompt_P, torch.tensor(r.tokens), m]), seed=5 + b)
            for b, (r, m) in enumerate(zip(turn1, more, strict=True))
        ]
        engine.run(turn2)
        outs.append([r.tokens for r in turn2])
    assert store.hits == 2 and outs[0] == outs[1]
