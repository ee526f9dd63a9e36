"""Verifiable rewards: answer extraction and matching by hand, the typed per-sample records, and every failure of
a reward function named with the function and the sample."""

import pytest
import torch

from rlhfuse.core.answers import exact_match, extract_answer, has_answer_format, numeric_match
from rlhfuse.core.errors import NonFiniteError
from rlhfuse.core.inference import InferencerConfig, final_scores
from rlhfuse.core.rewards import RewardError, RewardSample, RuleReward, reward_samples
from rlhfuse.core.types import Rollout
from rlhfuse.trainer.reward_functions import reward_set, rule_reward


@pytest.mark.parametrize(
    ("response", "answer"),
    [
        ("so it is \\boxed{42} or \\boxed{43}", "43"),
        ("work ... #### 1,234", "1,234"),
        ("Answer: -7\nextra line", "-7"),
        ("the answer is 12.", "12."),
        ("answer : 5", "5"),
        ("no marker 5", None),
        ("answer:", None),
    ],
)
def test_extract_answer(response, answer):
    assert extract_answer(response) == answer


def test_exact_and_numeric_match_by_hand():
    assert exact_match("Answer: Paris.", "paris") == 1.0
    assert exact_match("Answer: Paris is nice", "paris") == 0.0
    assert exact_match("Paris", "paris") == 0.0  # exact match needs a stated final answer
    assert numeric_match("#### 1,234", "1234") == 1.0
    assert numeric_match("answer : -3", "-3") == 1.0
    assert numeric_match("answer : 3", "-3") == 0.0
    assert numeric_match("I think 4 then 7", "7") == 1.0  # no marker: the last number
    assert numeric_match("answer is 0.1", "0.10000000001") == 1.0
    assert numeric_match("nothing", "7") == 0.0
    with pytest.raises(ValueError, match="not a number"):
        numeric_match("answer : 3", "three")


def test_answer_format_needs_a_finished_response_with_an_answer():
    assert has_answer_format("answer : 3", finished=True) == 1.0
    assert has_answer_format("answer : 3", finished=False) == 0.0
    assert has_answer_format("so 3", finished=True) == 0.0


class _Words:
    """A decoder over a tiny vocabulary: id i -> word i (0 = pad, skipped)."""

    words = ("<pad>", "answer", ":", "3", "4", "1", "+", "2", "=")

    def decode(self, ids):
        return " ".join(self.words[i] for i in ids if i != 0)


def _rollout():
    # prompt "1 + 2 =" twice (prompt id 1), responses "answer : 3" (finished) and "answer : 4 4" (cut)
    return Rollout(
        prompt_ids_BP=torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8]]),
        prompt_mask_BP=torch.ones(2, 4, dtype=torch.long),
        response_ids_BR=torch.tensor([[1, 2, 3, 0], [1, 2, 4, 4]]),
        response_mask_BR=torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]),
        prompt_index_B=torch.tensor([1, 1]),
        sample_index_B=torch.tensor([0, 1]),
        finished_B=torch.tensor([True, False]),
    )


ROWS = [{"answer": "9"}, {"answer": "3", "level": "easy"}]


def test_reward_samples_carry_text_ids_flag_and_row_fields():
    first, second = reward_samples(_rollout(), _Words(), ROWS)
    assert first == RewardSample(
        prompt="1 + 2 =",
        response="answer : 3",
        response_ids=(1, 2, 3),
        finished=True,
        fields={"answer": "3", "level": "easy"},
        prompt_id=1,
        sample_index=0,
    )
    assert second.response_ids == (1, 2, 4, 4) and not second.finished
    with pytest.raises(IndexError, match="prompt id 1 is outside the dataset's 1 rows"):
        reward_samples(_rollout(), _Words(), ROWS[:1])


def test_builtin_rewards_score_the_records():
    samples = reward_samples(_rollout(), _Words(), ROWS)
    assert rule_reward("numeric_match")(samples).tolist() == [1.0, 0.0]
    assert rule_reward("exact_match")(samples).tolist() == [1.0, 0.0]
    assert rule_reward("answer_format")(samples).tolist() == [1.0, 0.0]
    assert rule_reward("length_penalty")(samples).tolist() == pytest.approx([-0.03, -0.04])


