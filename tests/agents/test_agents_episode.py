"""Environments named `agent.env=my_env:Env` (a user's file) or passed as the class, checked on load; episodes
played against a scripted model: tool turns, tool failures, rewards summed, `done` and `max_turns`."""

import sys
import textwrap
import threading
import time

import pytest

from rlhfuse.agents import (
    AgentConfig,
    AgentEnvError,
    ToolRunner,
    environment_tools,
    load_environment,
    run_episode,
)

ENV_FILE = '''
import threading

RELEASE = threading.Event()


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def divide(a: float, b: float) -> float:
    """Divide a by b.

    Args:
        a: the dividend
        b: the divisor
    """
    return a / b


def wait_forever(x: int) -> int:
    """Never answers in time.

    Args:
        x: anything
    """
    RELEASE.wait()
    return x


class Env:
    """Answer the row's question; a wrong answer costs 0.25 and is told so."""

    tools = [add, divide, wait_forever]

    def reset(self, row):
        self.answer = row["answer"]
        return [{"role": "user", "content": "Use the tools if you like."}]

    def step(self, message):
        if message["content"].strip() == self.answer:
            return [], 1.0, True
        return [{"role": "user", "content": "Wrong, try again."}], -0.25, False
'''

PROMPT = [{"role": "user", "content": "What is 2 + 3?"}]


