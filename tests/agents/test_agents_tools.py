"""Tool calls in the Hermes / Qwen format and the ToolRunner: every failure (malformed call, unknown tool, bad
arguments, a tool that raises or outlives its timeout) is a tool message, never an exception; calls run at once;
`submit` returns before the tools finish."""

import subprocess
import sys
import textwrap
import threading
import time
from typing import Literal

import pytest

from rlhfuse.agents import ToolRunner, parse_tool_calls, tool_problems


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def scale(x: float, unit: Literal["m", "km"] = "m", tags: list[str] | None = None) -> dict:
    """Scale a length.

    Args:
        x: the length
        unit: its unit
        tags: labels
    """
    return {"value": x * (1000 if unit == "km" else 1), "tags": tags or []}


def fail(reason: str) -> str:
    """Always fails.

    Args:
        reason: why
    """
    raise RuntimeError(reason)


def call(name, arguments):
    import json

    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def assistant(*blocks, text="Let me check."):
    return {"role": "assistant", "content": text + "\n" + "\n".join(blocks)}


def test_parse_well_formed_and_malformed_calls():
    text = (
        "thinking...\n"
        + call("add", {"a": 1, "b": 2})
        + '\n<tool_call>\n{"name": "add", "arguments": {"a": 1,}\n</tool_call>'  # bad JSON
        + '\n<tool_call>{"arguments": {}}</tool_call>'  # no name
        + '\n<tool_call>{"name": "add", "arguments": "a=1"}</tool_call>'  # arguments not an object
        + '\n<tool_call>["add"]</tool_call>'  # not an object
        + '\n<tool_call>{"name": "now"}</tool_call>'  # no arguments: an empty object
        + '\n<tool_call>{"name": "add", "arguments": {}}'  # never closed
    )
    calls, errors = parse_tool_calls(text)
    assert [(c.index, c.name, c.arguments) for c in calls] == [(0, "add", {"a": 1, "b": 2}), (5, "now", {})]
    assert [(e.index, e.name) for e in errors] == [(1, ""), (2, ""), (3, "add"), (4, ""), (6, "add")]
    reasons = [e.reason for e in errors]
    assert "not valid JSON" in reasons[0] and "no tool name" in reasons[1]
    assert "not an object" in reasons[2] and "list, not an object" in reasons[3]
    assert "no closing" in reasons[4]
    assert parse_tool_calls("no calls here") == ([], [])


def test_results_and_every_error_become_tool_messages_in_call_order():
    runner = ToolRunner([add, scale, fail], timeout_s=10)
    message = assistant(
        call("add", {"a": 2, "b": 3}),
        call("scale", {"x": 2, "unit": "km", "tags": ["a"]}),  # an int is a fine float
        call("fail", {"reason": "boom"}),
        call("search", {"q": "x"}),
        call("add", {"a": 1}),
        call("add", {"a": 1, "b": 2, "c": 3}),
        call("add", {"a": "1", "b": 2}),
        call("add", {"a": True, "b": 2}),
        call("scale", {"x": 1, "unit": "mile"}),
        call("scale", {"x": 1, "tags": ["a", 2]}),
        "<tool_call>{oops}</tool_call>",
    )
    turn = runner.run_turn(message)
    assert [m["role"] for m in turn.messages] == ["tool"] * 11
    names = [m["name"] for m in turn.messages]
    assert names == ["add", "scale", "fail", "search", *["add"] * 4, "scale", "scale", ""]
    content = [m["content"] for m in turn.messages]
    assert content[0] == "5" and content[1] == '{"value": 2000, "tags": ["a"]}'
    assert content[2] == "error: fail raised RuntimeError: boom"
    assert content[3] == "error: unknown tool 'search' (tools: ['add', 'fail', 'scale'])"
    assert "missing a required argument: 'b'" in content[4]
    assert "unexpected keyword argument 'c'" in content[5]
    assert "argument 'a' must be int, got str" in content[6]
    assert "argument 'a' must be int, got bool" in content[7]
    assert "argument 'unit' must be" in content[8] and "argument 'tags' must be" in content[9]
    assert content[10].startswith("error: tool call 10 is not valid JSON")
    assert all(c.startswith("error: ") for c in content[2:])
    assert (turn.calls, turn.errors) == (11, 9)
    assert runner.run(message) == turn.messages  # the blocking form of the same


