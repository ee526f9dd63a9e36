"""`agent.*`: multi-turn episodes (`rlhfuse.agents`): the environment, the turn limit, the tools' time limit and the
bound on a trajectory's tokens.
No torch, so that the command line composes the configuration without it. The root config's `agent` section
(`RLHFConfig.agent`; docs/agents.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from rlhfuse.agents.environment import ENVIRONMENTS
from rlhfuse.core.config_checks import need

MAX_TURNS = 64
"""The most turns an episode may take (`agent.max_turns`): a turn's sample is seeded from its prompt, sample index
and turn (`rlhfuse.agents.generator`), `MAX_TURNS` turn numbers per sample."""


@dataclass
class AgentConfig:
    # The environment class: 'module:Class' (./module.py first, then PYTHONPATH; e.g. my_env:Env) or a registered
    # name; in the Python API the class itself. One object per episode, made with no arguments. null = single-turn
    # (no agent loop).
    env: str | type | None = None
    # Assistant turns per episode, tool turns included; the episode ends earlier when the environment says done.
    max_turns: int = 4
    # Seconds each message's tool calls may run (they run concurrently); a call still running then is answered
    # with an error and its thread abandoned (Python cannot stop a thread: rlhfuse.agents.tools).
    tool_timeout_s: float = 10.0
    # The most tokens a trajectory's response may hold (every turn's sampled tokens and the messages answering
    # them): an episode whose next turn could pass it ends before that turn ("context"; agent/truncated). 0 = no
    # bound but the turns'.
    max_response_tokens: int = 0

    def problems(self) -> list[str]:
        problems: list[str] = []
        need(
            problems,
            self.env is None
            or isinstance(self.env, type)
            or (isinstance(self.env, str) and self.env in ENVIRONMENTS),
            f"agent.env={self.env!r} is not 'module:Class' nor a registered environment {ENVIRONMENTS.names()}: "
            "set agent.env=my_env:Env for class Env in ./my_env.py",
        )
        need(
            problems,
            isinstance(self.max_turns, int) and 1 <= self.max_turns <= MAX_TURNS,
            f"agent.max_turns={self.max_turns} must be an integer from 1 to {MAX_TURNS} (assistant turns per "
            "episode, tool turns included; each turn's sample is keyed by its prompt, sample and turn)",
        )
        need(
            problems,
            self.tool_timeout_s > 0 and math.isfinite(self.tool_timeout_s),
            f"agent.tool_timeout_s={self.tool_timeout_s} must be a finite number of seconds > 0",
        )
        need(
            problems,
            isinstance(self.max_response_tokens, int) and self.max_response_tokens >= 0,
            f"agent.max_response_tokens={self.max_response_tokens} must be an integer >= 0 (0 = no bound)",
        )
        return problems


def trajectory_tokens(max_response_tokens: int, max_turns: int, max_new_tokens: int) -> int:
    """The bound on a trajectory's response tokens that a generation instance's KV cache is sized for (beyond
    the opened prompt): agent.max_response_tokens, or 2 x max_turns x max_new_tokens when that is 0 (each turn's
    sampled tokens and as many again for the messages answering it)."""
    return max_response_tokens or 2 * max_turns * max_new_tokens
