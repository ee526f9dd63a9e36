"""Environments that ship with rlhfuse, named by `agent.env=<name>` (registered in `ENVIRONMENTS`)."""

from __future__ import annotations

import ast
import json
import operator
import re
import zlib
from collections.abc import Callable
from typing import Any, ClassVar

from rlhfuse.core.answers import numeric_match
from rlhfuse.data.guessing import HIGH, LOW

_WHOLE_NUMBER = re.compile(r"-?\d+")


class GuessingGame:
    """`agent.env=guess` (prompts: `data.source=guess`): the model guesses a whole number between `low` and `high`
    (1 and 100); the environment answers each guess with "Higher." or "Lower." until it is found or the turns run
    out.

    The secret is the row's `secret` field when it has one, otherwise drawn from the row itself (crc32 of its
    JSON: the same for a row on every rank and in every run). A guess is the last whole number in the model's
    message; a message without one is answered with what to do. Reward 1.0 on the turn that finds the number
    (the episode ends), 0.0 for every other turn: the episode's reward says whether it was found."""

    low: ClassVar[int] = LOW
    high: ClassVar[int] = HIGH

    def reset(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        secret = row.get("secret")
        if secret is None:
            drawn = zlib.crc32(json.dumps(row, sort_keys=True, default=str).encode())
            secret = self.low + drawn % (self.high - self.low + 1)
        self.secret = int(secret)
        return []

    def step(self, message: dict[str, Any]) -> tuple[list[dict[str, Any]], float, bool]:
        numbers = _WHOLE_NUMBER.findall(message["content"])
        if not numbers:
            hint = f"Answer with one whole number between {self.low} and {self.high}."
            return [{"role": "user", "content": hint}], 0.0, False
        guess = int(numbers[-1])
        if guess == self.secret:
            return [], 1.0, True
        return [{"role": "user", "content": "Higher." if guess < self.secret else "Lower."}], 0.0, False


_OPERATORS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}
_MAX_EXPRESSION = 200  # characters: a calculator, not a place to build huge numbers


def calc(expression: str) -> int | float:
    """Evaluate an arithmetic expression.

    Args:
        expression: numbers with + - * / and parentheses, e.g. "7 + 5"
    """
    if len(expression) > _MAX_EXPRESSION:
        raise ValueError(f"the expression is longer than {_MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"{expression!r} is not an arithmetic expression") from None
    value = _evaluate(tree.body)
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _evaluate(node: ast.AST) -> int | float:
    """An expression's value: numbers, unary +/- and the four operations, nothing else (no names, no calls)."""
    if (
        isinstance(node, ast.Constant)
        and isinstance(node.value, int | float)
        and not isinstance(node.value, bool)
    ):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.UAdd | ast.USub):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ZeroDivisionError("division by zero")
        return _OPERATORS[type(node.op)](left, right)  # type: ignore[no-any-return]
    raise ValueError(f"only numbers, + - * / and parentheses are allowed, not {ast.unparse(node)!r}")


class Calculator:
    """`agent.env=calculator`: an arithmetic problem (a row with an `answer`: `data=calculator` or
    `data=arithmetic`) and the tool `calc(expression)`. The model may call it before answering; the message
    without a tool call is its answer and ends the episode, rewarded 1.0 when its final answer (`answer : 12`,
    else its last number) is the row's `answer` (`numeric_match`), 0.0 otherwise."""

    tools: ClassVar[list[Callable[..., Any]]] = [calc]

    def reset(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        if "answer" not in row:
            raise ValueError(
                f"the row {sorted(row)} has no 'answer' field: the calculator checks the answer to it"
            )
        self.answer = row["answer"]
        return []

    def step(self, message: dict[str, Any]) -> tuple[list[dict[str, Any]], float, bool]:
        return [], numeric_match(message["content"], self.answer), True