def test_a_message_without_calls_gives_no_messages():
    runner = ToolRunner([add])
    future = runner.submit({"role": "assistant", "content": "The answer is 4."})
    assert future.done() and future.result() == []


def test_a_tool_past_its_timeout_is_answered_with_an_error_and_abandoned():
    release = threading.Event()

    def stuck(x: int) -> int:
        """Waits until released.

        Args:
            x: anything
        """
        release.wait()
        return x

    runner = ToolRunner([stuck, add], timeout_s=0.2)
    try:
        start = time.monotonic()
        messages = runner.run(assistant(call("stuck", {"x": 1}), call("add", {"a": 1, "b": 1})))
        assert time.monotonic() - start < 5  # the timeout, not the tool, ended the turn
        assert messages[0]["content"] == "error: stuck did not finish within 0.2 s"
        assert messages[1]["content"] == "2"  # the other call is answered
        assert runner.stuck_calls == 1
        # the abandoned thread takes nothing from the next calls
        assert runner.run(assistant(call("add", {"a": 2, "b": 2})))[0]["content"] == "4"
    finally:
        release.set()


def test_a_stuck_tool_does_not_keep_the_process_from_exiting():
    code = textwrap.dedent('''
        import threading
        from rlhfuse.agents.tools import ToolRunner

        def hang() -> str:
            """Never returns."""
            threading.Event().wait()

        message = {"role": "assistant", "content": '<tool_call>{"name": "hang", "arguments": {}}</tool_call>'}
        print(ToolRunner([hang], timeout_s=0.1).run(message)[0]["content"])
    ''')
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "error: hang did not finish within 0.1 s"


def test_calls_of_one_message_run_concurrently():
    barrier = threading.Barrier(2)

    def left() -> str:
        """Meets right."""
        barrier.wait(timeout=10)  # only returns if `right` runs at the same time
        return "left"

    def right() -> str:
        """Meets left."""
        barrier.wait(timeout=10)
        return "right"

    turn = ToolRunner([left, right], timeout_s=30).run_turn(assistant(call("left", {}), call("right", {})))
    assert [m["content"] for m in turn.messages] == ["left", "right"] and turn.errors == 0


def test_submit_returns_before_the_tools_finish():
    release = threading.Event()

    def slow(x: int) -> int:
        """Waits until released.

        Args:
            x: anything
        """
        release.wait(timeout=30)
        return x

    future = ToolRunner([slow], timeout_s=30).submit(assistant(call("slow", {"x": 7})))
    assert not future.done()  # a generator may release the slot here
    release.set()
    assert future.result(timeout=30) == [{"role": "tool", "name": "slow", "content": "7"}]


def test_tool_problems_name_the_key_and_the_fix():
    def no_doc(a: int) -> int:
        return a

    def no_hint(a) -> int:
        """Doc."""
        return a

    class NotAFunction:
        """A class."""

    problems = tool_problems(
        [no_doc, no_hint, NotAFunction, 3, add, add, lambda: 0], "agent.env='m:Env' tools"
    )
    text = "\n".join(problems)
    assert "tools[0] (test_tool_problems" in text and "no_doc) has no docstring" in text
    assert "no_hint) has no type hint on ['a']" in text
    assert "tools[2]" in text and "tools[3] (3) is not a function" in text
    assert "names ['add'] more than once" in text
    assert "tools named ['<lambda>']: the model calls a tool by name; use a def, not a lambda" in text
    assert all(p.startswith("agent.env='m:Env' tools") for p in problems)
    assert tool_problems(add, "tools") == ["tools is a function: make it a list of plain Python functions"]
    with pytest.raises(ValueError, match="no docstring"):
        ToolRunner([no_doc])
    with pytest.raises(ValueError, match=r"agent.tool_timeout_s=0 must be"):
        ToolRunner([add], timeout_s=0)
