"""The environment of a multi-turn episode: gymnasium's reset / step, in chat messages.

A user's environment is a class in their own file, named on the command line as `agent.env=my_env:Env` (resolved
by `rlhfuse.core.registry`, the current directory first) or passed as the class itself from Python. One object is
made per episode, by calling the class with no arguments. `load_environment` checks the class once, when the run
is set up, and names `agent.env` and the fix in one error.
"""

from __future__ import annotations

import inspect
from typing import Any, Protocol

from rlhfuse.agents.games import Calculator, GuessingGame
from rlhfuse.agents.tools import Tool, schema_problems, tool_problems
from rlhfuse.core.registry import Registry

ENV_KEY = "agent.env"


class Environment(Protocol):
    """One episode's environment (made per episode by calling its class with no arguments).

    `reset(row)`: the messages (`{"role": "system" | "user" | "tool", "content": str}`) that follow the dataset
    row's prompt when the episode starts; [] for none. `step(message)`: the model's assistant message in; out
    the environment's reply (messages with role "user" or "tool"), this turn's reward (a finite float) and
    whether the episode is done. An optional attribute `tools` lists plain Python functions offered to the model
    (type hints on every parameter, a docstring describing each: their JSON schemas come from them).
    """

    def reset(self, row: dict[str, Any]) -> list[dict[str, Any]]: ...

    def step(self, message: dict[str, Any]) -> tuple[list[dict[str, Any]], float, bool]: ...


class AgentEnvError(ValueError):
    """An environment class that cannot be used, or an environment object that broke its contract during an
    episode; the message names `agent.env` and the fix."""


# Named environments (`rlhfuse.agents.games`); `agent.env` also takes 'package.module:Class'.
ENVIRONMENTS: Registry[type] = Registry(
    "environment", ENV_KEY, {"guess": GuessingGame, "calculator": Calculator}
)


def describe(choice: str | type) -> str:
    """How `agent.env` chose an environment, for messages: `agent.env='my_env:Env'`, or the class's name."""
    return f"{ENV_KEY}={choice!r}" if isinstance(choice, str) else f"{ENV_KEY}={choice.__qualname__}"


def environment_problems(obj: object, where: str) -> list[str]:
    """What keeps `obj` from being an environment class, one line per problem (`where` names the choice)."""
    if not isinstance(obj, type):
        return [
            f"{where} is a {type(obj).__name__}, not a class: name a class whose objects have reset(row) and "
            "step(message) (one object is made per episode)"
        ]
    problems = []
    for method, signature, what in (
        ("reset", "reset(self, row: dict) -> list[dict]", "the messages that open an episode"),
        ("step", "step(self, message: dict) -> tuple[list[dict], float, bool]", "reply, reward, done"),
    ):
        if not callable(getattr(obj, method, None)):
            problems.append(f"{where} has no {method} method: add `def {signature}` ({what})")
    try:
        inspect.signature(obj).bind()
    except TypeError:
        problems.append(
            f"{where} cannot be made with no arguments (one object is made per episode by calling the class): "
            "give every __init__ parameter a default"
        )
    except ValueError:  # no readable signature (a class implemented in C): making one will tell
        pass
    tools = inspect.getattr_static(obj, "tools", None)
    if tools is not None and not isinstance(tools, property):  # tools made per object are checked per episode
        problems += _tools_problems(tools, f"{where} tools")
    return problems


def load_environment(choice: str | type) -> type:
    """The environment class `agent.env` names ('package.module:Class', a registered name, or the class itself),
    checked: AgentEnvError names `agent.env` and the fix."""
    where = describe(choice)
    if isinstance(choice, str):
        if choice not in ENVIRONMENTS:
            raise AgentEnvError(
                f"{where} is not a registered environment {ENVIRONMENTS.names()} nor 'module:Class': name the "
                "file and the class, e.g. agent.env=my_env:Env for class Env in ./my_env.py"
            )
        try:
            obj: object = ENVIRONMENTS.get(choice)
        except KeyError as err:
            raise AgentEnvError(str(err.args[0])) from None
    else:
        obj = choice
    if problems := environment_problems(obj, where):
        raise AgentEnvError("; ".join(problems))
    assert isinstance(obj, type)
    return obj


def environment_tools(env: object, where: str = ENV_KEY) -> list[Tool]:
    """The tools an environment object offers (its optional `tools` attribute; [] without one), checked."""
    tools = getattr(env, "tools", None)
    if tools is None:
        return []
    if problems := _tools_problems(tools, f"{where} tools"):
        raise AgentEnvError("; ".join(problems))
    return list(tools)


def _tools_problems(tools: object, key: str) -> list[str]:
    """An environment's tools checked, their JSON schemas included (the model is shown them)."""
    problems = tool_problems(tools, key)
    if problems:
        return problems
    assert isinstance(tools, list | tuple)
    return schema_problems(tools, key)
