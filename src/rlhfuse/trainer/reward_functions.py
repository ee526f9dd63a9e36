"""The registered reward functions (shipped configs only ever name entries of registries), and the run's
`RewardSet` built from `inferencer.reward_fn` / `inferencer.reward_weights`.

Each takes a batch of `rlhfuse.core.rewards.RewardSample` records and returns one score per sample. The answer
checks read the dataset row's `answer` field (`ANSWER_FIELD`). The `Registry` class lives in
`rlhfuse.core.registry`.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from rlhfuse.core.answers import exact_match, extract_answer, has_answer_format, numeric_match
from rlhfuse.core.inference import InferencerConfig, RewardChoice, reward_choices
from rlhfuse.core.registry import Registry
from rlhfuse.core.rewards import RewardFn, RewardSample, RewardSet, RuleReward

ANSWER_FIELD = "answer"

REWARD_FUNCTIONS: Registry[RewardFn] = Registry("reward function", "inferencer.reward_fn")


@REWARD_FUNCTIONS.register("topic_fraction")
def topic_fraction_reward(samples: Sequence[RewardSample]) -> list[float]:
    """The embedded task's hidden rule: fraction of response words on the prompt's topic."""
    from rlhfuse.data.synthetic import topic_fraction

    return [topic_fraction(s.prompt, s.response) for s in samples]


@REWARD_FUNCTIONS.register("length_penalty")
def length_penalty_reward(samples: Sequence[RewardSample]) -> list[float]:
    """-0.01 per response word: discourages rambling when added to a learned reward."""
    return [-0.01 * len(s.response.split()) for s in samples]


def _reference(sample: RewardSample) -> str:
    """The row's answer; a worked solution ending in `#### 42` (GSM8K) or `\\boxed{42}` gives its final answer."""
    answer = str(sample.fields[ANSWER_FIELD])
    return extract_answer(answer) or answer


@REWARD_FUNCTIONS.register("exact_match")
def exact_match_reward(samples: Sequence[RewardSample]) -> list[float]:
    """1 if the response's final answer (`\\boxed{}`, `####` or `answer:`) equals the row's `answer` as text."""
    return [exact_match(s.response, _reference(s)) for s in samples]


@REWARD_FUNCTIONS.register("numeric_match")
def numeric_match_reward(samples: Sequence[RewardSample]) -> list[float]:
    """1 if the number of the response's final answer (or its last number) equals the row's `answer`."""
    return [numeric_match(s.response, _reference(s)) for s in samples]


@REWARD_FUNCTIONS.register("answer_format")
def answer_format_reward(samples: Sequence[RewardSample]) -> list[float]:
    """1 if the response finished (not truncated) and states a final answer, whatever it is."""
    return [has_answer_format(s.response, s.finished) for s in samples]


@REWARD_FUNCTIONS.register("math_verify")
def math_verify_reward(samples: Sequence[RewardSample]) -> list[float]:
    """1 if the response's answer is mathematically equal to the row's `answer` by the `math-verify` package
    (LaTeX and plain expressions, sets, intervals, units; `\\boxed{}` first), else 0."""
    import math_verify

    # math-verify's timeouts use SIGALRM, which only the main thread may set
    limit = 5 if threading.current_thread() is threading.main_thread() else None
    scores = []
    for s in samples:
        gold = math_verify.parse(_math_reference(str(s.fields[ANSWER_FIELD])), parsing_timeout=limit)
        answer = math_verify.parse(s.response, parsing_timeout=limit)
        right = bool(gold) and bool(answer) and math_verify.verify(gold, answer, timeout_seconds=limit)
        scores.append(float(right))
    return scores


def _math_reference(answer: str) -> str:
    """A reference answer as math-verify parses it: a worked solution's final answer (`#### 42`, `\\boxed{}`),
    put in `$...$` unless it already holds LaTeX delimiters."""
    final = extract_answer(answer) or answer
    return final if "$" in final or "\\boxed" in final else f"${final}$"


# The dataset fields each registered function reads, checked against every row before the first iteration.
NEEDS_FIELDS: dict[str, tuple[str, ...]] = {
    "exact_match": (ANSWER_FIELD,),
    "numeric_match": (ANSWER_FIELD,),
    "math_verify": (ANSWER_FIELD,),
}

# The registered functions that score a final answer's correctness (1 right, 0 wrong): the mean of the first one
# the run uses is its accuracy (eval/accuracy).
VERIFIERS = ("exact_match", "numeric_match", "math_verify")


def reward_name(choice: RewardChoice) -> str:
    """The name a reward function's metrics are logged under: its registered name, the function part of
    'package.module:function', or a callable's __name__."""
    if isinstance(choice, str):
        return choice.rpartition(":")[2]
    return str(getattr(choice, "__name__", type(choice).__name__))


def rule_reward(choice: RewardChoice, key: str = "inferencer.reward_fn") -> RuleReward:
    """The reward function `choice` (registered, 'package.module:function', or the function itself) ready to
    call, with its checks."""
    if not isinstance(choice, str):
        return RuleReward(reward_name(choice), choice, key=key, spec=getattr(choice, "__qualname__", ""))
    function = REWARD_FUNCTIONS.get(choice)
    return RuleReward(reward_name(choice), function, key=key, needs=NEEDS_FIELDS.get(choice, ()), spec=choice)


def reward_set(config: InferencerConfig) -> RewardSet | None:
    """The run's rule-based rewards with their weights (`inferencer.reward_fn` / `reward_weights`); None without
    any."""
    choices = reward_choices(config.reward_fn)
    if not choices:
        return None
    return RewardSet(tuple(rule_reward(c) for c in choices), config.weights())


def verifier_index(config: InferencerConfig) -> int | None:
    """The position in `inferencer.reward_fn` of the first function scoring correctness (`VERIFIERS`), if any."""
    for k, choice in enumerate(reward_choices(config.reward_fn)):
        if isinstance(choice, str) and choice in VERIFIERS:
            return k
    return None
