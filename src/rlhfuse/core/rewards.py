"""Rule-based (verifiable) rewards: a reward function receives typed per-sample records, batched, and returns one
score per sample; `RuleReward` calls it and turns every failure into an error naming the function and the sample.

A reward function is chosen by a registered name (`rlhfuse.trainer.reward_functions.REWARD_FUNCTIONS`), as
`package.module:function` or, in the Python API, as the function itself (`inferencer.reward_fn`, one or a list;
`RewardSet` holds the list with its weights). The built-in checks of a final answer (exact and numeric
match) and of a format are plain functions of strings in `rlhfuse.core.answers` (no torch), imported here too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

# the answer checks, also importable from here (as before they moved): reward functions import them from either
from rlhfuse.core.answers import (  # noqa: F401
    exact_match,
    extract_answer,
    has_answer_format,
    normalize_answer,
    numeric_match,
    parse_number,
)
from rlhfuse.core.errors import NonFiniteError
from rlhfuse.core.types import Rollout


class Decoder(Protocol):
    """What a rule-based reward needs of a tokenizer: token ids back to text."""

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass(frozen=True)
class RewardSample:
    """One generated sample as a reward function sees it.

    prompt / response: decoded text (special tokens skipped); response_ids: the generated token ids (EOS
    included when it stopped); finished: True if the response ended with EOS / a stop token, False if it was cut
    at generator.max_new_tokens (truncated); fields: the dataset row's other fields (e.g. `answer`), empty for a
    dataset without any; prompt_id: the prompt's row in the dataset; sample_index: which of its samples this is.
    """

    prompt: str
    response: str
    response_ids: tuple[int, ...]
    finished: bool
    fields: Mapping[str, Any] = field(default_factory=dict)
    prompt_id: int = 0
    sample_index: int = 0

    def describe(self) -> str:
        """The sample, for error messages: ids, prompt and (shortened) response."""
        response = self.response if len(self.response) <= 80 else self.response[:77] + "..."
        return f"prompt {self.prompt_id} sample {self.sample_index} (prompt {self.prompt!r}, response {response!r})"


RewardFn = Callable[[Sequence[RewardSample]], Sequence[float]]
"""A rule-based reward: a batch of samples -> one finite score per sample, in order."""


class RewardError(ValueError):
    """A reward function failed; the message names the function (its config key and value) and the sample."""


class NonFiniteRewardError(NonFiniteError):
    """A reward function returned NaN or inf; the message names the function and the sample (the trainer adds
    the iteration and stops before training)."""

    def __init__(self, message: str, value: float) -> None:
        super().__init__(message)
        self.value = value


def reward_samples(
    rollout: Rollout, tokenizer: Decoder, rows: Sequence[Mapping[str, Any]] = ()
) -> list[RewardSample]:
    """The rollout's samples as records; `rows[prompt_id]` are the dataset row's fields (none if `rows` is
    empty)."""
    out = []
    for b, (prompt_ids, response_ids, n, prompt_id, sample_index, finished) in enumerate(
        zip(
            rollout.prompt_ids_BP.cpu(),
            rollout.response_ids_BR.cpu(),
            rollout.response_lengths_B.cpu().tolist(),
            rollout.prompt_index_B.cpu().tolist(),
            rollout.sample_index_B.cpu().tolist(),
            rollout.finished_B.cpu().tolist(),
            strict=True,
        )
    ):
        if rows and not 0 <= prompt_id < len(rows):
            raise IndexError(f"sample {b}: prompt id {prompt_id} is outside the dataset's {len(rows)} rows")
        ids = tuple(response_ids[: int(n)].tolist())
        out.append(
            RewardSample(
                prompt=tokenizer.decode(prompt_ids.tolist()),
                response=tokenizer.decode(list(ids)),
                response_ids=ids,
                finished=bool(finished),
                fields=rows[prompt_id] if rows else {},
                prompt_id=int(prompt_id),
                sample_index=int(sample_index),
            )
        )
    return out


@dataclass(frozen=True)
class RuleReward:
    """A reward function with the name it was chosen by; calling it checks what the function returns.

    A function that raises is called again one sample at a time to name the first sample it fails on; a wrong
    number of scores, a score that is not a number, or a non-finite score are errors naming the sample.
    `needs` lists the dataset fields the function reads (checked against every row before training starts);
    `name` is what its metrics are logged under, `spec` how the config chose it (errors quote it; default `name`).
    """

    name: str
    fn: RewardFn
    key: str = "inferencer.reward_fn"
    needs: tuple[str, ...] = ()
    spec: str = ""

    def __call__(self, samples: Sequence[RewardSample]) -> Tensor:
        """Scores [len(samples)] (float32)."""
        where = f"{self.key}={(self.spec or self.name)!r}"
        try:
            scores = list(self.fn(samples))
        except Exception as err:
            raise RewardError(f"{where} raised {self._first_failure(samples, err)}") from err
        if len(scores) != len(samples):
            raise RewardError(
                f"{where} returned {len(scores)} scores for {len(samples)} samples: return one score per sample, "
                "in order"
            )
        values = []
        for sample, score in zip(samples, scores, strict=True):
            try:
                value = float(score)
            except (TypeError, ValueError):
                raise RewardError(
                    f"{where} returned {score!r} (not a number) for {sample.describe()}"
                ) from None
            if not math.isfinite(value):
                raise NonFiniteRewardError(
                    f"{where} returned the non-finite score {value} for {sample.describe()}", value
                )
            values.append(value)
        return torch.tensor(values, dtype=torch.float32)

    def _first_failure(self, samples: Sequence[RewardSample], err: Exception) -> str:
        for sample in samples:
            try:
                self.fn([sample])
            except Exception as single:
                return f"{type(single).__name__}: {single} on {sample.describe()}"
        return f"{type(err).__name__}: {err} on a batch of {len(samples)} samples (each alone passes)"

    def check_rows(self, rows: Sequence[Mapping[str, Any]], source: str) -> None:
        """Every dataset row holds the fields this function reads; else an error naming the row and the field."""
        for i, row in enumerate(rows):
            missing = [key for key in self.needs if key not in row]
            if missing:
                raise RewardError(
                    f"{self.key}={(self.spec or self.name)!r} reads the field {missing[0]!r} of each dataset row, but row {i} of "
                    f"{source} has only {sorted(row)}: add {missing[0]!r} to every row, or choose a reward function "
                    "that needs no such field"
                )


@dataclass(frozen=True)
class RewardSet:
    """The run's rule-based rewards (`inferencer.reward_fn`, one or a list) with their weights
    (`inferencer.reward_weights`): calling it scores every sample with every function, and `combine` is the
    weighted sum the training signal adds (like TRL's `reward_funcs` + `reward_weights`)."""

    rules: tuple[RuleReward, ...]
    weights: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.rules) != len(self.weights):
            raise ValueError(f"{len(self.rules)} reward functions but {len(self.weights)} weights")
        names = [rule.name for rule in self.rules]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(
                f"inferencer.reward_fn names {twice[0]!r} twice: each function's metrics are logged under its "
                "name (reward/<name>/mean); list each function once"
            )

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(rule.name for rule in self.rules)

    def __call__(self, samples: Sequence[RewardSample]) -> Tensor:
        """Each function's scores, float32 [len(samples), K] (column k: function k, unweighted)."""
        columns = [rule(samples) for rule in self.rules]
        return torch.stack(columns, dim=1) if columns else torch.zeros(len(samples), 0)

    def combine(self, scores_BK: Tensor) -> Tensor:
        """The weighted sum [B] of the functions' scores [B, K]."""
        weights_K = torch.tensor(self.weights, dtype=scores_BK.dtype, device=scores_BK.device)
        return scores_BK @ weights_K

    def check_rows(self, rows: Sequence[Mapping[str, Any]], source: str) -> None:
        """Every dataset row holds the fields each function reads (`RuleReward.check_rows`)."""
        for rule in self.rules:
            rule.check_rows(rows, source)
