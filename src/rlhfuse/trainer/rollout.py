"""Step 1 of an iteration, the rollout (generation + inference), in its two forms (`RolloutStage`):

- `SerialRollout`: the generator yields chunks of finished samples and the inferencer runs Ref / Reward / Critic
  on each chunk as it arrives (one process, or every process generating the whole batch);
- `FusedRollout`: inter-stage fusion across processes (RLHFuse §2) — each rank is one generation instance, the
  long tail migrates to a few instances and the freed ones infer finished samples while it completes.

`build_trainer` chooses one of them once (`rollout_stage`); the trainer only calls `run`. With dynamic sampling
on (`data.oversample`), `DynamicSampling` runs the chosen one in rounds until the batch holds only groups whose
rewards differ (`training_rollout`; held-out evaluation uses the stage itself).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from rlhfuse.algorithms import varied_groups
from rlhfuse.core.protocols import FusingGenerator, Generator, Inferencer, RolloutStage, StageHook
from rlhfuse.core.sampling import Sampling
from rlhfuse.core.stats import DynamicSamplingStats, RolloutStats
from rlhfuse.core.streamed_rollout import no_stage_hook, streamed_rollout
from rlhfuse.core.types import Experience, PromptBatch
from rlhfuse.data.collate import collate_prompts
from rlhfuse.data.data_config import DataConfig
from rlhfuse.data.prompts import PromptLoader


class Stateless:
    """A rollout stage that holds no work beyond the iteration it returns: nothing to checkpoint."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def restore(self, state: Mapping[str, Any], iteration: int) -> None:
        """Nothing to restore."""


class SerialRollout(Stateless):
    """Generate, and infer each chunk of finished samples as the generator streams it."""

    def __init__(self, generator: Generator, inferencer: Inferencer, *, pad_token_id: int) -> None:
        self.generator, self.inferencer = generator, inferencer
        self.pad_token_id = pad_token_id

    def run(
        self,
        prompts: PromptBatch,
        iteration: int,
        on_stage: StageHook | None = None,
        sampling: Sampling | None = None,
    ) -> tuple[Experience, RolloutStats]:
        return streamed_rollout(
            self.generator, self.inferencer, prompts, iteration=iteration, pad_token_id=self.pad_token_id,
            on_stage=on_stage, sampling=sampling,
        )  # fmt: skip


class FusedRollout(Stateless):
    """Generation fused with inference by the generator itself, one generation instance per rank."""

    def __init__(self, generator: FusingGenerator, inferencer: Inferencer) -> None:
        self.generator, self.inferencer = generator, inferencer

    def run(
        self,
        prompts: PromptBatch,
        iteration: int,
        on_stage: StageHook | None = None,
        sampling: Sampling | None = None,
    ) -> tuple[Experience, RolloutStats]:
        (on_stage or no_stage_hook)("generation")
        return self.generator.fused_rollout(
            prompts, iteration=iteration, inferencer=self.inferencer, sampling=sampling
        )


class DynamicSamplingError(RuntimeError):
    """Every prompt of the dataset was tried in one iteration and too few of their groups had differing rewards."""


PromptDraw = Callable[[int], PromptBatch]
"""The next `count` prompts of the training data (the loader the iteration's own prompts come from)."""


