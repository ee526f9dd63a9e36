"""One multi-turn episode as a pure loop: the model is a function `respond(messages) -> str` handed in (the
generator's, later; a scripted one in tests), the environment and the tools are called in turn, and the result
is an `Episode`: every message, which of them the model wrote (the only ones trained on), the rewards.

Per assistant turn: the model's text becomes an assistant message; if it holds `<tool_call>` blocks (and tools
are offered) the tools answer it (a tool turn, reward 0); otherwise `env.step` answers it with messages, this
turn's reward and whether the episode is done. The episode ends when the environment says done, or after
`max_turns` assistant turns.
"""

from __future__ import annotations

import math
import numbers
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from rlhfuse.agents.environment import ENV_KEY, AgentEnvError, Environment
from rlhfuse.agents.tools import Message, ToolRunner, parse_tool_calls

Respond = Callable[[list[Message]], str]
"""The model: the conversation so far -> the assistant's next message text."""

EndReason = Literal["done", "max_turns", "length", "context"]
"""Why an episode ended: the environment said done, the turn limit, or a message cut at the token limit."""
OpeningRole = Literal["system", "user", "tool"]
"""Who may speak in the messages `env.reset` opens an episode with."""
ReplyRole = Literal["user", "tool"]
"""Who may speak in the messages `env.step` answers with."""


@dataclass(frozen=True)
class Episode:
    """One finished episode.

    messages: the whole conversation (the prompt's messages, the environment's opening, then each assistant
    message with its answer); trainable[i]: whether messages[i] was written by the model (assistant messages
    only: prompt, environment and tool messages carry no loss and no KL); rewards[t]: assistant turn t's reward
    (the environment's for an answered turn, 0.0 for a tool turn), so len(rewards) == turns; tool_calls /
    tool_errors: `<tool_call>` blocks answered, and those answered with an error; ended: "done" (the
    environment said so), "max_turns", "length" (the last message cut at the generator's token limit) or
    "context" (the next turn could have passed the trajectory's token bound, `EpisodeRun.truncate`).
    """

    messages: list[Message]
    trainable: list[bool]
    rewards: list[float]
    turns: int
    tool_calls: int
    tool_errors: int
    ended: EndReason
    tool_seconds: float = field(default=0.0, compare=False)
    """Seconds its tool calls ran (each assistant message's calls run together: the time until all answered)."""

    @property
    def total_reward(self) -> float:
        """The episode's reward: the sum of its turns' rewards."""
        return math.fsum(self.rewards)


class EpisodeRun:
    """One episode played turn by turn, for a caller that generates the model's turns itself (a batch of episodes
    at once: `rlhfuse.agents.generator.AgentGenerator`): made with the environment's opening (`env.reset(row)`,
    in `messages`), then `answer(text)` per assistant turn returns the messages that answer it, or None once the
    episode has ended; `episode()` the result. `run_episode` is this loop with a `respond` function."""

    def __init__(
        self,
        env: Environment,
        row: Mapping[str, Any],
        prompt_messages: Sequence[Mapping[str, Any]],
        *,
        max_turns: int,
        tools_runner: ToolRunner | None,
    ) -> None:
        if max_turns < 1:
            raise ValueError(f"agent.max_turns={max_turns} must be >= 1")
        self.env, self.max_turns, self.tools_runner = env, max_turns, tools_runner
        self.where = f"{ENV_KEY} ({type(env).__qualname__})"
        self.messages: list[Message] = [dict(m) for m in prompt_messages]
        try:
            opening = env.reset(dict(row))
        except Exception as err:
            raise AgentEnvError(f"{self.where}: reset(row) raised {type(err).__name__}: {err}") from err
        self.messages += _env_messages(opening, get_args(OpeningRole), f"{self.where}: reset(row)")
        self.trainable = [False] * len(self.messages)
        self.rewards: list[float] = []
        self.tool_calls = self.tool_errors = 0
        self.tool_seconds = 0.0
        self.ended: EndReason | None = None

    def answer(self, text: str) -> list[Message] | None:
        """Take the model's next message `text`; return the messages answering it (the tools', or the
        environment's reply), or None when the episode ends with it (the environment said done, or the turn
        limit: a tool call in the last allowed turn is not run, no turn being left to read its answer)."""
        if self.ended is not None:
            raise ValueError(f"{self.where}: the episode already ended ({self.ended})")
        if not isinstance(text, str):
            raise TypeError(f"the model's message is a {type(text).__name__}: it must be the text")
        message: Message = {"role": "assistant", "content": text}
        self.messages.append(message)
        self.trainable.append(True)
        last = len(self.rewards) == self.max_turns - 1
        if self.tools_runner is not None and _has_tool_call(text):
            self.rewards.append(0.0)
            if last:
                self.ended = "max_turns"
                return None
            start = time.perf_counter()
            turn = self.tools_runner.run_turn(message)
            self.tool_seconds += time.perf_counter() - start
            self.tool_calls += turn.calls
            self.tool_errors += turn.errors
            return self._add(turn.messages)
        reply, reward, done = _step(self.env, message, self.where)
        self.rewards.append(reward)
        if done or last:
            self.messages += reply
            self.trainable += [False] * len(reply)
            self.ended = "done" if done else "max_turns"
            return None
        return self._add(reply)

    def cut(self, text: str) -> None:
        """End the episode at a message `text` the model did not finish (cut at the generator's token limit): it
        is kept as the model wrote it, with no reward and no answer."""
        self.messages.append({"role": "assistant", "content": text})
        self.trainable.append(True)
        self.rewards.append(0.0)
        self.ended = "length"

    def truncate(self) -> None:
        """End the episode before its next turn: the conversation would pass the trajectory's token bound
        (`agent.max_response_tokens`). The last answer is kept in `messages` (the environment gave it) but the
        model never reads it."""
        self.ended = "context"

    def _add(self, reply: list[Message]) -> list[Message]:
        self.messages += reply
        self.trainable += [False] * len(reply)
        return reply

    def episode(self) -> Episode:
        assert self.ended is not None, "the episode has not ended"
        return Episode(
            self.messages, self.trainable, self.rewards, len(self.rewards), self.tool_calls, self.tool_errors,
            self.ended, self.tool_seconds,
        )  # fmt: skip


