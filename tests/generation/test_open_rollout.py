"""`OpenRollout`: a rollout whose prompts join while its instances decode. Its samples are the ones a closed batch
gives for the same prompts (each sample's tokens from its own stream), with 3 instances and long-tail migration,
prompts added mid-way included; groups leave whole as their last sample finishes; `close` drops what still
decodes and leaves the instances ready for the next batch; after a migration, later prompts go to its
destinations."""

import torch

from rlhfuse.data.collate import left_padded
from rlhfuse.generation import Coordinator, GenerationEngine, SamplingParams, requests_for
from rlhfuse.generation.open_rollout import OpenRollout
from rlhfuse.models import ModelConfig, Transformer

EOS, PAD, MAX_NEW, N = 2, 0, 16, 4
PARAMS = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, top_p=0.95, stop_token_ids=(EOS, 6, 14))


def _model():
    torch.manual_seed(0)
    config = ModelConfig.tiny(
        vocab_size=24, hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1
    )
    return Transformer(config, head="lm").eval()


def _prompts(ids):
    rows = []
    for p in ids:
        g = torch.Generator().manual_seed(p)
        rows.append([1, *torch.randint(3, 24, (1 + p % 5,), generator=g).tolist()])
    return left_padded(rows, ids, PAD)


def _closed(ids):
    """(prompt id, sample index) -> tokens, the prompts decoded as one closed batch by one instance."""
    engine = GenerationEngine(_model(), PARAMS, num_slots=64, max_len=6 + MAX_NEW)
    done = engine.run(requests_for(_prompts(ids), samples_per_prompt=N, seed=3, iteration=2))
    return {(r.prompt_index, r.sample_index): r.tokens for r in done}


def _open(instances, threshold=0, slots=64):
    model = _model()
    engines = [
        GenerationEngine(model, PARAMS, num_slots=slots, max_len=6 + MAX_NEW) for _ in range(instances)
    ]
    coordinator = Coordinator(engines, bs_max=4)
    batch = OpenRollout(
        coordinator, samples_per_prompt=N, seed=3, iteration=2, pad_token_id=PAD, threshold=threshold
    )
    return batch, coordinator, engines


def _drain(batch):
    """Every group the batch finishes: (group number, prompt ids of its rows, sample indices, tokens)."""
    out = []
    while (done := batch.finished()) is not None:
        groups, rollout = done
        rows = rollout.response_mask_BR.sum(dim=1).tolist()
        for k, g in enumerate(groups):
            span = slice(k * N, (k + 1) * N)
            tokens = [rollout.response_ids_BR[b, : rows[b]].tolist() for b in range(span.start, span.stop)]
            out.append(
                (g, rollout.prompt_index_B[span].tolist(), rollout.sample_index_B[span].tolist(), tokens)
            )
    return out


def test_prompts_added_while_decoding_give_the_closed_batch_samples_with_migration():
    first, later = [100, 101, 102, 103, 104, 105], [106, 107, 108]
    batch, coordinator, engines = _open(3, threshold=8)
    batch.add(_prompts(first))
    out = []
    done = batch.finished()  # the first groups out: the later prompts join the instances still decoding
    assert done is not None
    groups, rollout = done
    assert len(rollout) == N * len(groups)
    batch.add(_prompts(later))
    out = _drain(batch)
    assert batch.groups_open == 0 and coordinator.report.samples_moved > 0  # the tail moved
    closed = _closed(first + later)
    seen = set(groups)
    for g, prompt_ids, samples, tokens in out:
        assert prompt_ids == [(first + later)[g]] * N and samples == list(range(N))  # whole, in sample order
        assert tokens == [closed[(prompt_ids[0], i)] for i in range(N)]
        seen.add(g)
    assert seen == set(range(len(first + later)))  # numbered on, in the order added
    assert all(not e.has_work() for e in engines)


def test_prompts_added_after_the_migration_go_to_its_destinations():
    batch, coordinator, engines = _open(3, threshold=6)
    batch.add(_prompts([100, 101, 102, 103]))
    while not coordinator.report.at:
        assert batch.finished() is not None
    freed = coordinator.report.freed
    assert freed and not any(engines[i].has_work() for i in freed)
    batch.add(_prompts([110, 111]))
    assert not any(engines[i].has_work() for i in freed)
    closed = _closed([110, 111])
    for _, prompt_ids, samples, tokens in _drain(batch):
        if prompt_ids[0] >= 110:
            assert tokens == [closed[(prompt_ids[0], i)] for i in samples]


def test_close_drops_what_still_decodes_and_counts_its_tokens():
    batch, coordinator, engines = _open(2, slots=2)  # 2 slots each: most samples wait for one
    batch.add(_prompts([100, 101, 102, 103]))
    done = batch.finished()
    assert done is not None
    running = sum(len(r.tokens) for e in engines for r in e.running.values())
    waiting = sum(len(e.waiting) for e in engines)
    assert running > 0 and waiting > 0
    finished_of_open_groups = sum(len(r.tokens) for members in batch._partial.values() for r in members)
    assert batch.close() == running + finished_of_open_groups
    assert batch.groups_open == 0 and all(not e.has_work() for e in engines)
    assert all(len(e.free_slots) == 2 for e in engines)
    # the instances take the next batch as if new
    again = OpenRollout(coordinator, samples_per_prompt=N, seed=3, iteration=2, pad_token_id=PAD)
    again.add(_prompts([105]))
    (out,) = _drain(again)
    assert out[3] == [_closed([105])[(105, i)] for i in range(N)]
