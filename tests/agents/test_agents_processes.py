"""Multi-turn episodes over two generation processes (gloo, issue 43): each turn's call migrates its own long
tail between the instances, and the episodes' trajectories are the same with migration on and off, greedy and
sampled, on both ranks, and the same as one process's; the environments run on rank 0 only, which shares each
turn's answers.

The model is a random tiny Transformer over a byte-level tokenizer with a chat template; its turns end at a
few frequent bytes (stop tokens) so that the episodes last several turns of differing lengths."""

from __future__ import annotations

import os
from typing import Any, ClassVar

import pytest
import torch

from rlhfuse.agents import GuessingGame
from rlhfuse.agents.generator import AgentGenerator
from rlhfuse.core.sampling_config import SamplingConfig
from rlhfuse.core.types import PromptBatch, Rollout
from rlhfuse.data.collate import left_padded
from rlhfuse.data.prompts import Prompt
from rlhfuse.generation import EngineGenerator, FixedThreshold, GenerationConfig, InstanceSetup, NoMigration
from rlhfuse.generation.generator import EnginePool
from rlhfuse.models import ModelConfig, Transformer
from rlhfuse.testing.chat import byte_tokenizer
from rlhfuse.testing.processes import spawn_ranks

PER_PROMPT, PROMPTS, MAX_TURNS = 3, 8, 4
RT = 20  # of the 24 samples: each turn migrates as soon as a few have finished


class CountedGame(GuessingGame):
    """The guessing game, counting the environments this process made."""

    made: ClassVar[int] = 0

    def __init__(self) -> None:
        CountedGame.made += 1


def _model(vocab: int) -> Transformer:
    torch.manual_seed(0)
    config = ModelConfig.tiny(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1
    )
    return Transformer(config, head="lm").eval()


def _setup(temperature: float) -> tuple[Any, dict[int, Prompt], SamplingConfig, PromptBatch]:
    tok = byte_tokenizer()
    prompts = {}
    for i in range(PROMPTS):  # prompts of differing lengths: differing greedy trajectories
        messages = ({"role": "user", "content": "Guess my number" + "!" * i + "."},)
        text = tok.render_chat(list(messages))
        prompts[i] = Prompt(i, text, tuple(tok.encode(text, add_bos=False)), {"secret": 10 * i + 7}, messages)
    stops = [tok.eos_id, *(tok.encode(c, add_bos=False)[0] for c in "aeiou.0123456789")]
    sampling = SamplingConfig(max_new_tokens=16, temperature=temperature, stop_token_ids=stops)
    batch = left_padded([list(p.token_ids) for p in prompts.values()], list(prompts), tok.pad_id)
    return tok, prompts, sampling, batch


def _episodes(temperature: float, policy: Any, instances: int) -> tuple[Rollout, list[int]]:
    """The rollout of one `generate` call of the agent over the engine generator, and the samples each turn's
    call moved."""
    tok, prompts, sampling, batch = _setup(temperature)
    config = GenerationConfig(name="engine", sampling=sampling, instances=instances)
    setup = InstanceSetup(
        tok.eos_id, tok.pad_id, samples_per_prompt=PER_PROMPT, seed=3, policy=policy, bs_max=16
    )
    inner = EngineGenerator(EnginePool(_model(tok.vocab_size), config.engine), config, setup, mechanism="kv")
    moved: list[int] = []

    class Recording:  # the inner generator, recording each turn's migration
        def __getattr__(self, name: str) -> Any:
            return getattr(inner, name)

        def generate(self, *args: Any, **kwargs: Any) -> Any:
            chunks = list(inner.generate(*args, **kwargs))
            moved.append(int(inner.migration.samples_moved))
            return iter(chunks)

    agent = AgentGenerator(
        Recording(), CountedGame, tok, prompts, sampling=sampling, samples_per_prompt=PER_PROMPT,
        max_turns=MAX_TURNS,
    )  # fmt: skip
    rollout = Rollout.cat(list(agent.generate(batch, iteration=1)), tok.pad_id)
    return rollout, moved


def _worker(rank: int, port: int, out_dir: str) -> None:

    from rlhfuse.testing.processes import gloo_rank

    with gloo_rank(rank, port, timeout_s=60):
        out = {}
        for temperature in (0.0, 1.0):
            for name, policy in (("off", NoMigration()), ("on", FixedThreshold(RT))):
                out[(temperature, name)] = _episodes(temperature, policy, instances=2)
        out["made"] = CountedGame.made
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))


def _same(a: Rollout, b: Rollout) -> None:
    for field in ("prompt_ids_BP", "response_ids_BR", "response_mask_BR", "trainable_mask_BR", "finished_B",
                  "env_reward_B", "prompt_index_B", "sample_index_B"):  # fmt: skip
        assert torch.equal(getattr(a, field), getattr(b, field)), field
    assert torch.equal(a.episodes_BE[:, :3], b.episodes_BE[:, :3])  # turns, tool calls, tool errors
    torch.testing.assert_close(a.sampler_logprobs_BR, b.sampler_logprobs_BR)


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_episodes_migrate_each_turn_and_keep_their_trajectories(tmp_path):
    assert spawn_ranks(_worker, str(tmp_path), timeout_s=200) == [0, 0]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    # the environments ran on rank 0 only: one per episode and call
    assert ranks[0]["made"] == 4 * PROMPTS * PER_PROMPT and ranks[1]["made"] == 0
    for temperature in (0.0, 1.0):
        one_process, _ = _episodes(temperature, NoMigration(), instances=1)
        turns = one_process.episodes_BE[:, 0]
        assert turns.max() >= 3 and turns.min() == 1  # multi-turn episodes of differing lengths
        for out in ranks:
            off, moved_off = out[(temperature, "off")]
            on, _ = out[(temperature, "on")]
            assert sum(moved_off) == 0
            _same(off, one_process)
            _same(on, one_process)
        # samples moved in the later turns' calls (rank 0's report: what it decided)
        moved = ranks[0][(temperature, "on")][1]
        assert len(moved) == MAX_TURNS and sum(moved[1:]) > 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_kept_kv_between_turns_prefills_only_the_new_tokens_and_keeps_the_trajectories(temperature):
    """generator.prefix_cache: each turn's prompt continues the previous turn's sample, whose KV the engine kept."""
    runs = {}
    for keep in (0, 64):
        tok, prompts, sampling, batch = _setup(temperature)
        config = GenerationConfig(name="engine", sampling=sampling)
        config.engine.prefix_cache = keep
        setup = InstanceSetup(tok.eos_id, tok.pad_id, samples_per_prompt=PER_PROMPT, seed=3, bs_max=16)
        pool = EnginePool(_model(tok.vocab_size), config.engine)
        inner = EngineGenerator(pool, config, setup, mechanism="kv")
        agent = AgentGenerator(
            inner,
            CountedGame,
            tok,
            prompts,
            sampling=sampling,
            samples_per_prompt=PER_PROMPT,
            max_turns=MAX_TURNS,
        )
        rollout = Rollout.cat(list(agent.generate(batch, iteration=1)), tok.pad_id)
        runs[keep] = (rollout, pool.prefixes)
    (whole, _), (kept, store) = runs[0], runs[64]
    _same(kept, whole)
    assert store.hits >= PROMPTS and store.reused_tokens > 0  # later turns continued the kept samples
