"""Multi-turn agent episodes, the bottom layer (docs/agents.md): an `Environment` (reset / step in chat
messages), tools as plain functions run by a `ToolRunner`, `run_episode` (a pure loop around a `respond`
function) and `episode_tokens` (the conversation's ids with the mask of the tokens the model wrote). Imports only
`rlhfuse.core`, `rlhfuse.data` and `rlhfuse.distributed`; `agent.env` wires it into a run (docs/agents.md).
"""

from typing import TYPE_CHECKING

from rlhfuse._lazy import lazy_package

if TYPE_CHECKING:
    from rlhfuse.agents.agent_config import AgentConfig
    from rlhfuse.agents.environment import (
        ENVIRONMENTS,
        AgentEnvError,
        Environment,
        environment_tools,
        load_environment,
    )
    from rlhfuse.agents.episode import Episode, run_episode
    from rlhfuse.agents.games import Calculator, GuessingGame, calc
    from rlhfuse.agents.tokens import episode_tokens
    from rlhfuse.agents.tools import (
        ToolCall,
        ToolCallError,
        ToolRunner,
        ToolTurn,
        parse_tool_calls,
        tool_problems,
        tool_schema,
        tool_schemas,
    )

# The public names are imported from their modules on first use (rlhfuse._lazy).
_PUBLIC: dict[str, tuple[str, ...]] = {
    "rlhfuse.agents.agent_config": ("AgentConfig",),
    "rlhfuse.agents.environment": (
        "ENVIRONMENTS",
        "AgentEnvError",
        "Environment",
        "environment_tools",
        "load_environment",
    ),
    "rlhfuse.agents.episode": ("Episode", "run_episode"),
    "rlhfuse.agents.games": ("Calculator", "GuessingGame", "calc"),
    "rlhfuse.agents.tokens": ("episode_tokens",),
    "rlhfuse.agents.tools": (
        "ToolCall",
        "ToolCallError",
        "ToolRunner",
        "ToolTurn",
        "parse_tool_calls",
        "tool_problems",
        "tool_schema",
        "tool_schemas",
    ),
}
lazy_package(__name__, _PUBLIC)

__all__ = [
    "ENVIRONMENTS",
    "AgentConfig",
    "AgentEnvError",
    "Calculator",
    "Environment",
    "Episode",
    "GuessingGame",
    "ToolCall",
    "ToolCallError",
    "ToolRunner",
    "ToolTurn",
    "calc",
    "environment_tools",
    "episode_tokens",
    "load_environment",
    "parse_tool_calls",
    "run_episode",
    "tool_problems",
    "tool_schema",
    "tool_schemas",
]
