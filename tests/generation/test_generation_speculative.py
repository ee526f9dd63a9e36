"""Lossless speculative decoding in the engine (float64): speculative=ngram|auto gives exactly the tokens of
speculative=off, greedy and sampled, with prefix sharing on and off, with few slots, and across migration (KV
transfer and re-prefill); drafts come from the prompt group's n-gram index; `auto` decides from measured step
costs; bad settings fail before generation with the key named."""

import pytest
import torch
from test_generation_migration import _prompts  # the same 6 prompts, vocabulary 24

from rlhfuse.core.stats import GenerationStats
from rlhfuse.generation import Coordinator, GenerationConfig, GenerationEngine, SamplingParams, requests_for
from rlhfuse.generation.engine import WholeVocabulary
from rlhfuse.generation.speculative import GroupIndex, SpeculationCosts, speculation_problems
from rlhfuse.models import ModelConfig, Transformer

EOS, PAD, MAX_NEW, VOCAB = 2, 0, 24, 24


def _model(seed=0, sharpen=1.0, **overrides):
    torch.manual_seed(seed)
    config = ModelConfig.tiny(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1, **overrides
    )
    model = Transformer(config, head="lm").double().eval()
    with torch.no_grad():  # peakier next-token laws: a random model then repeats itself, as a warm one does
        model.lm_head.weight.mul_(sharpen)
    return model


GREEDY = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, stop_token_ids=(EOS, 6))
SAMPLED = SamplingParams(
    max_new_tokens=MAX_NEW, temperature=1.0, top_k=12, top_p=0.95, stop_token_ids=(EOS, 6)
)


def _engine(model, params, mode, *, num_slots=24, prefix_sharing=True, k=4):
    return GenerationEngine(
        model, params, num_slots=num_slots, max_len=6 + MAX_NEW, prefix_sharing=prefix_sharing,
        speculative=mode, speculative_tokens=k,
    )  # fmt: skip


def _generate(engines, threshold=0, mechanism="kv"):
    requests = requests_for(_prompts(), samples_per_prompt=4, seed=3, iteration=1)
    coordinator = Coordinator(engines, bs_max=4, mechanism=mechanism)
    done = [r for _, r in coordinator.run(requests, threshold=threshold)]
    assert sorted(r.row for r in done) == list(range(len(requests)))
    return {r.row: r.tokens for r in done}, coordinator


@pytest.mark.parametrize("mode", ["ngram", "auto"])
@pytest.mark.parametrize("prefix_sharing", [True, False])
@pytest.mark.parametrize("num_slots", [24, 5])
@pytest.mark.parametrize("sampling", ["greedy", "sampled"])
def test_speculation_gives_the_tokens_of_plain_decoding(mode, prefix_sharing, num_slots, sampling):
    params = GREEDY if sampling == "greedy" else SAMPLED
    model = _model(sharpen=1.0 if sampling == "greedy" else 40.0)
    plain, _ = _generate([_engine(model, params, "off", num_slots=num_slots, prefix_sharing=prefix_sharing)])
    engine = _engine(model, params, mode, num_slots=num_slots, prefix_sharing=prefix_sharing)
    if mode == "auto":  # costs as a CPU measures them: a step is a + b x positions, a large
        for rows in (1, 2, 4, 8):
            engine.costs.observe_decode(rows, 1e-3 + 1e-5 * rows)
    spec, _ = _generate([engine])
    assert spec == plain
    stats = engine.stats
    assert stats.tokens == sum(len(t) for t in spec.values())
    assert sum(stats.step_tokens) == stats.tokens - len(
        spec
    )  # the first token of each comes from its prefill
    assert int(engine.cache.lengths_S.sum()) == 0 and len(engine.free_slots) == num_slots
    if mode == "ngram":  # (auto's choice depends on this machine's timings; its rule is tested below)
        assert stats.spec_accepted > 0 and stats.spec_proposed >= stats.spec_accepted
        assert max(stats.step_positions) > 1
        # fewer forward passes per sample than tokens decoded: speculation saved steps
        assert sum(stats.batch_sizes) < sum(stats.step_tokens)


@pytest.mark.parametrize("mechanism", ["kv", "reprefill"])
@pytest.mark.parametrize("sampling", ["greedy", "sampled"])
def test_speculation_with_migration_gives_the_tokens_of_one_plain_instance(mechanism, sampling):
    params = GREEDY if sampling == "greedy" else SAMPLED
    model = _model(sharpen=1.0 if sampling == "greedy" else 40.0)
    plain, _ = _generate([_engine(model, params, "off")])
    engines = [_engine(model, params, "ngram", num_slots=6) for _ in range(3)]
    spec, coordinator = _generate(engines, threshold=8, mechanism=mechanism)
    assert spec == plain
    assert coordinator.report.samples_moved > 0 and coordinator.report.mechanism == mechanism
    assert sum(e.stats.spec_accepted for e in engines) > 0


