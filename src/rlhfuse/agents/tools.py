"""Tools offered to the model: plain Python functions, their JSON schemas, the tool calls parsed from the model's
output (the Hermes / Qwen format) and `ToolRunner`, which runs one message's calls concurrently and answers each
with a tool message. Nothing a model writes or a tool does raises: every failure becomes an error message the
model reads on its next turn.

The call format, one block per call, several per message allowed::

    <tool_call>
    {"name": "add", "arguments": {"a": 1, "b": 2}}
    </tool_call>

Threads: each call runs in a fresh daemon thread, and a daemon collector thread per message waits for them up to
`timeout_s`. Python cannot kill a thread, so a call that times out is *abandoned*: its thread runs on (counted by
`ToolRunner.stuck_calls`) and its result, if it ever comes, is dropped. A shared pool
(`concurrent.futures.ThreadPoolExecutor`) would let a few stuck calls starve every later one, and its threads are
joined at interpreter exit, so one tool that never returns would hang the process; fresh daemon threads cost a
thread start per call (tens of microseconds, nothing beside a model turn) and neither block.
"""

from __future__ import annotations

import inspect
import json
import math
import re
import threading
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any, Literal, Union

from rlhfuse._optional import require

Message = dict[str, Any]
Tool = Callable[..., Any]

_CALL_BLOCK = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """A well-formed call: the tool's `name`, its `arguments` (a JSON object), and its `index` among the message's
    `<tool_call>` blocks (0-based; answers keep this order)."""

    name: str
    arguments: dict[str, Any]
    index: int


@dataclass(frozen=True)
class ToolCallError:
    """A `<tool_call>` block that could not be read: its `index`, the tool's `name` where one was given (else ""),
    and `reason`, written for the model to read."""

    index: int
    name: str
    reason: str


def parse_tool_calls(text: str) -> tuple[list[ToolCall], list[ToolCallError]]:
    """The tool calls of an assistant message in the Hermes / Qwen format, and the blocks that are malformed (not
    JSON, not an object, no string `name`, `arguments` not an object, no closing tag). A missing `arguments` is
    an empty one. Text outside the blocks is ignored; a message without blocks gives ([], [])."""
    calls: list[ToolCall] = []
    errors: list[ToolCallError] = []
    for index, match in enumerate(_CALL_BLOCK.finditer(text)):
        body, closing = match.group(1).strip(), match.group(2)
        try:
            value = json.loads(body)
        except json.JSONDecodeError as err:
            shown = body if len(body) <= 80 else body[:77] + "..."
            errors.append(
                ToolCallError(index, "", f"tool call {index} is not valid JSON ({err.msg}): {shown!r}")
            )
            continue
        name = value.get("name") if isinstance(value, dict) else None
        arguments = value.get("arguments", {}) if isinstance(value, dict) else None
        if not closing:
            reason = f"tool call {index} has no closing </tool_call>"
        elif not isinstance(value, dict):
            reason = f"tool call {index} is a JSON {type(value).__name__}, not an object"
        elif not isinstance(name, str) or not name:
            reason = f"tool call {index} has no tool name (a string under the key 'name')"
        elif not isinstance(arguments, dict):
            reason = (
                f"the arguments of tool call {index} ({name}) are a {type(arguments).__name__}, not an object"
            )
        else:
            calls.append(ToolCall(name, arguments, index))
            continue
        errors.append(ToolCallError(index, name if isinstance(name, str) else "", reason))
    return calls, errors


# ------------------------------------------------------------------------------------------ schemas and checks
def tool_schema(tool: Tool) -> dict[str, Any]:
    """The tool's JSON schema, as chat templates take it (`apply_chat_template(tools=[...])`), made by
    `transformers.utils.get_json_schema` from the function's type hints and Google-style docstring."""
    return dict(require("transformers.utils").get_json_schema(tool))


def tool_schemas(tools: Sequence[Tool]) -> list[dict[str, Any]]:
    """The JSON schema of each tool, in order."""
    return [tool_schema(tool) for tool in tools]


