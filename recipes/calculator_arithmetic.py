"""A calculator tool on the embedded arithmetic task: the tiny model learns, by RL, to call `calc(expression)` and
answer with its result.

    python recipes/calculator_arithmetic.py                     # 20 iterations of experiment=calculator
    python recipes/calculator_arithmetic.py seed=1 run_dir=runs/calculator
    python recipes/calculator_arithmetic.py generator=engine generator.instances=2 migration=auto

The warm start teaches the tool's call format on a quarter of its examples (the call, the result, `answer : <n>`)
and direct answers, right ~30% of the time, on the rest, so the policy starts out calling the tool now and then.
Each sample is an episode of up to two turns (`agent.env=calculator`, `agent.max_turns=2`): the model either
answers at once or calls the tool, reads its `<tool_response>` and answers. The environment rewards a right final
answer with 1 (no reward model, no reward function) and GRPO's group baseline does the rest: the tool's tokens are
the environment's (no loss, no KL), the call and the answer the model's. Held-out greedy accuracy is evaluated
before the first iteration and every 5 (eval/reward/mean: the environment's reward is 1 exactly for a right
answer); agent/tool_calls is the share of episodes that called the tool. docs/agents.md gives measured runs.
"""

from __future__ import annotations

import sys
import time

from rlhfuse.trainer import build_trainer, compose_config

CALCULATOR = ["experiment=calculator", "eval.every=5", "eval.before_training=true"]


def main(overrides: list[str], base: list[str] = CALCULATOR) -> list[dict[str, float]]:
    """The run of `base` + `overrides` (command-line overrides), with its held-out reward (the share of right
    answers, or of games won) before and after, and its episodes' turns and tool calls, printed at the end."""
    config = compose_config([*base, *overrides])
    config.run_dir = config.run_dir or f"outputs/{config.experiment}-{time.strftime('%Y%m%d-%H%M%S')}"
    history = build_trainer(config).fit()
    held_out = " -> ".join(
        f"{row['eval/reward/mean']:.3f} (iteration {row['iteration']:.0f})"
        for row in history
        if "eval/reward/mean" in row
    )
    trained = [row for row in history if "agent/tool_calls" in row]
    episodes = ""
    if trained:
        first, last = trained[0], trained[-1]
        episodes = (
            f"; episodes' turns {first['agent/turns_mean']:.2f} -> {last['agent/turns_mean']:.2f}, calling the "
            f"tool {first['agent/tool_calls']:.2f} -> {last['agent/tool_calls']:.2f}"
        )
    print(f"held-out reward {held_out or 'not evaluated'}{episodes}; metrics: {config.run_dir}/metrics.jsonl")
    return history


if __name__ == "__main__":
    main(sys.argv[1:])