@pytest.mark.parametrize("mechanism", ["kv", "reprefill"])
def test_speculation_and_migration_keep_a_sliding_windows_tokens(mechanism):
    """Mistral with a window of 4 keys: verify steps of k + 1 positions and migrated slots (their cache, or a
    re-prefill) attend through the same window as plain decoding."""
    model = _model(sharpen=40.0, architecture="mistral", sliding_window=4)
    plain, _ = _generate([_engine(model, SAMPLED, "off")])
    engines = [_engine(model, SAMPLED, "ngram", num_slots=6) for _ in range(3)]
    spec, coordinator = _generate(engines, threshold=8, mechanism=mechanism)
    assert spec == plain
    assert coordinator.report.samples_moved > 0 and sum(e.stats.spec_accepted for e in engines) > 0
    assert max(len(t) for t in plain.values()) > 2 * 4


def test_group_index_drafts_what_followed_the_longest_suffix_in_a_sibling():
    index = GroupIndex(max_ngram=3)
    prompt = [1, 5, 7]
    index.add_sequence(prompt)
    a = index.add_sequence([*prompt, 9, 4, 8, 3], start=3)  # a finished sibling
    b = index.add_sequence([*prompt, 9], start=3)
    assert index.draft(b, 3) == [4, 8, 3]  # "7 9" (and "5 7 9") were followed by 4 8 3 in a
    assert index.draft(b, 10) == [4, 8, 3]
    index.extend(b, [4, 2])
    assert index.draft(b, 2) == []  # "9 4 2", "4 2", "2" never seen
    index.extend(b, [5])
    assert index.draft(b, 2) == [7]  # "5" was last followed by "7" in the prompt (which ends there)
    assert index.draft(a, 2) == []  # a's own suffix "3" has no successor anywhere


def test_auto_speculates_when_the_batch_is_small_from_measured_costs():
    costs = SpeculationCosts()
    assert not costs.pays(1, 4)  # nothing measured yet: no speculation
    for rows in (1, 2, 4, 8, 16, 32):  # a step costs 10 ms + 0.1 ms per position
        costs.observe_decode(rows, 0.01 + 1e-4 * rows)
    # first guess, prior 2 tokens per row: verify(B, 4) = 0.01 + 5e-4 B vs 2 x decode(B) = 0.02 + 2e-4 B -> pays
    # below B = 33
    assert costs.pays(1, 4) and costs.pays(32, 4) and not costs.pays(34, 4)
    # measured verify steps of batch 4-7 (band 3): 2x a decode step and 1.2 tokens per row: stop there ...
    for _ in range(40):
        costs.observe_verify(5, 5, seconds=2 * (0.01 + 1e-4 * 5), tokens=6)
    assert not costs.pays(5, 4) and not costs.decide(6, 4)
    # ... but not where verify steps were not measured and the first guess still pays (tokens per row ~1.22)
    assert costs.pays(1, 4) is ((0.01 + 5e-4) / costs.tokens_per_row < 0.0101)
    # verify steps as cheap as decode steps with 1.2 tokens per row pay
    for _ in range(40):
        costs.observe_verify(5, 5, seconds=0.0105, tokens=6)
    assert costs.pays(5, 4)
    for _ in range(40):
        costs.observe_verify(5, 5, seconds=0.05, tokens=6)
    assert not costs.pays(5, 4) and not costs.decide(5, 4)
    for _ in range(costs.explore_every):  # plain steps in a row: try a verify step again
        costs.observe_decode(5, 0.0105)
    assert not costs.pays(5, 4) and costs.decide(5, 4)


def test_auto_keeps_measuring_plain_steps_while_it_speculates_and_stops_when_they_win():
    """While verify steps win, a plain step runs after every `explore_every` of them; when the machine changes
    (plain steps now measure cheaper than verify steps' seconds per token) auto stops speculating. A verify step
    that only ties a plain one (within the margin) is not chosen."""
    costs = SpeculationCosts(explore_every=8)
    for rows in (1, 2):
        costs.observe_decode(rows, 0.01)
    for _ in range(10):
        costs.observe_verify(1, 5, seconds=0.012, tokens=3)  # 3 tokens for 1.2 plain steps: verify wins
    assert costs.pays(1, 4)
    chosen = []
    for _ in range(18):
        verify = costs.decide(1, 4)
        chosen.append(verify)
        if verify:
            costs.observe_verify(1, 5, seconds=0.012, tokens=3)
        else:
            costs.observe_decode(1, 0.01)
    # 10 verify steps measured above: a plain one first, then one after every 8 verify steps
    assert chosen == [False] + [True] * 8 + [False] + [True] * 8
    # the load changed: plain steps now take 2 ms, verify 12 ms for ~3 tokens (4 ms per token): stop
    for _ in range(40):
        costs.observe_decode(1, 0.002)
    assert not costs.pays(1, 4)
    tie = SpeculationCosts(prior_weight=0.0)
    for rows in (1, 2):
        tie.observe_decode(rows, 0.01)
    tie.observe_verify(1, 5, seconds=0.0198, tokens=2)  # 9.9 ms per token against 10: inside the margin
    assert not tie.pays(1, 4)