def _raise_on_second(samples):
    if any(s.sample_index == 1 for s in samples):
        raise ZeroDivisionError("division by zero")
    return [0.0] * len(samples)


def test_a_raising_reward_names_the_function_and_the_sample():
    samples = reward_samples(_rollout(), _Words(), ROWS)
    with pytest.raises(RewardError) as err:
        RuleReward("mine:fn", _raise_on_second)(samples)
    message = str(err.value)
    assert message.startswith("inferencer.reward_fn='mine:fn' raised ZeroDivisionError: division by zero on")
    assert "prompt 1 sample 1 (prompt '1 + 2 =', response 'answer : 4 4')" in message


def test_wrong_count_non_numbers_and_non_finite_scores_are_named():
    samples = reward_samples(_rollout(), _Words(), ROWS)
    with pytest.raises(RewardError, match=r"'short' returned 1 scores for 2 samples"):
        RuleReward("short", lambda s: [0.0])(samples)
    with pytest.raises(RewardError, match=r"returned 'yes' \(not a number\) for prompt 1 sample 1"):
        RuleReward("text", lambda s: [1.0, "yes"])(samples)
    with pytest.raises(
        NonFiniteError, match=r"'nan' returned the non-finite score inf for prompt 1 sample 0"
    ):
        RuleReward("nan", lambda s: [float("inf"), 0.0])(samples)


def test_rows_without_the_needed_field_are_named_before_training():
    rule = rule_reward("numeric_match")
    rule.check_rows(ROWS, "p.jsonl")
    with pytest.raises(RewardError) as err:
        rule.check_rows([{"answer": "1"}, {"solution": "2"}], "p.jsonl")
    assert "reads the field 'answer' of each dataset row, but row 1 of p.jsonl has only ['solution']" in str(
        err.value
    )
    assert rule_reward("topic_fraction").needs == ()


# ------------------------------------------------------------------ several functions, weights, truncation
def _sample(response, answer="25", finished=True):
    return RewardSample("q", response, (1,), finished, {"answer": answer})


def test_a_reward_set_scores_each_function_and_weighs_their_sum():
    rewards = reward_set(
        InferencerConfig(reward_fn=["numeric_match", "answer_format"], reward_weights=[1.0, 0.5])
    )
    assert rewards is not None and rewards.names == ("numeric_match", "answer_format")
    samples = [_sample("Answer: 25"), _sample("Answer: 24"), _sample("25", finished=False)]
    scores_BK = rewards(samples)
    assert scores_BK.tolist() == [[1.0, 1.0], [0.0, 1.0], [1.0, 0.0]]
    assert rewards.combine(scores_BK).tolist() == [1.5, 0.5, 1.0]


def test_plain_callables_and_import_paths_are_named_by_their_function():
    def brevity(samples):
        return [-len(s.response) for s in samples]

    path = "rlhfuse.trainer.reward_functions:length_penalty_reward"
    rewards = reward_set(InferencerConfig(reward_fn=[brevity, path]))
    assert rewards is not None and rewards.names == ("brevity", "length_penalty_reward")
    assert rewards([_sample("a b")])[0].tolist() == pytest.approx([-3.0, -0.02])
    with pytest.raises(ValueError, match=r"inferencer.reward_fn names 'brevity' twice"):
        reward_set(InferencerConfig(reward_fn=[brevity, brevity]))


def test_reward_config_problems_name_the_key():
    assert InferencerConfig(reward_fn=["numeric_match"], reward_weights=[1.0, 0.5]).problems() == [
        "inferencer.reward_weights has 2 weights for 1 reward functions (inferencer.reward_fn): give one weight "
        "per function, in order, or null for 1 each"
    ]
    (problem,) = InferencerConfig(reward_fn="numeric_match", truncated_score="never").problems()
    assert problem.startswith("inferencer.truncated_score='never' must be auto")
    (problem,) = InferencerConfig(reward_fn=["numeric_match", 3]).problems()
    assert problem.startswith("inferencer.reward_fn holds 3:")