def tool_problems(tools: object, key: str) -> list[str]:
    """What is wrong with `tools` as a list of tools (each a plain function with a type hint on every parameter
    and a docstring; names unique), one line per problem naming `key` and the fix. Needs no transformers (the
    runner does not either); `schema_problems` checks what the schemas need beyond this."""
    if not isinstance(tools, list | tuple):
        return [f"{key} is a {type(tools).__name__}: make it a list of plain Python functions"]
    problems = []
    for k, tool in enumerate(tools):
        where = f"{key}[{k}] ({getattr(tool, '__qualname__', repr(tool))})"
        if isinstance(tool, type) or not callable(tool) or not hasattr(tool, "__name__"):
            problems.append(f"{where} is not a function: give a plain Python function")
            continue
        try:
            parameters = inspect.signature(tool).parameters.values()
        except (TypeError, ValueError):
            problems.append(f"{where} has no readable signature: wrap it in a plain Python function")
            continue
        if inspect.iscoroutinefunction(tool):
            problems.append(f"{where} is an async function: tools run in threads; make it a plain function")
        if not inspect.getdoc(tool):
            problems.append(
                f"{where} has no docstring: add one saying what it does, with an 'Args:' line per parameter "
                "(the model reads it in the tool's schema)"
            )
        unhinted = [
            p.name
            for p in parameters
            if p.annotation is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
        if unhinted:
            problems.append(f"{where} has no type hint on {unhinted}: annotate every parameter (e.g. x: int)")
    names = [getattr(tool, "__name__", "") for tool in tools]
    if odd := [n for n in names if n and not n.isidentifier()]:
        problems.append(
            f"{key} holds tools named {odd}: the model calls a tool by name; use a def, not a lambda"
        )
    if dupes := sorted({n for n in names if names.count(n) > 1}):
        problems.append(f"{key} names {dupes} more than once: give each tool its own function name")
    return problems


def schema_problems(tools: Sequence[Tool], key: str) -> list[str]:
    """The tools whose JSON schema cannot be made (e.g. a parameter the docstring's 'Args:' does not describe),
    one line each; ImportError without transformers. For tools that passed `tool_problems`."""
    problems = []
    for k, tool in enumerate(tools):
        try:
            tool_schema(tool)
        except ImportError:
            raise
        except Exception as err:  # transformers' DocstringParsingException / TypeHintParsingException
            problems.append(f"{key}[{k}] ({tool.__qualname__}) has no JSON schema: {err}")
    return problems


# ------------------------------------------------------------------------------------------ arguments
def _conforms(value: Any, hint: Any) -> bool:
    """Whether a JSON value fits a parameter's type hint. Hints beyond JSON's types (a dataclass, a Callable)
    are left for the tool to judge."""
    if hint is Any:
        return True
    if hint is type(None) or hint is None:
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:  # JSON has one number type: 3 is a fine float
        return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if hint is str:
        return isinstance(value, str)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return value in args
    if origin is Union or origin is types.UnionType:
        return any(_conforms(value, arg) for arg in args)
    if hint is list or origin is list or origin is Sequence:
        return isinstance(value, list) and (not args or all(_conforms(v, args[0]) for v in value))
    if hint is tuple or origin is tuple:
        if not isinstance(value, list):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_conforms(v, args[0]) for v in value)
        return not args or (len(value) == len(args) and all(map(_conforms, value, args)))
    if hint is dict or origin is dict or origin is Mapping:
        return isinstance(value, dict) and (not args or all(_conforms(v, args[1]) for v in value.values()))
    return True


def _type_name(hint: Any) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")


def _argument_problem(tool: Tool, arguments: dict[str, Any]) -> str | None:
    """Why `tool(**arguments)` would be a bad call (missing, unexpected or wrong-typed arguments), or None."""
    try:
        bound = inspect.signature(tool).bind(**arguments)
    except TypeError as err:
        return str(err)
    try:
        hints = typing.get_type_hints(tool)
    except Exception:  # an unresolvable forward reference: the tool judges its arguments itself
        hints = {}
    for name, value in bound.arguments.items():
        if name in hints and not _conforms(value, hints[name]):
            shown = json.dumps(value)
            shown = shown if len(shown) <= 40 else shown[:37] + "..."
            return f"argument {name!r} must be {_type_name(hints[name])}, got {type(value).__name__} {shown}"
    return None


