"""Sampling generator: per-sample RNG independent of batch composition, KV cache equals recomputation,
EOS/stop tokens, top-k/top-p filtering."""

import pytest
import torch

from rlhfuse.core.sampling import SamplingConfig, filter_logits, sample_from
from rlhfuse.core.types import PromptBatch
from rlhfuse.generation.batched import SamplingGenerator
from rlhfuse.models import ModelConfig, Transformer

EOS, PAD = 2, 0


def _model(seed=0):
    torch.manual_seed(seed)
    config = ModelConfig.tiny(
        vocab_size=24, hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1
    )
    return Transformer(config, head="lm").eval()


PROMPTS = {7: [1, 5, 6, 7, 8], 11: [1, 9], 3: [1, 10, 11, 12]}


def _batch(ids):
    width = max(len(PROMPTS[i]) for i in ids)
    input_ids = torch.full((len(ids), width), PAD)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for b, i in enumerate(ids):
        input_ids[b, width - len(PROMPTS[i]) :] = torch.tensor(PROMPTS[i])
        mask[b, width - len(PROMPTS[i]) :] = 1
    return PromptBatch(input_ids, mask, torch.tensor(ids))


def _samples(generator, ids, iteration=0):
    out = {}
    for rollout in generator.generate(_batch(ids), iteration=iteration):
        for b in range(len(rollout)):
            n = int(rollout.response_mask_BR[b].sum())
            key = (int(rollout.prompt_index_B[b]), int(rollout.sample_index_B[b]))
            out[key] = rollout.response_ids_BR[b, :n].tolist()
    return out


def _generator(model, **overrides):
    config = SamplingConfig(max_new_tokens=12, **overrides)
    return SamplingGenerator(model, config, eos_token_id=EOS, pad_token_id=PAD, samples_per_prompt=3, seed=5)


def test_sample_tokens_do_not_depend_on_batch_composition():
    gen = _generator(_model(), temperature=1.0, top_p=0.9, top_k=12)
    together = _samples(gen, [7, 11, 3])
    alone = _samples(gen, [11])
    reordered = _samples(gen, [3, 7])
    chunked = _samples(
        _generator(_model(), temperature=1.0, top_p=0.9, top_k=12, max_batch_size=2), [7, 11, 3]
    )
    assert {k: v for k, v in together.items() if k[0] == 11} == alone
    assert {k: v for k, v in together.items() if k[0] != 11} == reordered
    assert together == chunked
    assert len({tuple(v) for v in together.values()}) > 3  # samples of one prompt differ from each other
    assert _samples(gen, [7, 11, 3], iteration=1) != together  # a new iteration draws new streams


def test_kv_cache_decoding_matches_full_recomputation():
    model = _model(1)
    gen = _generator(model, temperature=0.0)
    (rollout,) = gen.generate(_batch([7]), iteration=0)
    tokens = list(PROMPTS[7])
    with torch.no_grad():
        for _ in range(int(rollout.response_mask_BR[0].sum())):
            tokens.append(int(model(torch.tensor([tokens]))[0, -1].argmax()))
    n = int(rollout.response_mask_BR[0].sum())
    assert rollout.response_ids_BR[0, :n].tolist() == tokens[len(PROMPTS[7]) :]


def test_stop_tokens_end_responses_and_max_new_tokens_caps_them():
    # every token is a stop token: each response is exactly one token long and finished
    gen = _generator(_model(2), temperature=1.0, stop_token_ids=list(range(24)))
    for rollout in gen.generate(_batch([7, 11]), iteration=0):
        assert rollout.response_mask_BR.sum(dim=1).tolist() == [1] * len(rollout)
        assert bool(rollout.finished_B.all())
    capped = _generator(_model(3), temperature=1.0)
    for rollout in capped.generate(_batch([7, 11, 3]), iteration=0):
        lengths = rollout.response_mask_BR.sum(dim=1)
        assert int(lengths.max()) <= 12
        for b in range(len(rollout)):
            n = int(lengths[b])
            ended = int(rollout.response_ids_BR[b, n - 1]) == EOS
            assert bool(rollout.finished_B[b]) == ended
            assert ended or n == 12
            assert (rollout.response_ids_BR[b, n:] == PAD).all()


def test_top_k_and_top_p_filtering_by_hand():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert filter_logits(logits, temperature=1.0, top_k=2, top_p=1.0).tolist()[0] == pytest.approx(
        [0.5 / 0.8, 0.3 / 0.8, 0, 0]
    )
    # top_p=0.8: 0.5 alone < 0.8, 0.5+0.3 reaches it, so tokens 0 and 1 stay
    assert filter_logits(logits, temperature=1.0, top_k=0, top_p=0.8).tolist()[0] == pytest.approx(
        [0.5 / 0.8, 0.3 / 0.8, 0, 0]
    )
    assert filter_logits(logits, temperature=1.0, top_k=0, top_p=0.81).tolist()[0] == pytest.approx(
        [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]
    )
    probs = torch.tensor([[0.5, 0.3, 0.2, 0.0]], dtype=torch.float64)
    picks = [int(sample_from(probs, torch.tensor([u]))) for u in (0.0, 0.49, 0.51, 0.79, 0.81, 0.999)]
    assert picks == [0, 0, 1, 1, 2, 2]


def test_weight_sync_changes_what_is_generated():
    gen = _generator(_model(4), temperature=0.0)
    before = _samples(gen, [7])
    gen.load_weights(_model(5).state_dict())
    assert _samples(gen, [7]) != before


def test_a_call_may_sample_its_own_way_for_evaluation():
    """`sampling=` (held-out evaluation): greedy here, 2 samples per prompt, while the generator's own settings
    (sampled, 3 per prompt) stay in force for the next call."""
    from rlhfuse.core.sampling import Sampling

    gen = _generator(_model(), temperature=1.0)
    greedy = Sampling(SamplingConfig(max_new_tokens=12, temperature=0.0), samples_per_prompt=2)
    (rollout,) = gen.generate(_batch([7, 11]), iteration=0, sampling=greedy)
    assert rollout.sample_index_B.tolist() == [0, 1, 0, 1]
    out = _samples(gen, [7, 11])
    assert len(out) == 6  # the generator's own samples_per_prompt again
    n = rollout.response_mask_BR.sum(dim=1).tolist()
    responses = [rollout.response_ids_BR[b, : n[b]].tolist() for b in range(4)]
    assert responses[0] == responses[1] and responses[2] == responses[3]  # greedy: one answer per prompt
    assert responses[0] == _samples(_generator(_model(), temperature=0.0), [7])[(7, 0)]
