"""Typed data passed between the stages of one PPO iteration.

Shape legend (tensor names carry these suffixes):
    B  samples (prompts_per_iteration * samples_per_prompt in a full iteration)
    P  prompt length (prompts are LEFT-padded to the longest prompt of the batch)
    R  response length (responses are RIGHT-padded to the longest response of the batch)
    T  P + R, the full sequence fed to the models
    V  vocabulary

Sequence layout of row b:  [pad .. pad | prompt tokens | response tokens (EOS last if it stopped) | pad .. pad]
so `response_*_BR[:, r]` is aligned with `input_ids_BT[:, P + r]`, and the model output at position P + r - 1
predicts response token r.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import Tensor

_D = TypeVar("_D")


class ModelRole(str, enum.Enum):
    """The four models of RLHF. A `str` enum: `ModelRole.ACTOR == "actor"`, so it keys configs, checkpoint
    files and metric names with the same spelling as before."""

    ACTOR = "actor"
    REF = "ref"
    CRITIC = "critic"
    REWARD = "reward"

    def __str__(self) -> str:
        return self.value


def _tensors_to(obj: _D, device: torch.device | str) -> _D:
    """A copy of the stage dataclass `obj` with every tensor field (and nested stage data) on `device`."""
    changes = {}
    for f in dataclasses.fields(obj):  # type: ignore[arg-type]
        value = getattr(obj, f.name)
        changes[f.name] = None if value is None else value.to(device)
    return dataclasses.replace(obj, **changes)  # type: ignore[type-var]


def _rows(x: Tensor, index_B: Tensor) -> Tensor:
    """The rows `index_B` of `x`, the index moved to `x`'s device (a stage's tensors may sit on two devices)."""
    return x[index_B.to(x.device)]


def _cat_right_padded(tensors: list[Tensor], pad: float | int) -> Tensor:
    width = max(t.shape[1] for t in tensors)
    return torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1]), value=pad) for t in tensors])


def _cat_left_padded(tensors: list[Tensor], pad: float | int) -> Tensor:
    width = max(t.shape[1] for t in tensors)
    return torch.cat([torch.nn.functional.pad(t, (width - t.shape[1], 0), value=pad) for t in tensors])


@dataclass
class PromptBatch:
    """Prompts of one iteration, left-padded.

    input_ids_BP: long [B, P]; attention_mask_BP: long [B, P] (1 = real token);
    prompt_ids_B: long [B], each prompt's id in the dataset (used to seed per-sample RNG).
    """

    input_ids_BP: Tensor
    attention_mask_BP: Tensor
    prompt_ids_B: Tensor

    def to(self, device: torch.device | str) -> PromptBatch:
        """This PromptBatch with every tensor on `device`."""
        return _tensors_to(self, device)

    def __len__(self) -> int:
        return int(self.input_ids_BP.shape[0])

    def select(self, index_B: Tensor) -> PromptBatch:
        """The prompts `index_B` (bool mask or indices), in that order, their padding trimmed to the longest."""
        mask_BP = _rows(self.attention_mask_BP, index_B)
        cut = self.input_ids_BP.shape[1] - (int(mask_BP.sum(dim=1).max()) if len(mask_BP) else 0)
        return PromptBatch(
            _rows(self.input_ids_BP, index_B)[:, cut:], mask_BP[:, cut:], _rows(self.prompt_ids_B, index_B)
        )

    @staticmethod
    def cat(batches: list[PromptBatch], pad_id: int) -> PromptBatch:
        """Concatenate prompt batches, left-padded to the longest prompt."""
        if len(batches) == 1:
            return batches[0]
        return PromptBatch(
            _cat_left_padded([b.input_ids_BP for b in batches], pad_id),
            _cat_left_padded([b.attention_mask_BP for b in batches], 0),
            torch.cat([b.prompt_ids_B for b in batches]),
        )


EPISODE_COLUMNS = ("turns", "tool_calls", "tool_errors", "tool_seconds", "truncated")
"""The columns of `Rollout.episodes_BE`, in order."""


@dataclass
class Rollout:
    """Generated samples (each row one response to one prompt).

    prompt_ids_BP / prompt_mask_BP: long [B, P], left-padded prompts;
    response_ids_BR / response_mask_BR: long [B, R], right-padded responses (mask 1 on generated tokens, EOS
    included); prompt_index_B: long [B], the dataset id of the row's prompt; sample_index_B: long [B], which of
    the prompt's samples this is; finished_B: bool [B], True if the response ended with an EOS/stop token;
    sampler_logprobs_BR: float32 [B, R], the log-prob the sampler gave each response token, log softmax(logits /
    temperature) over the whole vocabulary (temperature 1 for greedy), 0 on padding — what the trainer's
    recomputation is compared with (`rollout/logprob_abs_diff`); None from a generator that records none.
    versions_BR: long [B, R], the Actor version (iterations trained) whose weights sampled each response token, 0
    on padding; None where generation never runs ahead of training (synchronous: every token from the version
    before the iteration's training). Set by the asynchronous rollout (`rlhfuse.trainer.asynchronous`).
    trainable_mask_BR: long [B, R], 1 on the response tokens the model generated, 0 on tokens inside the response
    that it did not (a multi-turn episode's environment and tool messages, `rlhfuse.agents`): those stay in the
    context (`response_mask_BR`, the attention) but carry no loss, no KL and no advantage (`loss_mask_BR`); None:
    every response token is the model's.
    env_reward_B: float [B], the reward an environment gave each sample's episode (the sum of its turns'), added
    to what the inferencer scores; None: no environment.
    episodes_BE: float32 [B, E], what each sample's episode did, one column per name of `EPISODE_COLUMNS` (assistant
    turns, tool calls, tool calls answered with an error, seconds its tool calls ran, 1.0 where it ended at the
    trajectory's token bound); None: no environment.
    """

    prompt_ids_BP: Tensor
    prompt_mask_BP: Tensor
    response_ids_BR: Tensor
    response_mask_BR: Tensor
    prompt_index_B: Tensor
    sample_index_B: Tensor
    finished_B: Tensor
    sampler_logprobs_BR: Tensor | None = None
    versions_BR: Tensor | None = None
    trainable_mask_BR: Tensor | None = None
    env_reward_B: Tensor | None = None
    episodes_BE: Tensor | None = None

    @property
    def loss_mask_BR(self) -> Tensor:
        """The response tokens the loss, the KL and the advantages count: the model's own (`trainable_mask_BR`),
        or every response token."""
        return self.response_mask_BR if self.trainable_mask_BR is None else self.trainable_mask_BR

    def to(self, device: torch.device | str) -> Rollout:
        """This Rollout with every tensor on `device`."""
        return _tensors_to(self, device)

    def __len__(self) -> int:
        return int(self.response_ids_BR.shape[0])

    @property
    def input_ids_BT(self) -> Tensor:
        return torch.cat([self.prompt_ids_BP, self.response_ids_BR], dim=1)

    @property
    def attention_mask_BT(self) -> Tensor:
        return torch.cat([self.prompt_mask_BP, self.response_mask_BR], dim=1)

    @property
    def response_lengths_B(self) -> Tensor:
        return self.response_mask_BR.sum(dim=1)

    def select(self, index_B: Tensor) -> Rollout:
        """The rows `index_B` (bool mask or indices), in that order (widths unchanged)."""
        rows: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            rows[f.name] = None if value is None else _rows(value, index_B)
        return Rollout(**rows)

    def responses_cut(self, width: int) -> Rollout:
        """This rollout with its response columns cut to the first `width` (the trailing padding dropped)."""
        if width == self.response_ids_BR.shape[1]:
            return self
        logprobs_BR, versions_BR, trainable_BR = (
            self.sampler_logprobs_BR,
            self.versions_BR,
            self.trainable_mask_BR,
        )
        return dataclasses.replace(
            self,
            response_ids_BR=self.response_ids_BR[:, :width],
            response_mask_BR=self.response_mask_BR[:, :width],
            sampler_logprobs_BR=None if logprobs_BR is None else logprobs_BR[:, :width],
            versions_BR=None if versions_BR is None else versions_BR[:, :width],
            trainable_mask_BR=None if trainable_BR is None else trainable_BR[:, :width],
        )

    @staticmethod
    def cat(rollouts: list[Rollout], pad_id: int) -> Rollout:
        """Concatenate rollouts (e.g. chunks streamed by a generator), re-padding to common widths."""
        if len(rollouts) == 1:
            return rollouts[0]
        return Rollout(
            prompt_ids_BP=_cat_left_padded([r.prompt_ids_BP for r in rollouts], pad_id),
            prompt_mask_BP=_cat_left_padded([r.prompt_mask_BP for r in rollouts], 0),
            response_ids_BR=_cat_right_padded([r.response_ids_BR for r in rollouts], pad_id),
            response_mask_BR=_cat_right_padded([r.response_mask_BR for r in rollouts], 0),
            prompt_index_B=torch.cat([r.prompt_index_B for r in rollouts]),
            sample_index_B=torch.cat([r.sample_index_B for r in rollouts]),
            finished_B=torch.cat([r.finished_B for r in rollouts]),
            sampler_logprobs_BR=_cat_optional([r.sampler_logprobs_BR for r in rollouts]),
            versions_BR=_cat_optional([r.versions_BR for r in rollouts]),
            trainable_mask_BR=_cat_optional([r.trainable_mask_BR for r in rollouts]),
            env_reward_B=_cat_rows([r.env_reward_B for r in rollouts]),
            episodes_BE=_cat_rows([r.episodes_BE for r in rollouts]),
        )

    def with_version(self, version: int) -> Rollout:
        """This rollout with every response token marked as sampled by Actor version `version`."""
        mask_BR = self.loss_mask_BR.long()
        return dataclasses.replace(self, versions_BR=mask_BR * version)


def _cat_rows(tensors: list[Tensor | None]) -> Tensor | None:
    """Per-row tensors ([B] or [B, E]) of a field some rollouts may lack, stacked (None when any lacks it)."""
    if any(t is None for t in tensors):
        return None
    return torch.cat(tensors)  # type: ignore[arg-type]


def _cat_optional(tensors: list[Tensor | None]) -> Tensor | None:
    """[B, R] tensors of a field some rollouts may lack, right-padded with 0 (None when any lacks it)."""
    if any(t is None for t in tensors):
        return None
    return _cat_right_padded(tensors, 0)  # type: ignore[arg-type]


@dataclass
class FrozenInference:
    """What the frozen models give a rollout (`SplitInferencer.infer_frozen`): the Ref log-probs (masked to the
    response) and the sequence scores (reward model and/or rules, `Experience.scores_B`), with each rule's own
    scores. Computed where the rollout was generated (the split placement's generation rank), the rest of its
    inference (`SplitInferencer.infer_live`) where it is trained."""

    ref_logprobs_BR: Tensor
    scores_B: Tensor
    rule_scores_BK: Tensor


@dataclass
class Experience:
    """A rollout plus what the inference stage computed for it. All [B, R] tensors are float32, aligned with
    `rollout.response_ids_BR` and meaningful where `rollout.response_mask_BR` is 1.

    logprobs_BR: Actor log-probs of the response tokens (the PPO "old" log-probs);
    ref_logprobs_BR: Ref log-probs; values_BR: Critic values V(s_t) before each response token;
    scores_B: float32 [B], the sequence-level reward (reward model and/or rule), given at the last valid token;
    rule_scores_BK: float32 [B, K], each of the K rule-based reward functions' own score (unweighted; for their
    metrics), None where none was kept.
    """

    rollout: Rollout
    logprobs_BR: Tensor
    ref_logprobs_BR: Tensor
    values_BR: Tensor
    scores_B: Tensor
    rule_scores_BK: Tensor | None = None

    @staticmethod
    def cat(parts: list[Experience], pad_id: int) -> Experience:
        """Concatenate experiences (e.g. of chunks inferred as they streamed in), re-padding to common widths."""
        if len(parts) == 1:
            return parts[0]
        return Experience(
            rollout=Rollout.cat([p.rollout for p in parts], pad_id),
            logprobs_BR=_cat_right_padded([p.logprobs_BR for p in parts], 0),
            ref_logprobs_BR=_cat_right_padded([p.ref_logprobs_BR for p in parts], 0),
            values_BR=_cat_right_padded([p.values_BR for p in parts], 0),
            scores_B=torch.cat([p.scores_B for p in parts]),
            rule_scores_BK=(
                None
                if any(p.rule_scores_BK is None for p in parts)
                else torch.cat([p.rule_scores_BK for p in parts if p.rule_scores_BK is not None])
            ),
        )

    def to(self, device: torch.device | str) -> Experience:
        """This Experience with every tensor on `device`."""
        return _tensors_to(self, device)

    def select(self, index_B: Tensor) -> Experience:
        """The rows `index_B` (bool mask or indices), in that order (widths unchanged)."""
        return Experience(
            rollout=self.rollout.select(index_B),
            logprobs_BR=_rows(self.logprobs_BR, index_B),
            ref_logprobs_BR=_rows(self.ref_logprobs_BR, index_B),
            values_BR=_rows(self.values_BR, index_B),
            scores_B=_rows(self.scores_B, index_B),
            rule_scores_BK=None if self.rule_scores_BK is None else _rows(self.rule_scores_BK, index_B),
        )

    def __len__(self) -> int:
        return len(self.rollout)


@dataclass
class TrainBatch:
    """What the training stage consumes: one iteration's samples (or a mini/micro-batch of them).

    input_ids_BT / attention_mask_BT: long [B, T]; response_mask_BR: float [B, R] (1 on response tokens);
    old_logprobs_BR, old_values_BR, advantages_BR, returns_BR: float32 [B, R] (old values are 0 for an
    algorithm without a Critic, which trains on no returns); ref_logprobs_BR: float32 [B, R], the Ref log-probs, present only when the KL
    enters the loss (algorithm.kl_loss_coef > 0), else None.
    The response occupies the last R columns of the T-long sequence.
    """

    input_ids_BT: Tensor
    attention_mask_BT: Tensor
    response_mask_BR: Tensor
    old_logprobs_BR: Tensor
    old_values_BR: Tensor
    advantages_BR: Tensor
    returns_BR: Tensor
    ref_logprobs_BR: Tensor | None = None
    behaviour_logprobs_BR: Tensor | None = None
    """The sampler's log-probs of the response tokens (`Rollout.sampler_logprobs_BR`), float32 [B, R], present
    only when the loss corrects for the sampler's policy (algorithm.off_policy_correction), else None."""
    host_mask_BT: Tensor | None = None
    """The attention mask's copy in host memory (bool [B, T]) when the batch carries one (`with_host_mask`):
    splitting, trimming, loss weights and mask layouts then read it, not the device's (no host sync). `to` and
    `select` keep it on the host."""

    def to(self, device: torch.device | str) -> TrainBatch:
        """This TrainBatch with every tensor on `device` (the host mask stays on the host)."""
        moved = _tensors_to(dataclasses.replace(self, host_mask_BT=None), device)
        return dataclasses.replace(moved, host_mask_BT=self.host_mask_BT)

    def host_mask(self) -> Tensor:
        """The attention mask in host memory (bool [B, T]): the carried copy, else a copy of the mask (a host
        read when the batch is on a device)."""
        if self.host_mask_BT is not None:
            return self.host_mask_BT
        return self.attention_mask_BT.to("cpu", torch.bool)

    def with_host_mask(self) -> TrainBatch:
        """This batch carrying its host mask: made once (one read of a device batch), every split of it reads no
        mask value from the device after."""
        return (
            self
            if self.host_mask_BT is not None
            else dataclasses.replace(self, host_mask_BT=self.host_mask())
        )

    def host_lengths(self) -> list[int]:
        """Each row's real tokens, read from the host mask."""
        lengths: list[int] = self.host_mask().sum(dim=1).tolist()
        return lengths

    def host_response_tokens(self) -> int:
        """The response tokens of all rows, read from the host mask (the response is its last R columns)."""
        host_BT = self.host_mask()
        return int(host_BT[:, host_BT.shape[1] - self.response_length :].sum())

    def __len__(self) -> int:
        return int(self.input_ids_BT.shape[0])

    @property
    def response_length(self) -> int:
        return int(self.response_mask_BR.shape[1])

    def select(self, index_B: Tensor) -> TrainBatch:
        """The rows `index_B`, with trailing all-padding response columns trimmed (less compute, same result);
        the widths are read from the host mask when the batch carries one."""
        host_BT = None if self.host_mask_BT is None else self.host_mask_BT[index_B.cpu()]
        device_rows = dataclasses.replace(self, host_mask_BT=None)
        rows = TrainBatch(
            **{  # type: ignore[arg-type]
                f.name: None
                if getattr(device_rows, f.name) is None
                else getattr(device_rows, f.name)[index_B]
                for f in dataclasses.fields(device_rows)
            }
        )
        rows.host_mask_BT = host_BT
        response_BR = (
            rows.response_mask_BR
            if host_BT is None
            else host_BT[:, host_BT.shape[1] - rows.response_length :]
        )
        keep = int(response_BR.sum(dim=0).nonzero().max()) + 1 if response_BR.any() else 1
        drop = rows.response_length - keep
        if drop == 0:
            return rows
        return TrainBatch(
            input_ids_BT=rows.input_ids_BT[:, : rows.input_ids_BT.shape[1] - drop],
            attention_mask_BT=rows.attention_mask_BT[:, : rows.attention_mask_BT.shape[1] - drop],
            response_mask_BR=rows.response_mask_BR[:, :keep],
            old_logprobs_BR=rows.old_logprobs_BR[:, :keep],
            old_values_BR=rows.old_values_BR[:, :keep],
            advantages_BR=rows.advantages_BR[:, :keep],
            returns_BR=rows.returns_BR[:, :keep],
            ref_logprobs_BR=None if rows.ref_logprobs_BR is None else rows.ref_logprobs_BR[:, :keep],
            behaviour_logprobs_BR=(
                None if rows.behaviour_logprobs_BR is None else rows.behaviour_logprobs_BR[:, :keep]
            ),
            host_mask_BT=None if host_BT is None else host_BT[:, : host_BT.shape[1] - drop],
        )

    @property
    def num_tokens(self) -> int:
        return int(self.host_mask().sum())
