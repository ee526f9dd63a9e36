"""Environments that ship with rlhfuse, named by `agent.env=<name>` (registered in `ENVIRONMENTS`)."""

from __future__ import annotations

import json
import re
import zlib
from typing import Any, ClassVar

_WHOLE_NUMBER = re.compile(r"-?\d+")


class GuessingGame:
    """`agent.env=guess`: the model guesses a whole number between `low` and `high` (1 and 100); the environment
    answers each guess with "Higher." or "Lower." until it is found or the turns run out.

    The secret is the row's `secret` field when it has one, otherwise drawn from the row itself (crc32 of its
    JSON: the same for a row on every rank and in every run). A guess is the last whole number in the model's
    message; a message without one is answered with what to do. Reward 1.0 on the turn that finds the number
    (the episode ends), 0.0 for every other turn: the episode's reward says whether it was found."""

    low: ClassVar[int] = 1
    high: ClassVar[int] = 100

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
