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


def test_two_weighted_reward_functions_log_each_mean_on_arithmetic(cache_dir, tmp_path):
    trainer = _build(
        cache_dir,
        tmp_path,
        *ARITHMETIC_SMOKE,
        "iterations=2",
        "inferencer.reward_fn=[numeric_match,answer_format]",
        "inferencer.reward_weights=[1.0,0.5]",
        "inferencer.truncated_score=null",
    )
    for row in trainer.fit():
        right, formatted = row["reward/numeric_match/mean"], row["reward/answer_format/mean"]
        assert 0.0 <= right <= 1.0 and 0.0 <= formatted <= 1.0
        # the score training uses is the weighted sum; nothing replaced it (truncated_score=null)
        assert row["reward/mean"] == pytest.approx(right + 0.5 * formatted, abs=1e-5)
        assert row["reward/truncated_fraction"] == 0.0
        assert right == pytest.approx(row["task/accuracy"], abs=1e-6)
        assert 0.0 <= row["reward/zero_std_groups"] <= 1.0  # GRPO: groups whose samples all scored alike


def test_a_plain_callable_reward_in_the_python_api(cache_dir, tmp_path):
    def says_answer(samples):
        return ["answer" in s.response for s in samples]

    cfg = compose_config(["experiment=smoke", "iterations=1", f"model.warmstart.cache_dir={cache_dir}"])
    cfg.inferencer.reward_fn = [says_answer, "length_penalty"]
    cfg.inferencer.reward_weights = [2.0, 1.0]
    (row,) = build_trainer(cfg, run_dir=tmp_path, log=lambda _: None).fit()
    assert 0.0 <= row["reward/says_answer/mean"] <= 1.0 and row["reward/length_penalty/mean"] <= 0.0
    # the reward model's score is there too; truncated_score=null in experiment=smoke
    assert "reward/truncated_fraction" in row and "reward/zero_std_groups" not in row  # ppo: no groups


def test_eval_every_logs_held_out_accuracy_on_arithmetic(cache_dir, tmp_path):
    trainer = _build(cache_dir, tmp_path, *ARITHMETIC_SMOKE, "iterations=2", "eval.every=2")
    held_out = trainer.callbacks[[type(c).__name__ for c in trainer.callbacks].index("Evaluator")]
    assert len(held_out.prompts) == 3  # 10% of data.num_prompts=32, never trained on
    trained = {p.id for p in trainer.prompts.prompts}
    assert len(trained) == 29 and not trained & {p.id for p in held_out.prompts}
    first, second = trainer.fit()
    assert "eval/accuracy" not in first
    assert 0.0 <= second["eval/accuracy"] <= 1.0
    assert second["eval/accuracy"] == second["eval/reward/numeric_match/mean"]
    # greedy, one sample per prompt; truncated_score=0 in experiment=arithmetic scores cut answers as wrong
    assert second["eval/reward/mean"] <= second["eval/accuracy"] + 1e-6
    assert "eval/response_length/mean" in second


def test_eval_problems_name_the_keys():
    cfg = compose_config(["eval.every=5"])
    with pytest.raises(
        ValueError, match=r"eval.every=5 has no held-out prompts: set eval.path=<prompt file> or"
    ):
        validate(cfg)
    cfg = compose_config(["eval.split_fraction=0.1", "eval.path=x.jsonl", "eval.every=1"])
    with pytest.raises(ValueError, match=r"eval.path='x.jsonl' and eval.split_fraction=0.1 both choose"):
        validate(cfg)


def test_held_out_prompts_from_a_file_are_numbered_after_the_training_ones(tmp_path):
    from rlhfuse.data.data_config import DataConfig
    from rlhfuse.data.prompts import load_prompts
    from rlhfuse.trainer.evaluation import EvalConfig, held_out_prompts, split_prompts

    tokenizer = build_tokenizer()
    data = DataConfig(source="synthetic", num_prompts=10, chat_template="none")
    prompts = load_prompts(data, tokenizer, seed=0)
    held = tmp_path / "held.jsonl"
    held.write_text('{"prompt": "animals : cat", "answer": "1"}\n{"prompt": "food : egg", "answer": "2"}\n')
    train, evaluated = held_out_prompts(EvalConfig(path=str(held), every=1), data, tokenizer, prompts, seed=0)
    assert train == prompts and [p.id for p in evaluated] == [10, 11]
    assert [p.fields["answer"] for p in evaluated] == ["1", "2"]
    a, b = split_prompts(prompts, 0.3, seed=0)
    assert (a, b) == split_prompts(prompts, 0.3, seed=0) and len(b) == 3
    assert sorted(p.id for p in [*a, *b]) == list(range(10))
