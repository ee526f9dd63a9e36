"""An embedded verifiable task: generated arithmetic problems with their answers (`data=arithmetic`).

A prompt reads `"7 + 5 ="`; its dataset row carries the answer (`{"answer": "12", ...}`), which a rule-based
reward (`inferencer.reward_fn=numeric_match` or `exact_match`) checks against the response's final answer
(`answer : 12`). Everything is generated from a seed over a small word-level vocabulary (numbers are words), so
the tiny model can learn it and nothing is downloaded:

- SFT responses always follow the format `answer : <n>` but are right only ~30% of the time (otherwise off by
  1-3), and one in eight omits the `answer :` marker, so RL has room on both accuracy and format;
- preference pairs rank a right answer over a wrong one (for the optional reward model of the warm start).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from rlhfuse.data.tokenizer import Tokenizer

OPERATORS = ("+", "-")
ANSWER_WORDS = ("answer", ":", "so", "=")


@dataclass
class ArithmeticTask:
    """Deterministic generator of `a op b =` problems (0 <= a, b <= max_operand), SFT examples and pairs."""

    seed: int = 0
    max_operand: int = 9
    max_new_tokens: int = 8
    correct_rate: float = 0.3  # SFT answers that are right

    def vocabulary(self) -> list[str]:
        """Every word of the task: the numbers -max..2*max, the operators and the answer words."""
        numbers = [str(n) for n in range(-self.max_operand, 2 * self.max_operand + 1)]
        return [*numbers, *OPERATORS, *ANSWER_WORDS]

    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_words(self.vocabulary())

    def problem(self, index: int) -> tuple[str, dict[str, Any]]:
        """Prompt `index` and its dataset row (`answer` as text, plus the operands)."""
        rng = random.Random(f"arithmetic-{self.seed}-{index}")
        a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
        op = rng.choice(OPERATORS)
        answer = a + b if op == "+" else a - b
        return f"{a} {op} {b} =", {"answer": str(answer), "a": a, "b": b, "op": op}

    def prompts(self, count: int) -> list[str]:
        return [self.problem(i)[0] for i in range(count)]

    def rows(self, count: int) -> list[dict[str, Any]]:
        return [self.problem(i)[1] for i in range(count)]

    def _wrong(self, answer: int, rng: random.Random) -> int:
        low, high = -self.max_operand, 2 * self.max_operand
        candidates = [answer + d for d in (-3, -2, -1, 1, 2, 3) if low <= answer + d <= high]
        return rng.choice(candidates)

    def response(self, answer: int, *, correct: bool, marker: bool, rng: random.Random) -> str:
        value = answer if correct else self._wrong(answer, rng)
        return f"answer : {value}" if marker else f"so {value}"

    def sft_examples(self, count: int) -> list[tuple[str, str]]:
        """(prompt, response) pairs: the answer format, right about `correct_rate` of the time."""
        rng = random.Random(f"arithmetic-sft-{self.seed}")
        out = []
        for i in range(count):
            prompt, row = self.problem(i)
            correct = rng.random() < self.correct_rate
            out.append(
                (prompt, self.response(int(row["answer"]), correct=correct, marker=i % 8 != 7, rng=rng))
            )
        return out

    def preference_pairs(self, count: int) -> list[tuple[str, str, str]]:
        """(prompt, chosen, rejected): a right answer over a wrong one, either with or without the marker."""
        rng = random.Random(f"arithmetic-pairs-{self.seed}")
        out = []
        for i in range(count):
            prompt, row = self.problem(i)
            answer = int(row["answer"])
            chosen = self.response(answer, correct=True, marker=rng.random() < 0.8, rng=rng)
            rejected = self.response(answer, correct=False, marker=rng.random() < 0.8, rng=rng)
            out.append((prompt, chosen, rejected))
        return out
