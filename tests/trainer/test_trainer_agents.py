"""Multi-turn episodes in a run (issue 43): an environment class in the user's own file, named by agent.env or
passed from Python, trains 2 iterations; the episodes' environment tokens carry no loss; bad input is one line."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from rlhfuse.agents import AgentConfig
from rlhfuse.core.types import Rollout
from rlhfuse.trainer import build_trainer, compose_config, validate

ENV_FILE = '''
class Env:
    """Each answer is judged (1 if it holds a digit) and answered "check it again", twice; then done."""

    def __init__(self):
        self.turns = 0

    def reset(self, row):
        return [{"role": "user", "content": "answer : " + row["answer"]}]

    def step(self, message):
        self.turns += 1
        reward = 1.0 if any(c.isdigit() for c in message["content"]) else 0.0
        if self.turns == 2:
            return [], reward, True
        return [{"role": "user", "content": "answer : 7 + 5"}], reward, False
'''


@pytest.fixture
def env_dir(tmp_path: Path):
    """tmp_path as the current folder, holding my_env.py (the environment's own file, outside the package)."""
    (tmp_path / "my_env.py").write_text(ENV_FILE)
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        yield tmp_path
    finally:
        os.chdir(cwd)
        import sys

        sys.modules.pop("my_env", None)
        while str(tmp_path) in sys.path:
            sys.path.remove(str(tmp_path))


def _prompts(path: Path) -> Path:
    rows = [{"messages": [{"role": "user", "content": "7 + 5 ="}], "answer": "12"}] * 2
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _overrides(env_dir: Path, sft: Path, hf_local_grpo, *extra: str) -> list[str]:
    return hf_local_grpo(
        sft, _prompts(env_dir / "p.jsonl"), "data.micro_batch_size=4", "generator.max_new_tokens=3",
        "iterations=2", "checkpoint.export_hf=false", "agent.max_turns=3", *extra,
    )  # fmt: skip


def test_an_environment_from_the_users_file_trains_and_its_tokens_carry_no_loss(
    env_dir, chat_checkpoint_of, hf_local_grpo
) -> None:
    # a seeded random model: whether its first messages end within the token limit (and get answered) is then
    # fixed, not drawn anew each run
    torch.manual_seed(0)
    chat_checkpoint = chat_checkpoint_of("llama")
    cfg = compose_config(_overrides(env_dir, chat_checkpoint.path, hf_local_grpo, "agent.env=my_env:Env"))
    trainer = build_trainer(cfg, run_dir=env_dir / "run", log=lambda _: None)
    seen = []
    inner = trainer.inferencer.infer

    def infer(rollout):  # what the rollout stage hands to inference: the episodes
        seen.append(rollout)
        return inner(rollout)

    trainer.inferencer.infer = infer  # type: ignore[method-assign]
    rows = trainer.fit()
    assert [r["iteration"] for r in rows] == [1, 2] and all(
        torch.isfinite(torch.tensor(r["loss/policy"])) for r in rows
    )
    # both iterations' episodes, from the chunks they were yielded in as they ended
    rollout = Rollout.cat(seen, chat_checkpoint.tokenizer.pad_id)
    assert len(rollout) == 8 and rollout.trainable_mask_BR is not None and rollout.env_reward_B is not None
    tok = chat_checkpoint.tokenizer
    for b in range(len(rollout)):
        mask, train = rollout.response_mask_BR[b].bool(), rollout.trainable_mask_BR[b].bool()
        env_ids = rollout.response_ids_BR[b][mask & ~train].tolist()
        if (
            env_ids
        ):  # an answered turn: the environment's message, rendered by the template, is not trained on
            assert "<|user|>" in tok.decode(env_ids, skip_special=False)
        assert (rollout.sampler_logprobs_BR[b][mask & ~train] == 0).all()
    assert any((rollout.response_mask_BR.bool() & ~rollout.trainable_mask_BR.bool()).any(dim=1))
    # the opening message is part of the prompt (the dataset's "answer" field rendered into it)
    assert "12" in tok.decode(rollout.prompt_ids_BP[0][rollout.prompt_mask_BP[0].bool()].tolist())


def test_the_same_environment_passed_from_python_and_bad_input_in_one_line(
    env_dir, chat_checkpoint, hf_local_grpo
) -> None:
    import importlib.util

    from rlhfuse.trainer import RLHFTrainer

    spec = importlib.util.spec_from_file_location("users_env", env_dir / "my_env.py")
    assert spec is not None and spec.loader is not None
    my_env = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(my_env)  # the user's script has its class in hand

    base = compose_config(_overrides(env_dir, chat_checkpoint.path, hf_local_grpo))
    trainer = RLHFTrainer(
        config=base,
        agent=AgentConfig(env=my_env.Env, max_turns=2),
        run_dir=env_dir / "py",
        log=lambda _: None,
    )
    rows = trainer.fit()
    assert len(rows) == 2 and "reward/mean" in rows[-1]
    (env_dir / "broken.py").write_text("class Env:\n    def reset(self, row):\n        return []\n")
    for env, fix in (("broken:Env", "step"), ("nowhere:Env", "nowhere"), ("my_env:Missing", "Missing")):
        with pytest.raises(ValueError, match=fix) as err:
            validate(
                compose_config(_overrides(env_dir, chat_checkpoint.path, hf_local_grpo, f"agent.env={env}"))
            )
        assert "agent.env" in str(err.value)
    with pytest.raises(ValueError, match=r"agent.env with async.max_staleness=1"):
        validate(compose_config(["agent.env=my_env:Env", "async.max_staleness=1"]))


def test_episodes_over_two_processes_from_the_command_line(
    env_dir, chat_checkpoint_of, hf_local_grpo, train_cli
) -> None:
    # one generation instance per process: rank 0 runs the environments and shares each turn's answers
    torch.manual_seed(0)
    chat_checkpoint = chat_checkpoint_of("llama")
    overrides = _overrides(
        env_dir, chat_checkpoint.path, hf_local_grpo, "agent.env=my_env:Env", "distributed.nproc_per_node=2",
        "generator=engine", "generator.instances=2",
    )  # fmt: skip
    rows = train_cli(env_dir / "two", *overrides, timeout=300)
    assert [r["iteration"] for r in rows] == [1, 2]
    for row in rows:
        assert torch.isfinite(torch.tensor(row["loss/policy"]))
        assert 1 <= row["agent/turns_mean"] <= row["agent/turns_p99"] <= 3
        assert row["agent/model_tokens"] > 0 and row["agent/env_tokens"] >= 0 and row["agent/tool_calls"] == 0
