"""Verifiable rewards: answer extraction and matching by hand, the typed per-sample records, and every failure of
a reward function named with the function and the sample."""

import pytest
import torch

from rlhfuse.core.errors import NonFiniteError
from rlhfuse.core.rewards import (
    RewardError,
    RewardSample,
    RuleReward,
    exact_match,
    extract_answer,
    has_answer_format,
    numeric_match,
    reward_samples,
)
from rlhfuse.core.types import Rollout
from rlhfuse.trainer.registry import rule_reward


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