def _truncation_rollout():
    """Two samples: the first finished (EOS), the second cut at the token limit."""
    return Rollout(
        prompt_ids_BP=torch.tensor([[5, 6], [5, 6]]),
        prompt_mask_BP=torch.ones(2, 2, dtype=torch.long),
        response_ids_BR=torch.tensor([[7, 2], [7, 7]]),
        response_mask_BR=torch.ones(2, 2, dtype=torch.long),
        prompt_index_B=torch.tensor([0, 0]),
        sample_index_B=torch.tensor([0, 1]),
        finished_B=torch.tensor([True, False]),
    )


class _Ids:
    def decode(self, ids):
        return " ".join(map(str, ids))


@pytest.mark.parametrize(
    ("truncated_score", "use_reward_model", "want", "replaces"),
    [
        # auto: the reward model's reading of the cut sample becomes -5; the rule's score stays
        ("auto", True, [3.0 + 1.0, -5.0 + 1.0], True),
        # auto without a reward model: the rule scores truncated responses itself
        ("auto", False, [1.0, 1.0], False),
        # a number set explicitly: the whole score of the cut sample
        (0.0, True, [4.0, 0.0], True),
        (None, True, [4.0, 4.0], False),
    ],
)
def test_truncated_score_auto_replaces_the_reward_model_score_only(
    truncated_score, use_reward_model, want, replaces
):
    config = InferencerConfig(
        reward_fn=[lambda samples: [1.0] * len(samples)],
        truncated_score=truncated_score,
        use_reward_model=use_reward_model,
    )
    rm_B = torch.tensor([3.0, 3.0]) if use_reward_model else None
    scores = final_scores(config, _truncation_rollout(), rm_B, reward_set(config), _Ids())
    assert scores.total_B.tolist() == want
    assert scores.rules_BK.tolist() == [[1.0], [1.0]]
    assert config.replaces_truncated() is replaces


def test_reward_metrics_log_each_function_and_the_truncated_fraction():
    from rlhfuse.core.types import Experience
    from rlhfuse.trainer.callbacks import RewardMetrics

    rollout = _truncation_rollout()
    zeros = torch.zeros(2, 2)
    experience = Experience(
        rollout, zeros, zeros, zeros, torch.zeros(2), torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    )
    metrics: dict[str, float] = {}
    RewardMetrics(("numeric_match", "answer_format"), replaces_truncated=True).on_rollout_end(
        None, experience, metrics
    )
    assert metrics == {
        "reward/numeric_match/mean": 0.5,
        "reward/answer_format/mean": 0.0,
        "reward/truncated_fraction": 0.5,
    }
    RewardMetrics((), replaces_truncated=False).on_rollout_end(None, experience, metrics)
    assert metrics["reward/truncated_fraction"] == 0.0


@pytest.mark.parametrize(
    ("response", "answer", "right"),
    [
        ("so the result is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("The answer is $x = 2$", "2", 1.0),
        ("We get 3/4", "#### 0.75", 1.0),
        ("The answer is 7", "8", 0.0),
        ("no idea", "8", 0.0),
    ],
)
def test_math_verify_reward_uses_the_math_verify_package(response, answer, right):
    fn = rule_reward("math_verify")
    assert fn.needs == ("answer",)
    assert fn([_sample(response, answer)]).tolist() == [right]


def test_import_paths_resolve_from_the_current_directory_first(tmp_path, monkeypatch):
    import sys

    (tmp_path / "my_rewards_cwd.py").write_text("def correct(samples):\n    return [1.0 for _ in samples]\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert rule_reward("my_rewards_cwd:correct")([_sample("x")]).tolist() == [1.0]
    with pytest.raises(KeyError) as err:
        rule_reward("no_such_rewards:correct")
    message = str(err.value)
    assert (
        f"no 'no_such_rewards' in the current directory ({tmp_path})" in message and "PYTHONPATH" in message
    )
    sys.modules.pop("my_rewards_cwd", None)
