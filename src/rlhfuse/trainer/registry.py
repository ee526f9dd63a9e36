"""The registered reward functions (shipped configs only ever name entries of registries).

Each takes a batch of `rlhfuse.core.rewards.RewardSample` records and returns one score per sample. The answer
checks read the dataset row's `answer` field (`ANSWER_FIELD`). The `Registry` class lives in
`rlhfuse.core.registry`.
"""

from __future__ import annotations

from collections.abc import Sequence

from rlhfuse.core.registry import Registry
from rlhfuse.core.rewards import (
    RewardFn,
    RewardSample,
    RuleReward,
    exact_match,
    extract_answer,
    has_answer_format,
    numeric_match,
)

ANSWER_FIELD = "answer"

REWARD_FUNCTIONS: Registry[RewardFn] = Registry("reward function", "inferencer.reward_fn")


@REWARD_FUNCTIONS.register("topic_fraction")
def topic_fraction_reward(samples: Sequence[RewardSample]) -> list[float]:
    """The embedded task's hidden rule: fraction of response words on the prompt's topic."""
    from rlhfuse.data.synthetic import topic_fraction

    return [topic_fraction(s.prompt, s.response) for s in samples]


@REWARD_FUNCTIONS.register("length_penalty")
def length_penalty_reward(samples: Sequence[RewardSample]) -> list[float]:
    """-0.01 per response word: discourages rambling when added to a learned reward."""
    return [-0.01 * len(s.response.split()) for s in samples]


def _reference(sample: RewardSample) -> str:
    """The row's answer; a worked solution ending in `#### 42` (GSM8K) or `\\boxed{42}` gives its final answer."""
    answer = str(sample.fields[ANSWER_FIELD])
    return extract_answer(answer) or answer


@REWARD_FUNCTIONS.register("exact_match")
def exact_match_reward(samples: Sequence[RewardSample]) -> list[float]:
    """1 if the response's final answer (`\\boxed{}`, `####` or `answer:`) equals the row's `answer` as text."""
    return [exact_match(s.response, _reference(s)) for s in samples]


@REWARD_FUNCTIONS.register("numeric_match")
def numeric_match_reward(samples: Sequence[RewardSample]) -> list[float]:
    """1 if the number of the response's final answer (or its last number) equals the row's `answer`."""
    return [numeric_match(s.response, _reference(s)) for s in samples]


@REWARD_FUNCTIONS.register("answer_format")
def answer_format_reward(samples: Sequence[RewardSample]) -> list[float]:
    """1 if the response finished (not truncated) and states a final answer, whatever it is."""
    return [has_answer_format(s.response, s.finished) for s in samples]


# The dataset fields each registered function reads, checked against every row before the first iteration.
NEEDS_FIELDS: dict[str, tuple[str, ...]] = {
    "exact_match": (ANSWER_FIELD,),
    "numeric_match": (ANSWER_FIELD,),
}


def rule_reward(name: str, key: str = "inferencer.reward_fn") -> RuleReward:
    """The reward function `name` (registered, or 'package.module:function') ready to call, with its checks."""
    return RuleReward(name, REWARD_FUNCTIONS.get(name), key=key, needs=NEEDS_FIELDS.get(name, ()))
