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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

from rlhfuse.agents.environment import ENV_KEY, AgentEnvError, Environment
from rlhfuse.agents.tools import Message, ToolRunner, parse_tool_calls

Respond = Callable[[list[Message]], str]
"""The model: the conversation so far -> the assistant's next message text."""

EndReason = Literal["done", "max_turns"]
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
    environment said so) or "max_turns".
    """

    messages: list[Message]
    trainable: list[bool]
    rewards: list[float]
    turns: int
    tool_calls: int
    tool_errors: int
    ended: EndReason

    @property
    def total_reward(self) -> float:
        """The episode's reward: the sum of its turns' rewards."""
        return math.fsum(self.rewards)


def run_episode(
    env: Environment,
    row: Mapping[str, Any],
    prompt_messages: Sequence[Mapping[str, Any]],
    respond: Respond,
    *,
    max_turns: int,
    tools_runner: ToolRunner | None,
) -> Episode:
    """Play one episode of `env` on a dataset `row` whose prompt is `prompt_messages`, the model being `respond`.

    With `tools_runner` None, no text is read as a tool call. A tool call in the last allowed turn is not run
    (no turn is left to read its answer): the episode ends there, with reason "max_turns". A misbehaving
    environment (raising, or returning something else than the Protocol says) raises AgentEnvError; a tool never
    raises (ToolRunner answers every failure with an error message)."""
    if max_turns < 1:
        raise ValueError(f"agent.max_turns={max_turns} must be >= 1")
    where = f"{ENV_KEY} ({type(env).__qualname__})"
    messages: list[Message] = [dict(m) for m in prompt_messages]
    try:
        opening = env.reset(dict(row))
    except Exception as err:
        raise AgentEnvError(f"{where}: reset(row) raised {type(err).__name__}: {err}") from err
    messages += _env_messages(opening, get_args(OpeningRole), f"{where}: reset(row)")
    trainable = [False] * len(messages)
    rewards: list[float] = []
    tool_calls = tool_errors = 0
    for turn in range(max_turns):
        text = respond(list(messages))
        if not isinstance(text, str):
            raise TypeError(f"respond(messages) returned a {type(text).__name__}: it must return the text")
        message: Message = {"role": "assistant", "content": text}
        messages.append(message)
        trainable.append(True)
        if tools_runner is not None and _has_tool_call(text):
            if turn == max_turns - 1:
                rewards.append(0.0)
                break
            answer = tools_runner.run_turn(message)
            messages += answer.messages
            trainable += [False] * len(answer.messages)
            tool_calls += answer.calls
            tool_errors += answer.errors
            rewards.append(0.0)
            continue
        reply, reward, done = _step(env, message, where)
        messages += reply
        trainable += [False] * len(reply)
        rewards.append(reward)
        if done:
            return Episode(messages, trainable, rewards, turn + 1, tool_calls, tool_errors, "done")
    return Episode(messages, trainable, rewards, len(rewards), tool_calls, tool_errors, "max_turns")


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