def run_episode(
    env: Environment,
    row: Mapping[str, Any],
    prompt_messages: Sequence[Mapping[str, Any]],
    respond: Respond,
    *,
    max_turns: int,
    tools_runner: ToolRunner | None,
) -> Episode:
    """Play one episode of `env` on a dataset `row` whose prompt is `prompt_messages`, the model being `respond`
    (`EpisodeRun`'s loop).

    With `tools_runner` None, no text is read as a tool call. A tool call in the last allowed turn is not run
    (no turn is left to read its answer): the episode ends there, with reason "max_turns". A misbehaving
    environment (raising, or returning something else than the Protocol says) raises AgentEnvError; a tool never
    raises (ToolRunner answers every failure with an error message)."""
    run = EpisodeRun(env, row, prompt_messages, max_turns=max_turns, tools_runner=tools_runner)
    while run.answer(respond(list(run.messages))) is not None:
        pass
    return run.episode()


def _has_tool_call(text: str) -> bool:
    calls, errors = parse_tool_calls(text)
    return bool(calls or errors)


def _step(env: Environment, message: Message, where: str) -> tuple[list[Message], float, bool]:
    """`env.step(message)`, its answer checked."""
    try:
        out = env.step(dict(message))
    except Exception as err:
        raise AgentEnvError(f"{where}: step(message) raised {type(err).__name__}: {err}") from err
    if not (isinstance(out, tuple) and len(out) == 3):
        raise AgentEnvError(
            f"{where}: step(message) returned {type(out).__name__} {out!r:.80}: return (messages, reward, done)"
        )
    reply, reward, done = out
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(reward):
        raise AgentEnvError(f"{where}: step(message) returned the reward {reward!r}: return a finite float")
    if done not in (True, False):
        raise AgentEnvError(f"{where}: step(message) returned done={done!r}: return True or False")
    return _env_messages(reply, get_args(ReplyRole), f"{where}: step(message)"), float(reward), bool(done)


def _env_messages(value: object, roles: tuple[str, ...], what: str) -> list[Message]:
    """The environment's messages, checked: a list of {"role": one of `roles`, "content": str}."""
    if not isinstance(value, list):
        raise AgentEnvError(
            f"{what} returned a {type(value).__name__}: return a list of messages ([] for none)"
        )
    for k, m in enumerate(value):
        if not (isinstance(m, Mapping) and m.get("role") in roles and isinstance(m.get("content"), str)):
            raise AgentEnvError(
                f"{what} returned {m!r:.80} as message {k}: give {{'role': one of {list(roles)}, 'content': str}}"
            )
    return [dict(m) for m in value]
