"""An embedded multi-turn task: games of guessing a whole number (`data.source=guess`, for `agent.env=guess`).

Every prompt asks the same question (the model cannot know the number: it learns to search); its row carries the
number (`{"secret": 42}`), drawn from the seed and the prompt's index, which the guessing game
(`rlhfuse.agents.GuessingGame`) answers "Higher." or "Lower." against. There is no warm start: the task is played
by a chat model (`experiment=guess_smollm2`), its prompts rendered with the model's chat template.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

LOW, HIGH = 1, 100
"""The range of the numbers, both ends included (the guessing game's too)."""

# Phrased for a small instruct model: of the phrasings tried, this one got SmolLM2-135M-Instruct to start its reply
# with a number most often (others drew apologies and essays); a guess is the last whole number of a reply.
QUESTION = (
    f"Guess my number. It is a whole number between {LOW} and {HIGH}. Your answer must be only the number, for "
    "example: 37"
)


@dataclass
class GuessingTask:
    """Deterministic games: prompt `index` is `QUESTION`, its row the number to find."""

    seed: int = 0

    def problem(self, index: int) -> tuple[str, dict[str, Any]]:
        secret = random.Random(f"guess-{self.seed}-{index}").randint(LOW, HIGH)
        return QUESTION, {"secret": secret}

    def prompts(self, count: int) -> list[str]:
        return [self.problem(i)[0] for i in range(count)]

    def rows(self, count: int) -> list[dict[str, Any]]:
        return [self.problem(i)[1] for i in range(count)]
