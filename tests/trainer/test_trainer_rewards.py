"""Verifiable rewards in the trainer: GRPO on the embedded arithmetic task with numeric_match (no reward model, no
Critic); a reward function that raises, miscounts or returns NaN stops the run naming the function and the
sample, and rows without the field the reward reads fail before any model is built."""

import json
import math

import pytest

from rlhfuse.core.checkpoint import list_checkpoints
from rlhfuse.core.errors import NonFiniteError
from rlhfuse.core.rewards import RewardError
from rlhfuse.data.synthetic import build_tokenizer
from rlhfuse.trainer import build_trainer, compose_config, validate

# experiment=arithmetic at smoke size: a small warm start, 3 iterations
ARITHMETIC_SMOKE = [
    "experiment=arithmetic",
    "iterations=3",
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "model.num_layers=1",
    "model.warmstart.sft_steps=20",
    "model.warmstart.rm_steps=5",
    "model.warmstart.sft_examples=256",
    "model.warmstart.rm_pairs=64",
    "data.num_prompts=32",
    "data.prompts_per_iteration=4",
    "data.mini_batch_size=8",
    "data.micro_batch_size=4",
]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("warmstart-cache"))


def _build(cache_dir, run_dir, *overrides):
    cfg = compose_config([*overrides, f"model.warmstart.cache_dir={cache_dir}"])
    return build_trainer(cfg, run_dir=run_dir, log=lambda _: None)


def test_experiment_arithmetic_composes_grpo_with_a_verifiable_reward():
    cfg = compose_config(["experiment=arithmetic"])
    validate(cfg)
    assert (cfg.data.source, cfg.algorithm.name, cfg.inferencer.reward_fn) == (
        "arithmetic",
        "grpo",
        "numeric_match",
    )
    assert not cfg.inferencer.use_reward_model


def test_grpo_on_arithmetic_end_to_end(cache_dir, tmp_path):
    trainer = _build(cache_dir, tmp_path, *ARITHMETIC_SMOKE)
    assert trainer.strategy.critic is None and trainer.inferencer.reward_model is None
    history = trainer.fit()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == len(history) == 3
    for row in rows:
        assert all(math.isfinite(v) for v in row.values())
        assert 0.0 <= row["task/accuracy"] <= 1.0
        # truncated_score=0 and a 0/1 rule: the reward is the accuracy, up to responses cut without EOS
        assert row["reward/mean"] <= row["task/accuracy"] + 1e-6
        assert "loss/value" not in row and "loss/kl" in row


@pytest.mark.parametrize(
    ("function", "error", "message"),
    [
        (
            "raising_reward",
            RewardError,
            r"inferencer.reward_fn='rlhfuse_test_rewards:raising_reward' raised ZeroDivisionError: division by "
            r"zero on prompt \d+ sample 1 \(prompt '",
        ),
        ("short_reward", RewardError, r"'rlhfuse_test_rewards:short_reward' returned 7 scores for 8 samples"),
        (
            "nan_reward",
            NonFiniteError,
            r"iteration 1: reward/mean is nan: inferencer.reward_fn='rlhfuse_test_rewards:nan_reward' returned the "
            r"non-finite score nan for prompt \d+ sample 0",
        ),
    ],
)
def test_a_failing_reward_function_stops_the_run_naming_it(cache_dir, tmp_path, function, error, message):
    trainer = _build(
        cache_dir,
        tmp_path,
        "experiment=smoke",
        "algorithm=grpo",
        f"inferencer.reward_fn=rlhfuse_test_rewards:{function}",
        "inferencer.use_reward_model=false",
        "checkpoint.every=1",
    )
    with pytest.raises(error, match=message):
        trainer.fit()
    assert list_checkpoints(tmp_path / "checkpoints") == []


def test_rows_without_the_answer_fail_before_any_model_is_built(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "animals : cat", "answer": "1"}\n{"prompt": "food : egg"}\n')
    tokenizer_dir = tmp_path / "tok"
    build_tokenizer().save(tokenizer_dir)
    cfg = compose_config(
        [
            "data=file",
            f"data.path={prompts}",
            "data.prompts_per_iteration=2",
            "data.mini_batch_size=4",
            "data.micro_batch_size=4",
            "model.sft_path=/nonexistent/sft",
            "model.reward_path=/nonexistent/rm",
            f"model.tokenizer_path={tokenizer_dir}",
            "inferencer.reward_fn=numeric_match",
        ]
    )
    with pytest.raises(RewardError) as err:
        build_trainer(cfg, run_dir=tmp_path / "run", log=lambda _: None)
    # the prompt field is the prompt, not one of the row's other fields
    assert f"reads the field 'answer' of each dataset row, but row 1 of {prompts} has only []" in str(
        err.value
    )
