"""An embedded verifiable task: generated arithmetic problems with their answers (`data=arithmetic`).

A prompt reads `"7 + 5 ="`; its dataset row carries the answer (`{"answer": "12", ...}`), which a rule-based
reward (`inferencer.reward_fn=numeric_match` or `exact_match`) checks against the response's final answer
(`answer : 12`). Everything is generated from a seed over a small word-level vocabulary (numbers are words), so
the tiny model can learn it and nothing is downloaded:

- SFT responses always follow the format `answer : <n>` but are right only ~30% of the time (otherwise off by
  1-3), and one in eight omits the `answer :` marker, so RL has room on both accuracy and format;
- preference pairs rank a right answer over a wrong one (for the optional reward model of the warm start).

`CalculatorTask` (`data=calculator`) is the same problems with a calculator tool: its tokenizer has a chat template
and the words of a Hermes-style `<tool_call>` to `calc(expression)`, and a share of its SFT examples call the tool
and copy its result into the answer (the multi-turn `agent.env=calculator`, docs/agents.md).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any, ClassVar

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


# The calculator's chat template: the BOS, the user's text as is, each assistant message followed by the EOS and
# each tool message between <tool_response> tags; tool schemas are not shown (the tiny model learns the one tool
# from its warm start). Whitespace-split words, so the spaces only separate.
CALCULATOR_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message.role == 'assistant' %} {{ message.content }} {{ eos_token }}"
    "{% elif message.role == 'tool' %} <tool_response> {{ message.content }} </tool_response>"
    "{% else %}{{ message.content }}{% endif %}{% endfor %}"
)


@dataclass
class CalculatorTask(ArithmeticTask):
    """The arithmetic problems with a calculator tool (`data=calculator`): the tokenizer knows the tool call
    `<tool_call> {"name": "calc", "arguments": {"expression": "7 + 5"}} </tool_call>` word by word and has a
    chat template (`CALCULATOR_TEMPLATE`); `tool_rate` of the SFT examples call the tool with the problem and
    answer with its result, the others answer directly (right `correct_rate` of the time), so RL has a tool
    worth learning to call."""

    tool_rate: float = 0.25
    TOOL_WORDS: ClassVar[tuple[str, ...]] = (
        "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
        '{"name":', '"calc",', '"arguments":', '{"expression":',
    )  # fmt: skip

    def vocabulary(self) -> list[str]:
        """The arithmetic words, the tool-call words, and an operand with the quote that opens (`"7`) or the quote
        and braces that close (`5"}}`) the expression."""
        operands = range(self.max_operand + 1)
        return [
            *super().vocabulary(),
            *self.TOOL_WORDS,
            *(f'"{n}' for n in operands),
            *(f'{n}"}}}}' for n in operands),
        ]

    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_words(self.vocabulary(), chat_template=CALCULATOR_TEMPLATE)

    @staticmethod
    def tool_call(expression: str) -> str:
        """The assistant message that calls `calc(expression)`."""
        arguments = {"name": "calc", "arguments": {"expression": expression}}
        return f"<tool_call> {json.dumps(arguments)} </tool_call>"

    def sft_examples(self, count: int) -> list[tuple[str, str]]:
        """(prompt, response) as the chat template renders them (the prompt with the BOS): `tool_rate` of them
        call the tool and answer with its result (the EOS that ends the call inside the response), the others
        `ArithmeticTask`'s direct answers."""
        rng = random.Random(f"calculator-sft-{self.seed}")
        tokenizer = self.tokenizer()
        direct = super().sft_examples(count)
        out = []
        for i, (prompt, response) in enumerate(direct):
            if rng.random() < self.tool_rate:
                row = self.problem(i)[1]
                user = {"role": "user", "content": prompt}
                messages = [
                    user,
                    {"role": "assistant", "content": self.tool_call(f"{row['a']} {row['op']} {row['b']}")},
                    {"role": "tool", "content": row["answer"]},
                    {"role": "assistant", "content": f"answer : {row['answer']}"},
                ]
                head = tokenizer.render_chat([user], add_generation_prompt=True)
                whole = tokenizer.render_chat(messages, add_generation_prompt=False)
                eos = tokenizer.id_to_token(tokenizer.eos_id) or ""
                # the warm start encodes the prompt with the BOS and adds the final EOS itself
                response = whole[len(head) :].removesuffix(eos).strip()
                prompt = head.removeprefix(tokenizer.id_to_token(tokenizer.bos_id) or "")
            out.append((prompt, response))
        return out


ARITHMETIC_TASKS: dict[str, type[ArithmeticTask]] = {
    "arithmetic": ArithmeticTask,
    "calculator": CalculatorTask,
}
"""The embedded arithmetic tasks by `data.source`."""
