"""Several instances with long-tail migration: migrated samples produce exactly the tokens they would have
produced without migration, by KV transfer and by re-prefill, including samples still waiting for a slot;
the policy's threshold and the planner's destinations are applied; the freed instances end empty."""

import pytest
import torch

from rlhfuse.core.types import PromptBatch
from rlhfuse.generation import (
    Coordinator,
    FixedThreshold,
    GenerationEngine,
    NoMigration,
    SamplingParams,
    balance,
    pick_mechanism,
    requests_for,
    resolve_threshold,
)
from rlhfuse.models import ModelConfig, Transformer

EOS, PAD, MAX_NEW = 2, 0, 16


def _model():
    torch.manual_seed(0)
    config = ModelConfig.tiny(
        vocab_size=24, hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1
    )
    return Transformer(config, head="lm").eval()


def _prompts(count=6):
    g = torch.Generator().manual_seed(1)
    rows = [[1, *torch.randint(3, 24, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()]
            for _ in range(count)]  # fmt: skip
    width = max(map(len, rows))
    ids = torch.full((count, width), PAD)
    mask = torch.zeros((count, width), dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, width - len(row) :] = torch.tensor(row)
        mask[b, width - len(row) :] = 1
    return PromptBatch(ids, mask, torch.arange(100, 100 + count))


PARAMS = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, top_p=0.95, stop_token_ids=(EOS, 6, 14))


def _run(instances, threshold, mechanism="kv", num_slots=24):
    model = _model()
    engines = [
        GenerationEngine(model, PARAMS, num_slots=num_slots, max_len=6 + MAX_NEW) for _ in range(instances)
    ]
    coordinator = Coordinator(engines, bs_max=4, mechanism=mechanism)
    requests = requests_for(_prompts(), samples_per_prompt=4, seed=3, iteration=1)
    done = list(coordinator.run(requests, threshold=threshold))
    tokens = {r.row: r.tokens for _, r in done}
    assert sorted(tokens) == list(range(len(requests)))
    return tokens, done, coordinator, engines


@pytest.mark.parametrize("mechanism", ["kv", "reprefill"])
@pytest.mark.parametrize("num_slots", [24, 4])
def test_migrated_samples_produce_the_tokens_they_would_have_produced(mechanism, num_slots):
    serial, *_ = _run(1, threshold=0)
    tokens, done, coordinator, engines = _run(3, threshold=8, mechanism=mechanism, num_slots=num_slots)
    assert tokens == serial
    report = coordinator.report
    assert report.threshold == 8 and report.mechanism == mechanism and report.samples_moved > 0
    # 8 tail samples, BSmax 4 -> m = 2 destinations; the third instance is freed and finishes nothing after
    assert report.destinations == 2 and len(report.freed) == 1
    freed = report.freed[0]
    assert all(e.has_work() is False for e in engines)
    after = [i for i, r in done[-8:]]
    assert freed not in after
    assert sum(len(t) for t in tokens.values()) == sum(e.stats.tokens for e in engines)


def test_no_migration_below_two_samples_and_policies():
    assert NoMigration().threshold(512) == 0
    assert FixedThreshold(0.2).threshold(512) == 102 and FixedThreshold(30).threshold(512) == 30
    assert FixedThreshold(1000).threshold(512) == 512 and resolve_threshold(0.5, 1) == 0
    with pytest.raises(ValueError, match=r"migration\.threshold"):
        FixedThreshold(0)
    assert pick_mechanism("auto", kv_bytes=1e6, link_bytes_per_s=1e9, reprefill_tokens=100,
                          prefill_s_per_token=1e-3) == "kv"  # fmt: skip
    assert pick_mechanism("auto", kv_bytes=1e9, link_bytes_per_s=1e8, reprefill_tokens=100,
                          prefill_s_per_token=1e-3) == "reprefill"  # fmt: skip
    with pytest.raises(ValueError, match=r"migration\.mechanism"):
        pick_mechanism("teleport", kv_bytes=1, link_bytes_per_s=1, reprefill_tokens=1, prefill_s_per_token=1)


def test_balance_keeps_prompt_groups_together_and_evens_the_load():
    requests = requests_for(_prompts(5), samples_per_prompt=3, seed=0, iteration=0)
    shares = balance(requests, 2)
    assert [len(s) for s in shares] == [9, 6]
    for share in shares:
        groups = {r.group for r in share}
        assert all(sum(r.group == g for r in share) == 3 for g in groups)


def test_auto_mechanism_migrates_and_keeps_tokens():
    serial, *_ = _run(1, threshold=0)
    tokens, _, coordinator, _ = _run(2, threshold=6, mechanism="auto")
    assert tokens == serial and coordinator.report.mechanism in ("kv", "reprefill")
