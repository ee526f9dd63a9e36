"""Inference stage: one forward pass of each model over every generated sample.

Actor log-probs (PPO's "old" log-probs), Ref log-probs (for the KL penalty), Critic values (zeros, without any
Critic forward, for a critic-free algorithm) and the reward score, read at the last valid token of each sample
(plus the rule-based rewards chosen by name, each function's own scores kept for its metrics).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import Tensor

from rlhfuse.core.inference import (
    InferencerConfig,
    Scores,
    final_scores,
    packing_of,
    response_logprobs,
    response_values,
    sequence_scores,
)
from rlhfuse.core.optim import token_groups
from rlhfuse.core.rewards import RewardSet
from rlhfuse.core.types import Experience, FrozenInference, Rollout
from rlhfuse.data.tokenizer import Tokenizer
from rlhfuse.models import Transformer
from rlhfuse.models.lora import adapters_disabled
from rlhfuse.models.packing import check_packing
from rlhfuse.trainer.offload import OffloadedModel


class ModelInferencer:
    """Runs Actor, Ref, Critic and Reward forward passes; Actor and Critic are the strategy's live modules."""

    def __init__(
        self,
        config: InferencerConfig,
        *,
        actor: Transformer,
        ref: Transformer,
        critic: Transformer | None,
        reward_model: Transformer | None,
        rewards: RewardSet | None,
        tokenizer: Tokenizer,
        temperature: float,
        autocast: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext,
        rows: Sequence[Mapping[str, Any]] = (),
        packing: bool = False,
        micro_batch_tokens: int = 0,
    ) -> None:
        self.config = config
        self.actor, self.ref, self.critic, self.reward_model = actor, ref, critic, reward_model
        self.rewards = rewards
        # the dataset rows' fields by prompt id, for the reward function's records (e.g. the reference answer)
        self.rows = rows
        self.tokenizer = tokenizer
        self.temperature = temperature if temperature > 0 else 1.0
        self.autocast = autocast
        # packed forward passes (rlhfuse.models.packing): the models run on real tokens only
        self.packing = packing
        # a token budget per forward (data.micro_batch_tokens), used unless inferencer.micro_batch_size is set
        self.micro_batch_tokens = micro_batch_tokens
        if packing:
            check_packing([actor, ref, critic, reward_model])
        device = next(actor.parameters()).device
        # a LoRA Actor is its own Reference (`adapters_disabled`): trained, so never offloaded
        frozen = (ref, reward_model) if config.offload_frozen else ()
        self.offloaded = [OffloadedModel(m, device) for m in frozen if m is not None and m is not actor]

    def prefetch(self) -> None:
        """Start swapping the frozen models' weights onto the device (overlapped with the generation tail)."""
        for model in self.offloaded:
            model.prefetch()

    def release(self) -> None:
        """After the rollout's last inference: the frozen models' weights back to host memory only."""
        for model in self.offloaded:
            model.release()

    @torch.no_grad()
    def infer(self, rollout: Rollout) -> Experience:
        """Every model's forward pass over `rollout`, in groups of rows (`groups`), the results in row order on
        the models' device (rewards, KL and GAE, the Triton kernel on CUDA, run there)."""
        rollout = rollout.to(next(self.actor.parameters()).device)
        return Experience(rollout, *self._over_groups(rollout, self._every_model))

    @torch.no_grad()
    def infer_frozen(self, rollout: Rollout) -> FrozenInference:
        """The Ref and Reward models' (and the rule rewards') part of `infer` (`SplitInferencer`), in the same
        groups of rows: the Actor and the Critic do not run."""
        rollout = rollout.to(next(self.actor.parameters()).device)
        return FrozenInference(*self._over_groups(rollout, self._frozen))

    @torch.no_grad()
    def infer_live(self, rollout: Rollout, frozen: FrozenInference) -> Experience:
        """`infer`, with the frozen models' part given (`infer_frozen`'s, computed elsewhere): the Actor's and the
        Critic's forward passes only, in the same groups of rows."""
        device = next(self.actor.parameters()).device
        rollout = rollout.to(device)
        logprobs_BR, values_BR = self._over_groups(rollout, self._live)
        ref_logprobs_BR, scores_B, rules_BK = (t.to(device) for t in dataclasses.astuple(frozen))
        return Experience(rollout, logprobs_BR, ref_logprobs_BR, values_BR, scores_B, rules_BK)

    def _over_groups(
        self, rollout: Rollout, forward: Callable[[Rollout], tuple[Tensor, ...]]
    ) -> list[Tensor]:
        """`forward` over each of `groups(rollout)` (rows of `rollout`, on the models' device), its results placed
        back in row order."""
        groups = self.groups(rollout)
        if groups == [list(range(len(rollout)))]:  # one forward of every row in order: nothing to place
            return list(forward(rollout))
        device = rollout.response_ids_BR.device
        out: list[Tensor] = []
        for g in groups:
            index_G = torch.tensor(g, device=device)
            part = forward(rollout.select(index_G))
            if not out:
                out = [torch.zeros((len(rollout), *p.shape[1:]), dtype=p.dtype, device=device) for p in part]
            for whole, piece in zip(out, part, strict=True):
                whole[index_G] = piece
        return out

    @torch.no_grad()
    def score(self, rollout: Rollout) -> Tensor:
        """The reward stage alone (`rlhfuse.core.protocols.Scorer`): each sample's sequence score as `infer`
        gives it, on the models' device; the Actor, Ref and Critic do not run."""
        device = next(self.actor.parameters()).device
        rollout = rollout.to(device)
        kw: dict[str, Any] = {}
        if self.reward_model is not None:
            for model in self.offloaded:
                model.acquire()
            kw = self._forward_kw(rollout)
        return self._scores(rollout, kw).total_B.to(device)

    def _scores(self, rollout: Rollout, kw: dict[str, Any]) -> Scores:
        """The sequence scores of `rollout` (`final_scores`: the reward model's, under autocast, and the rules')."""
        rm_scores_B = None
        if self.reward_model is not None:
            with self.autocast():
                rm_scores_B = sequence_scores(self.reward_model, rollout, **kw)
        return final_scores(self.config, rollout, rm_scores_B, self.rewards, self.tokenizer, self.rows)

    def groups(self, rollout: Rollout, rows: Sequence[int] | None = None) -> list[list[int]]:
        """The rows of `rollout` (or its `rows`) each forward pass takes: groups of at most `micro_batch_tokens`
        real tokens (`token_groups`) unless inferencer.micro_batch_size is set, else consecutive runs of
        inferencer.micro_batch_size rows (all of them at 0). Read on the host: no device sync."""
        rows = list(range(len(rollout))) if rows is None else list(rows)
        if self.micro_batch_tokens > 0 and self.config.micro_batch_size == 0:
            lengths = rollout.attention_mask_BT.sum(dim=1).tolist()
            return [
                [rows[i] for i in g]
                for g in token_groups([lengths[r] for r in rows], self.micro_batch_tokens)
            ]
        size = self.config.micro_batch_size or max(len(rows), 1)
        return [rows[start : start + size] for start in range(0, len(rows), size)]

    def infer_rows(self, rollout: Rollout, index_G: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """One forward pass of each model over the rows `index_G` of `rollout` (on the models' device): their
        Actor and Ref log-probs, values, scores and rule scores."""
        return self._every_model(rollout.select(index_G).to(next(self.actor.parameters()).device))

    def _every_model(self, rollout: Rollout) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        kw = self._forward_kw(rollout)
        logprobs_BR, values_BR = self._live(rollout, kw)
        ref_logprobs_BR, scores_B, rules_BK = self._frozen(rollout, kw)
        return logprobs_BR, ref_logprobs_BR, values_BR, scores_B, rules_BK

    def _forward_kw(self, rollout: Rollout) -> dict[str, Any]:
        """The forward passes' packing arguments: the mask packed once for the (up to) four models (pack_rows
        reads the mask on the host)."""
        return dict(packing=self.packing, packed=packing_of(rollout) if self.packing else None)

    def _live(self, rollout: Rollout, kw: dict[str, Any] | None = None) -> tuple[Tensor, Tensor]:
        """The Actor's log-probs and the Critic's values (zeros without a Critic) over `rollout`, masked."""
        kw = self._forward_kw(rollout) if kw is None else kw
        live = [self.actor] if self.critic is None else [self.actor, self.critic]
        training = [model.training for model in live]
        for live_model in live:
            live_model.eval()
        with self.autocast():
            logprobs_BR = response_logprobs(self.actor, rollout, self.temperature, **kw)
            values_BR = (
                torch.zeros_like(logprobs_BR)
                if self.critic is None
                else response_values(self.critic, rollout, **kw)
            )
        for live_model, mode in zip(live, training, strict=True):
            live_model.train(mode)
        mask_BR = rollout.response_mask_BR.float()
        return logprobs_BR * mask_BR, values_BR * mask_BR

    def _frozen(self, rollout: Rollout, kw: dict[str, Any] | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """The Ref log-probs (masked), the sequence scores and the rule scores over `rollout`."""
        kw = self._forward_kw(rollout) if kw is None else kw
        for model in self.offloaded:
            model.acquire()
        with self.autocast(), adapters_disabled(self.ref):  # a LoRA Actor as the Reference: the SFT model's
            ref_logprobs_BR = response_logprobs(self.ref, rollout, self.temperature, **kw)
        scores = self._scores(rollout, kw)
        device = ref_logprobs_BR.device
        return (
            ref_logprobs_BR * rollout.response_mask_BR.float(),
            scores.total_B.to(device),
            scores.rules_BK.to(device),
        )
