"""The registered reward functions (shipped configs only ever name entries of registries).

The `Registry` class lives in `rlhfuse.core.registry`.
"""

from __future__ import annotations

from rlhfuse.core.registry import Registry, RewardFn

REWARD_FUNCTIONS: Registry[RewardFn] = Registry("reward function", "inferencer.reward_fn")


@REWARD_FUNCTIONS.register("topic_fraction")
def topic_fraction_reward(prompts: list[str], responses: list[str]) -> list[float]:
    """The embedded task's hidden rule: fraction of response words on the prompt's topic."""
    from rlhfuse.data.synthetic import topic_fraction

    return [topic_fraction(p, r) for p, r in zip(prompts, responses, strict=True)]


@REWARD_FUNCTIONS.register("length_penalty")
def length_penalty_reward(prompts: list[str], responses: list[str]) -> list[float]:
    """-0.01 per response word: discourages rambling when added to a learned reward."""
    return [-0.01 * len(r.split()) for r in responses]