def _content(result: Any) -> str:
    """A tool's return value as the text of its message: a string as is, anything else as JSON (else str())."""
    if isinstance(result, str):
        return result
    try:
        return json.dumps(result, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(result)


# ------------------------------------------------------------------------------------------ the runner
@dataclass(frozen=True)
class ToolTurn:
    """The tool messages answering one assistant message (one per `<tool_call>` block, in the message's order:
    `{"role": "tool", "name": ..., "content": ...}`, `name` "" where a block named no tool), with the number of
    blocks (`calls`) and of those answered with an error (`errors`: malformed, unknown tool, bad arguments,
    raised, timed out)."""

    messages: list[Message]
    calls: int
    errors: int


@dataclass(frozen=True)
class _Answer:
    index: int
    name: str
    content: str
    ok: bool


class ToolRunner:
    """Runs the tool calls of an assistant message, concurrently, each answered within `timeout_s`.

    `submit(message)` returns at once a Future of the tool messages (so that a caller can release its generation
    slot while tools run); `run(message)` waits for them. `submit_turn` / `run_turn` give the same messages with
    their counts (`ToolTurn`). A message without `<tool_call>` gives [] at once. One runner may serve many
    episodes at once. See the module's docstring for the threads and what happens to a call that times out.
    """

    def __init__(self, tools: Sequence[Tool], timeout_s: float = 10.0, *, key: str = "tools") -> None:
        tools = list(tools)
        if problems := tool_problems(tools, key):
            raise ValueError("; ".join(problems))
        if not (timeout_s > 0 and math.isfinite(timeout_s)):
            raise ValueError(f"agent.tool_timeout_s={timeout_s} must be a finite number of seconds > 0")
        self.tools: dict[str, Tool] = {tool.__name__: tool for tool in tools}
        self.timeout_s = timeout_s
        self._abandoned: list[threading.Thread] = []
        self._lock = threading.Lock()

    def schemas(self) -> list[dict[str, Any]]:
        """The tools' JSON schemas, for the chat template."""
        return tool_schemas(list(self.tools.values()))

    @property
    def stuck_calls(self) -> int:
        """Calls that timed out and whose threads still run (abandoned: Python cannot stop a thread)."""
        with self._lock:
            self._abandoned = [t for t in self._abandoned if t.is_alive()]
            return len(self._abandoned)

    def submit_turn(self, message: Mapping[str, Any]) -> Future[ToolTurn]:
        """Start the calls of `message` (an assistant message); the Future holds their answers."""
        calls, errors = parse_tool_calls(str(message.get("content") or ""))
        answers = [_Answer(e.index, e.name, f"error: {e.reason}", False) for e in errors]
        running: list[tuple[ToolCall, Future[_Answer], threading.Thread]] = []
        for call in calls:
            tool = self.tools.get(call.name)
            if tool is None:
                known = sorted(self.tools) or "none"
                answers.append(
                    _Answer(
                        call.index, call.name, f"error: unknown tool {call.name!r} (tools: {known})", False
                    )
                )
            elif (problem := _argument_problem(tool, call.arguments)) is not None:
                answers.append(
                    _Answer(call.index, call.name, f"error: bad arguments for {call.name}: {problem}", False)
                )
            else:
                future: Future[_Answer] = Future()
                thread = threading.Thread(
                    target=_call, args=(tool, call, future), name=f"tool-{call.name}", daemon=True
                )
                thread.start()
                running.append((call, future, thread))
        turn: Future[ToolTurn] = Future()
        if not running:
            turn.set_result(_turn(answers))
            return turn
        threading.Thread(
            target=self._collect, args=(running, answers, turn), name="tool-collector", daemon=True
        ).start()
        return turn

    def _collect(
        self,
        running: list[tuple[ToolCall, Future[_Answer], threading.Thread]],
        answers: list[_Answer],
        turn: Future[ToolTurn],
    ) -> None:
        try:
            wait([future for _, future, _ in running], timeout=self.timeout_s)
            for call, future, thread in running:
                if future.done():
                    answers.append(future.result())
                else:
                    with self._lock:
                        self._abandoned.append(thread)
                    content = f"error: {call.name} did not finish within {self.timeout_s:g} s"
                    answers.append(_Answer(call.index, call.name, content, False))
            turn.set_result(_turn(answers))
        except BaseException as err:  # a bug here must reach the caller, not die with the thread
            turn.set_exception(err)

    def submit(self, message: Mapping[str, Any]) -> Future[list[Message]]:
        """Start the calls of `message`; the Future holds the tool messages, in the calls' order."""
        messages: Future[list[Message]] = Future()

        def forward(turn: Future[ToolTurn]) -> None:
            if (err := turn.exception()) is not None:
                messages.set_exception(err)
            else:
                messages.set_result(turn.result().messages)

        self.submit_turn(message).add_done_callback(forward)
        return messages

    def run_turn(self, message: Mapping[str, Any]) -> ToolTurn:
        """The calls of `message` run, waited for (at most about `timeout_s`)."""
        return self.submit_turn(message).result()

    def run(self, message: Mapping[str, Any]) -> list[Message]:
        """The tool messages answering `message`, waited for (at most about `timeout_s`)."""
        return self.run_turn(message).messages


def _call(tool: Tool, call: ToolCall, future: Future[_Answer]) -> None:
    try:
        answer = _Answer(call.index, call.name, _content(tool(**call.arguments)), True)
    except BaseException as err:  # a tool's SystemExit too: it ends this thread, never the run
        answer = _Answer(
            call.index, call.name, f"error: {call.name} raised {type(err).__name__}: {err}", False
        )
    future.set_result(answer)


def _turn(answers: list[_Answer]) -> ToolTurn:
    answers = sorted(answers, key=lambda a: a.index)
    messages = [{"role": "tool", "name": a.name, "content": a.content} for a in answers]
    return ToolTurn(messages, calls=len(answers), errors=sum(not a.ok for a in answers))