class DynamicSampling(Stateless):
    """DAPO's dynamic sampling (Yu et al. 2025, arXiv 2503.14476, §3.2, eq. 11) over another rollout stage.

    `run` returns the Experience of exactly `groups` prompt groups whose rewards are not all equal
    (`rlhfuse.algorithms.varied_groups`): it runs the stage on ceil(`oversample` x `groups`) candidate prompts (the
    iteration's own, then prompts from `draw`), drops every group whose samples all scored alike, keeps the first
    varied groups in candidate order, and runs the stage again on ceil(`oversample` x missing) further candidates,
    round after round, until no group is missing. Each round is a whole rollout of the inner stage (its migration
    and fused inference as configured); every rank draws and decides alike, from the same Experience. What a
    dropped group, or a varied group beyond the batch, generated is `rollout/extra_tokens`. A prompt is a candidate
    once per iteration; when all `limit` prompts of the dataset have been, `DynamicSamplingError`. A rollout with its
    own `sampling` (held-out evaluation) runs the inner stage as it is.
    """

    def __init__(
        self,
        stage: RolloutStage,
        groups: int,
        *,
        oversample: float,
        draw: PromptDraw,
        limit: int,
        pad_token_id: int,
    ) -> None:
        if oversample < 1:
            raise ValueError(f"oversample={oversample}: dynamic sampling needs a factor >= 1")
        self.stage, self.groups, self.oversample = stage, groups, oversample
        self.draw, self.limit, self.pad_token_id = draw, limit, pad_token_id
        self._drawn = 0  # prompts drawn in the current iteration, its own included (repeats too)

    def run(
        self,
        prompts: PromptBatch,
        iteration: int,
        on_stage: StageHook | None = None,
        sampling: Sampling | None = None,
    ) -> tuple[Experience, RolloutStats]:
        if sampling is not None:
            return self.stage.run(prompts, iteration, on_stage, sampling)
        seen = set(prompts.prompt_ids_B.tolist())
        self._drawn = len(prompts)
        pending = prompts  # candidates not generated yet
        kept: list[Experience] = []
        rounds: list[RolloutStats] = []
        found = sampled = dropped = extra_tokens = 0
        while (missing := self.groups - found) > 0:
            want = math.ceil(self.oversample * missing)
            if len(pending) < want:
                pending = self._more(pending, want - len(pending), seen)
            if len(pending) == 0:
                raise DynamicSamplingError(
                    f"iteration {iteration}: dynamic sampling tried {len(seen)} of the dataset's {self.limit} "
                    f"prompts and found {found} of data.prompts_per_iteration={self.groups} groups whose rewards "
                    "differ: the policy scores nearly every prompt's samples alike; lower "
                    "data.prompts_per_iteration, or set data.oversample=0 to train on every group"
                )
            take = min(want, len(pending))
            experience, stats = self.stage.run(pending.select(torch.arange(take)), iteration, on_stage)
            pending = pending.select(torch.arange(take, len(pending)))
            rounds.append(stats)
            varied_B = _varied(experience)
            group_B = experience.rollout.prompt_index_B.to(varied_B.device)
            chosen = list(dict.fromkeys(group_B[varied_B].tolist()))[:missing]  # in candidate order
            chosen_B = varied_B & torch.isin(
                group_B, torch.tensor(chosen, dtype=group_B.dtype, device=group_B.device)
            )
            sampled += take
            dropped += take - len(set(group_B[varied_B].tolist()))
            found += len(chosen)
            lengths_B = experience.rollout.response_lengths_B
            extra_tokens += int(lengths_B[~chosen_B.to(lengths_B.device)].sum())
            if chosen:
                kept.append(experience.select(chosen_B))
        first = rounds[0]
        return Experience.cat(kept, self.pad_token_id), RolloutStats(
            generation_s=sum(r.generation_s for r in rounds),
            inference_s=sum(r.inference_s for r in rounds),
            generation_inference_s=(
                None
                if first.generation_inference_s is None
                else sum(r.generation_inference_s or 0.0 for r in rounds)
            ),
            generation=first.generation,  # the first round's: the full batch the migration policy is tuned on
            sampling=DynamicSamplingStats(
                groups_sampled=float(sampled),
                groups_dropped=float(dropped),
                extra_tokens=float(extra_tokens),
                rounds=float(len(rounds)),
            ),
        )

    def _more(self, pending: PromptBatch, count: int, seen: set[int]) -> PromptBatch:
        """`pending` and up to `count` prompts not yet candidates in this iteration, drawn while some prompt of the
        dataset has not been one (a prompt drawn again, past an epoch's end, is skipped: its samples would repeat;
        the draws stop at 3 x the dataset, which a loader's epochs cover)."""
        batches = [pending] if len(pending) else []
        while count > 0 and len(seen) < self.limit and self._drawn < 3 * self.limit:
            drawn = self.draw(min(count, self.limit - len(seen)))
            self._drawn += len(drawn)
            ids = drawn.prompt_ids_B.tolist()
            fresh = [b for b, p in enumerate(ids) if p not in seen]
            seen.update(ids)
            if fresh:
                batches.append(drawn.select(torch.tensor(fresh)))
                count -= len(fresh)
        return PromptBatch.cat(batches, self.pad_token_id) if batches else pending


def _varied(experience: Experience) -> torch.Tensor:
    return varied_groups(
        experience.scores_B, experience.rollout.prompt_index_B.to(experience.scores_B.device)
    )


def training_rollout(
    stage: RolloutStage, data: DataConfig, prompts: PromptLoader, pad_token_id: int
) -> RolloutStage:
    """The training iterations' rollout: `stage`, in `DynamicSampling`'s rounds when data.oversample is on (its
    extra candidates drawn from `prompts`, the loader of the iteration's own)."""
    if data.oversample == 0:
        return stage
    return DynamicSampling(
        stage,
        data.prompts_per_iteration,
        oversample=data.oversample,
        draw=lambda count: collate_prompts(prompts.take(count), pad_token_id),
        limit=len(prompts.prompts),
        pad_token_id=pad_token_id,
    )