@pytest.fixture
def user_env(tmp_path, monkeypatch):
    """./my_env.py in a fresh current directory; the module is forgotten afterwards."""
    (tmp_path / "my_env.py").write_text(ENV_FILE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the registry puts the current directory first
    yield "my_env:Env"
    module = sys.modules.pop("my_env", None)
    if module is not None:
        module.RELEASE.set()


def scripted(*replies):
    """A model that says `replies` in order, recording what it was shown."""
    seen = []

    def respond(messages):
        seen.append(messages)
        return replies[len(seen) - 1]

    respond.seen = seen
    return respond


def call(name, arguments):
    import json

    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_env_from_a_user_file_and_the_same_class_play_the_same_episode(user_env):
    pytest.importorskip("transformers")  # the tools' schemas are checked on load
    cls = load_environment(user_env)
    assert cls.__module__ == "my_env" and load_environment(cls) is cls
    replies = (
        call("add", {"a": 2, "b": 3}) + call("divide", {"a": 1, "b": 0}),  # one answer, one raise
        call("wait_forever", {"x": 1}) + "\n<tool_call>{bad json</tool_call>" + call("mul", {"a": 1}),
        call("add", {"a": "2", "b": 3}),  # bad arguments
        "6",  # wrong: -0.25
        "5",  # right: +1, done
    )
    episodes = []
    for env_class in (load_environment(user_env), cls):
        env = env_class()
        runner = ToolRunner(environment_tools(env, "agent.env"), timeout_s=0.2)
        respond = scripted(*replies)
        start = time.monotonic()
        episode = run_episode(env, {"answer": "5"}, PROMPT, respond, max_turns=8, tools_runner=runner)
        assert time.monotonic() - start < 20  # the stuck tool cost its timeout, not the episode
        episodes.append(episode)
    first, second = episodes
    assert first == second
    assert first.ended == "done" and first.turns == 5
    assert first.rewards == [0.0, 0.0, 0.0, -0.25, 1.0] and first.total_reward == 0.75
    assert (first.tool_calls, first.tool_errors) == (6, 5)
    roles = [m["role"] for m in first.messages]
    assert roles == ["user", "user", "assistant", "tool", "tool", "assistant", "tool", "tool", "tool",
                     "assistant", "tool", "assistant", "user", "assistant"]  # fmt: skip
    assert first.trainable == [r == "assistant" for r in roles]
    tools = [m["content"] for m in first.messages if m["role"] == "tool"]
    assert tools[0] == "5" and tools[1].startswith("error: divide raised ZeroDivisionError")
    assert tools[2] == "error: wait_forever did not finish within 0.2 s"
    assert "not valid JSON" in tools[3] and "unknown tool 'mul'" in tools[4]
    assert "argument 'a' must be int, got str" in tools[5]
    # the model saw each answer before its next turn (the prompt, the environment's opening, ...)
    assert respond.seen[1][-2:] == first.messages[3:5]
    assert respond.seen[0] == first.messages[:2]


def test_max_turns_ends_the_episode_and_rewards_add_up():
    class Guess:
        """Never done; each turn pays 0.5."""

        def reset(self, row):
            return []

        def step(self, message):
            return [{"role": "user", "content": "more"}], 0.5, False

    episode = run_episode(Guess(), {}, PROMPT, scripted("a", "b", "c", "d"), max_turns=3, tools_runner=None)
    assert episode.ended == "max_turns" and episode.turns == 3
    assert episode.rewards == [0.5, 0.5, 0.5] and episode.total_reward == 1.5
    assert [m["content"] for m in episode.messages if m["role"] == "assistant"] == ["a", "b", "c"]
    # without tools, a tool call is just text for the environment
    text = call("add", {"a": 1, "b": 2})
    episode = run_episode(Guess(), {}, PROMPT, scripted(text), max_turns=1, tools_runner=None)
    assert episode.rewards == [0.5] and episode.tool_calls == 0


def test_a_tool_call_in_the_last_turn_is_not_run():
    ran = threading.Event()

    def probe() -> str:
        """Records that it ran."""
        ran.set()
        return "ran"

    class Never:
        """Never done, never reached."""

        def reset(self, row):
            return []

        def step(self, message):
            raise AssertionError("not called")

    runner = ToolRunner([probe], timeout_s=5)
    respond = scripted(call("probe", {}), call("probe", {}))
    episode = run_episode(Never(), {}, PROMPT, respond, max_turns=2, tools_runner=runner)
    assert episode.ended == "max_turns" and episode.turns == 2 and episode.rewards == [0.0, 0.0]
    assert episode.tool_calls == 1 and episode.messages[-1]["role"] == "assistant"
    assert ran.is_set()


@pytest.mark.parametrize(
    ("step", "match"),
    [
        ("return [], float('nan'), True", "reward nan: return a finite float"),
        ("return [], 1.0", r"returned tuple .*: return \(messages, reward, done\)"),
        (
            "return [{'role': 'assistant', 'content': 'x'}], 1.0, True",
            r"give \{'role': one of \['user', 'tool'\]",
        ),
        ("return [], 1.0, 'yes'", "done='yes': return True or False"),
        ("raise KeyError('answer')", r"step\(message\) raised KeyError: 'answer'"),
    ],
)
def test_an_environment_breaking_its_contract_is_named(step, match):
    namespace = {}
    exec(textwrap.dedent(f"""
        class Broken:
            def reset(self, row):
                return []
            def step(self, message):
                {step}
    """), namespace)  # fmt: skip
    with pytest.raises(AgentEnvError, match=r"agent.env \(Broken\): .*" + match):
        run_episode(namespace["Broken"](), {}, PROMPT, scripted("hi"), max_turns=1, tools_runner=None)


def test_load_names_agent_env_and_the_fix(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "bad_envs.py").write_text(textwrap.dedent('''
        def undocumented(a: int) -> int:
            return a

        def env_function():
            pass

        class NoStep:
            def reset(self, row):
                return []

        class BadTools:
            tools = [undocumented, "add"]
            def __init__(self, level):
                self.level = level
            def reset(self, row):
                return []
            def step(self, message):
                return [], 0.0, True
    '''))  # fmt: skip
    try:
        cases = {
            "bad_envs:env_function": r"agent.env='bad_envs:env_function' is a function, not a class",
            "bad_envs:NoStep": r"agent.env='bad_envs:NoStep' has no step method: add `def step\(self, message",
            "bad_envs:Missing": r"module 'bad_envs' has no attribute 'Missing'",
            "no_such_file:Env": r"cannot import module 'no_such_file'",
            "just_a_name": r"agent.env='just_a_name' is not a registered environment \['calculator', 'guess'\] nor 'module:Class'",
        }
        for choice, match in cases.items():
            with pytest.raises(AgentEnvError, match=match):
                load_environment(choice)
        with pytest.raises(AgentEnvError) as err:
            load_environment("bad_envs:BadTools")
        message = str(err.value)
        assert "cannot be made with no arguments" in message
        assert "agent.env='bad_envs:BadTools' tools[0] (undocumented) has no docstring" in message
        assert "tools[1] ('add') is not a function" in message
        assert "\n" not in message
    finally:
        sys.modules.pop("bad_envs", None)


def test_agent_config_problems():
    assert AgentConfig().problems() == []
    assert AgentConfig(env="my_env:Env", max_turns=1, tool_timeout_s=0.5).problems() == []
    problems = AgentConfig(env="my env", max_turns=0, tool_timeout_s=float("inf")).problems()
    assert len(problems) == 3
    assert problems[0].startswith("agent.env='my env' is not 'module:Class'")
    assert problems[1].startswith("agent.max_turns=0 must be an integer from 1 to 64")
    (too_many,) = AgentConfig(max_turns=65).problems()
    assert too_many.startswith("agent.max_turns=65 must be an integer from 1 to 64")
    assert problems[2].startswith("agent.tool_timeout_s=inf must be")