def test_bad_speculation_settings_fail_before_generation_naming_the_key(monkeypatch):
    model = _model()
    with pytest.raises(ValueError, match=r"generator\.speculative_tokens=0 must be >= 1"):
        _engine(model, GREEDY, "ngram", k=0)
    with pytest.raises(ValueError, match=rf"generator\.speculative_tokens={MAX_NEW} leaves no slot room"):
        _engine(model, GREEDY, "auto", k=MAX_NEW)
    with pytest.raises(ValueError, match=r"generator\.speculative='medusa' is unknown"):
        _engine(model, GREEDY, "medusa")
    _engine(model, GREEDY, "off", k=0)  # k is not read when speculation is off
    assert speculation_problems("ngram", 4, 48, "sdpa") == []
    monkeypatch.setattr("rlhfuse.generation.speculative.MULTI_POSITION_BACKENDS", frozenset({"flash"}))
    with pytest.raises(ValueError, match=r"attention_backend='sdpa' cannot"):
        _engine(model, GREEDY, "ngram")
    assert any(
        "set generator=engine" in p for p in _rules("generator=sampling", "generator.speculative=ngram")
    )
    assert _rules("generator=engine", "generator.speculative=ngram") == []
    config = GenerationConfig(name="engine")
    config.engine.speculative, config.engine.speculative_tokens = "ngram", 0
    assert any("generator.speculative_tokens=0" in p for p in config.problems())


def test_an_engine_choosing_tokens_across_ranks_refuses_timing_driven_speculation():
    """Ranks that choose tokens together (a tensor-parallel instance's `VocabularyShards`) must make the same
    decisions each step: speculative=auto decides from rank-local timings, so it is refused; ngram (decided from
    the tokens, the same on every rank) is not."""

    class Together(WholeVocabulary):
        lockstep = True

    model = _model()
    with pytest.raises(ValueError, match=r"speculative=auto chooses from this rank's timings"):
        GenerationEngine(model, GREEDY, num_slots=2, max_len=64, speculative="auto", choice=Together())
    GenerationEngine(model, GREEDY, num_slots=2, max_len=64, speculative="ngram", choice=Together())


def _rules(*overrides: str) -> list[str]:
    """The chosen generator's own rules (its registry entry's) for a composed configuration."""
    from rlhfuse.trainer import compose_config
    from rlhfuse.trainer.topology import generator_entry, topology

    cfg = compose_config(list(overrides))
    return generator_entry(cfg.generator.name).problems(cfg, topology(cfg), None)


def test_speculation_metrics_are_logged_only_when_it_is_on():
    off = GenerationStats(0, 0, 0, 4.0, 100.0)
    on = off._replace(spec_accept_rate=0.5, spec_tokens_per_step=1.5)
    assert not any(k.startswith("generation/spec_") for k in off.metrics())
    assert on.metrics()["generation/spec_accept_rate"] == 0.5
    assert on.metrics()["generation/spec_tokens_per_step"] == 1.5


def test_vllm_passes_ngram_through_and_refuses_the_rest():
    """generator=vllm takes generator.speculative=ngram (vLLM's own n-gram speculation) and refuses auto, before
    any engine; a vllm without an n-gram method gets a clear error naming the key."""
    from types import SimpleNamespace

    from rlhfuse.generation.vllm_engine import ngram_speculative_config

    ngram = _rules("generator=vllm", "generator.speculative=ngram")
    assert not any("speculative" in p for p in ngram), ngram
    assert any(
        "only ngram is passed through" in p for p in _rules("generator=vllm", "generator.speculative=auto")
    )
    no_ngram = SimpleNamespace(__version__="0.4.0", config=SimpleNamespace())  # what an old vllm exposes
    with pytest.raises(
        ValueError, match=r"generator\.speculative=ngram with generator=vllm .* 0\.4\.0 does not"
    ):
        ngram_speculative_config(no_ngram, 4)
