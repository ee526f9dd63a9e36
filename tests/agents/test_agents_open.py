"""`OpenAgentGenerator`: multi-turn episodes at their own pace over one open rollout (issue 43). The episodes are
the ones `AgentGenerator` plays turn by turn, all at once (one instance with kept KV, and two in-process instances
with migration; greedy and sampled); an episode whose environment is slow to answer holds up no other episode's
turns, where the turn-by-turn loop waits for it.

The model is the random tiny Transformer over the byte-level chat tokenizer of `test_agents_processes`."""

from __future__ import annotations

import threading
from typing import Any, ClassVar

import pytest
import torch
from test_agents_processes import MAX_TURNS, PER_PROMPT, CountedGame, _model, _same, _setup

from rlhfuse.agents import GuessingGame
from rlhfuse.agents.generator import AgentGenerator, OpenAgentGenerator
from rlhfuse.core.types import Rollout
from rlhfuse.generation import EngineGenerator, FixedThreshold, GenerationConfig, InstanceSetup, NoMigration
from rlhfuse.generation.generator import EnginePool

BOUND = 400  # agent.max_response_tokens for both loops: the open one sizes its KV cache by it


def _play(kind: type, environment: type, temperature: float, instances: int, keep: int) -> Rollout:
    tok, prompts, sampling, batch = _setup(temperature)
    config = GenerationConfig(name="engine", sampling=sampling, instances=instances)
    config.engine.prefix_cache = keep
    policy = FixedThreshold(12) if instances > 1 else NoMigration()
    setup = InstanceSetup(
        tok.eos_id, tok.pad_id, samples_per_prompt=PER_PROMPT, seed=3, policy=policy, bs_max=8
    )
    inner = EngineGenerator(EnginePool(_model(tok.vocab_size), config.engine), config, setup, mechanism="kv")
    agent = kind(
        inner, environment, tok, prompts, sampling=sampling, samples_per_prompt=PER_PROMPT,
        max_turns=MAX_TURNS, max_response_tokens=BOUND,
    )  # fmt: skip
    rollout = Rollout.cat(list(agent.generate(batch, iteration=1)), tok.pad_id)
    order = rollout.prompt_index_B * PER_PROMPT + rollout.sample_index_B
    return rollout.select(torch.argsort(order))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize(("instances", "keep"), [(1, 64), (2, 0)], ids=["kept-kv", "2-instances-migrating"])
def test_episodes_at_their_own_pace_are_the_turn_by_turn_ones(temperature, instances, keep):
    together = _play(AgentGenerator, CountedGame, temperature, instances, keep)
    own_pace = _play(OpenAgentGenerator, CountedGame, temperature, instances, keep)
    turns = together.episodes_BE[:, 0]
    assert turns.max() >= 3 and turns.min() == 1  # multi-turn episodes of differing lengths
    _same(own_pace, together)


class SlowFirstAnswer(GuessingGame):
    """Prompt 1's episodes answer their first turn only once some other episode has played 2 turns (or after
    `patience` seconds): a slow service for the one, none for the others (greedy, prompt 0's episodes play 4)."""

    patience = 10.0
    second_turns = threading.Event()
    waited: ClassVar[list[bool]] = []

    def reset(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        self.slow, self.turn = row["secret"] == 17, 0
        return super().reset(row)

    def step(self, message: dict[str, Any]) -> tuple[list[dict[str, Any]], float, bool]:
        self.turn += 1
        if self.slow and self.turn == 1:
            SlowFirstAnswer.waited.append(SlowFirstAnswer.second_turns.wait(self.patience))
        elif self.turn == 2:
            SlowFirstAnswer.second_turns.set()
        return super().step(message)


@pytest.mark.parametrize(("kind", "patience", "others_go_on"), [(OpenAgentGenerator, 10.0, True),
                                                               (AgentGenerator, 0.5, False)])  # fmt: skip
def test_a_slow_answer_holds_up_its_own_episode_only(kind, patience, others_go_on, monkeypatch):
    monkeypatch.setattr(SlowFirstAnswer, "patience", patience)
    monkeypatch.setattr(SlowFirstAnswer, "second_turns", threading.Event())
    monkeypatch.setattr(SlowFirstAnswer, "waited", [])
    rollout = _play(kind, SlowFirstAnswer, 0.0, 1, 0)
    assert bool((rollout.episodes_BE[:, 0] >= 2).any())  # some episode played a second turn
    # the open loop: prompt 0's second turns came while prompt 1's answers waited; turn by turn, they could not
    assert SlowFirstAnswer.waited == [others_go_on] * PER_PROMPT
