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
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from rlhfuse.algorithms import varied_groups
from rlhfuse.core.protocols import (
    FusingGenerator,
    Generator,
    Inferencer,
    OpeningGenerator,
    RolloutStage,
    Scorer,
    StageHook,
)
from rlhfuse.core.sampling import Sampling
from rlhfuse.core.stats import DynamicSamplingStats, RolloutStats
from rlhfuse.core.streamed_rollout import no_stage_hook, streamed_rollout
from rlhfuse.core.types import Experience, PromptBatch, Rollout
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


Filled = tuple[Experience, RolloutStats]
"""A dynamic-sampling rollout's batch of groups whose rewards differ, and its statistics."""

PromptDraw = Callable[[int], PromptBatch]
"""The next `count` prompts of the training data (the loader the iteration's own prompts come from)."""


class Candidates:
    """The prompts one iteration's dynamic sampling may generate: the iteration's own, then the next ones `draw`
    gives, each at most once per iteration (a prompt drawn again, past an epoch's end, is skipped: its samples
    would repeat); the draws stop once every one of the dataset's `limit` prompts has been a candidate, or at 3 x
    the dataset, which a loader's epochs cover."""

    def __init__(self, prompts: PromptBatch, draw: PromptDraw, limit: int, pad_token_id: int) -> None:
        self.pending = prompts  # candidates not generated yet
        self.seen = set(prompts.prompt_ids_B.tolist())
        self.draw, self.limit, self.pad_token_id = draw, limit, pad_token_id
        self._drawn = len(prompts)  # prompts drawn in this iteration, its own included (repeats too)

    def take(self, count: int) -> PromptBatch:
        """The next `count` candidates (fewer, or none, once the dataset is exhausted)."""
        batches = [self.pending] if len(self.pending) else []
        short = count - len(self.pending)
        while short > 0 and len(self.seen) < self.limit and self._drawn < 3 * self.limit:
            drawn = self.draw(min(short, self.limit - len(self.seen)))
            self._drawn += len(drawn)
            ids = drawn.prompt_ids_B.tolist()
            fresh = [b for b, p in enumerate(ids) if p not in self.seen]
            self.seen.update(ids)
            if fresh:
                batches.append(drawn.select(torch.tensor(fresh)))
                short -= len(fresh)
        pending = PromptBatch.cat(batches, self.pad_token_id) if batches else self.pending
        take = min(count, len(pending))
        self.pending = pending.select(torch.arange(take, len(pending)))
        return pending.select(torch.arange(take))

    def exhausted(self, iteration: int, found: int, groups: int) -> DynamicSamplingError:
        return DynamicSamplingError(
            f"iteration {iteration}: dynamic sampling tried {len(self.seen)} of the dataset's {self.limit} "
            f"prompts and found {found} of data.prompts_per_iteration={groups} groups whose rewards "
            "differ: the policy scores nearly every prompt's samples alike; lower "
            "data.prompts_per_iteration, or set data.oversample=0 to train on every group"
        )


class GroupTally:
    """What one iteration's dynamic sampling keeps of complete prompt groups: the first groups whose scores differ
    (`rlhfuse.algorithms.varied_groups`), up to the batch's `groups`; the rest is counted (dropped groups, and the
    tokens of every group generated but not kept)."""

    def __init__(self, groups: int) -> None:
        self.groups = groups
        self.found = self.sampled = self.dropped = self.extra_tokens = 0

    @property
    def missing(self) -> int:
        return self.groups - self.found

    def take(self, rollout: Rollout, scores_B: Tensor, groups: int) -> Tensor:
        """The rows of `rollout` (`groups` complete prompt groups, in candidate order) to keep, bool [B] on the
        host, decided from their `scores_B`."""
        group_B = rollout.prompt_index_B.cpu()
        varied_B = varied_groups(scores_B.cpu(), group_B)
        chosen = list(dict.fromkeys(group_B[varied_B].tolist()))[: self.missing]  # in candidate order
        chosen_B = varied_B & torch.isin(group_B, torch.tensor(chosen, dtype=group_B.dtype))
        self.sampled += groups
        self.dropped += groups - len(set(group_B[varied_B].tolist()))
        self.found += len(chosen)
        self.extra_tokens += int(rollout.response_lengths_B.cpu()[~chosen_B].sum())
        return chosen_B

    def stats(self, rounds: int) -> DynamicSamplingStats:
        return DynamicSamplingStats(
            groups_sampled=float(self.sampled),
            groups_dropped=float(self.dropped),
            extra_tokens=float(self.extra_tokens),
            rounds=float(rounds),
        )


class _GroupsFilled(Stateless):
    """What both forms of dynamic sampling share: the stage evaluation rollouts run through as they are, the
    batch's `groups`, the factor `oversample`, and the candidates' source (`draw`, over `limit` prompts)."""

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

    def run(
        self,
        prompts: PromptBatch,
        iteration: int,
        on_stage: StageHook | None = None,
        sampling: Sampling | None = None,
    ) -> tuple[Experience, RolloutStats]:
        if sampling is not None:  # held-out evaluation: every prompt, no filter
            return self.stage.run(prompts, iteration, on_stage, sampling)
        candidates = Candidates(prompts, self.draw, self.limit, self.pad_token_id)
        return self._filled(candidates, iteration, on_stage or no_stage_hook)

    def _filled(self, candidates: Candidates, iteration: int, on_stage: StageHook) -> Filled:
        """The Experience of `groups` varied groups from `candidates` (the iteration's own prompts first), and the
        rollout's statistics (each form its own)."""
        raise NotImplementedError


class DynamicSampling(_GroupsFilled):
    """DAPO's dynamic sampling (Yu et al. 2025, arXiv 2503.14476, §3.2, eq. 11) in rounds of another rollout stage
    (a stage whose generator cannot take prompts while it decodes: instances over processes, fused inference).

    `run` returns the Experience of exactly `groups` prompt groups whose rewards are not all equal
    (`GroupTally`): it runs the stage on ceil(`oversample` x `groups`) candidate prompts (`Candidates`: the
    iteration's own, then prompts from `draw`), drops every group whose samples all scored alike, keeps the first
    varied groups in candidate order, and runs the stage again on ceil(`oversample` x missing) further candidates,
    round after round, until no group is missing. Each round is a whole rollout of the inner stage (its migration
    and fused inference as configured); every rank draws and decides alike, from the same Experience. What a
    dropped group, or a varied group beyond the batch, generated is `rollout/extra_tokens`. When all `limit`
    prompts of the dataset have been candidates, `DynamicSamplingError`. A rollout with its own `sampling`
    (held-out evaluation) runs the inner stage as it is. `StreamedDynamicSampling` runs inside the rollout.
    """

    def _filled(self, candidates: Candidates, iteration: int, on_stage: StageHook) -> Filled:
        tally = GroupTally(self.groups)
        rounds: list[RolloutStats] = []
        kept: list[Experience] = []
        while tally.missing > 0:
            batch = candidates.take(math.ceil(self.oversample * tally.missing))
            if len(batch) == 0:
                raise candidates.exhausted(iteration, tally.found, self.groups)
            experience, stats = self.stage.run(batch, iteration, on_stage)
            rounds.append(stats)
            chosen_B = tally.take(experience.rollout, experience.scores_B, len(batch))
            if chosen_B.any():
                kept.append(experience.select(chosen_B.to(experience.scores_B.device)))
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
            sampling=tally.stats(len(rounds)),
        )


class StreamedDynamicSampling(_GroupsFilled):
    """DAPO's dynamic sampling (arXiv 2503.14476, §3.2, eq. 11) inside one rollout, on a generator whose batch
    stays open (`OpeningGenerator`: the engine's instances of this process, migration included, or the sampling
    generator's engine).

    `run` starts ceil(`oversample` x `groups`) candidate prompts (`Candidates`: the iteration's own, then prompts
    from `draw`); each prompt group is scored as soon as its last sample has finished (`scorer`: the reward stage
    alone), kept if its scores differ (`GroupTally`), dropped otherwise, and whenever fewer than
    ceil(`oversample` x missing) groups are decoding further candidates start beside them at once. Once `groups`
    varied groups are complete, whatever still decodes is dropped, and the kept groups, in candidate order, are
    inferred in one `inferencer.infer` call. A dropped group costs its own tokens and its scoring and nothing else:
    no round waits for the batch's tail, and no Actor, Ref or Critic forward runs for it. Every step is
    deterministic (the instances are stepped in turn in this process), so a repeat keeps the same groups.
    `rollout/sampling_rounds` is 1; a rollout with its own `sampling` (held-out evaluation) runs `stage`, the
    configured serial stage, as it is.
    """

    def __init__(
        self,
        stage: RolloutStage,
        generator: OpeningGenerator,
        inferencer: Inferencer,
        groups: int,
        *,
        samples_per_prompt: int,
        oversample: float,
        draw: PromptDraw,
        limit: int,
        prompt_width: int,
        pad_token_id: int,
        scorer: Callable[[Rollout], Tensor] | None = None,
    ) -> None:
        super().__init__(
            stage, groups, oversample=oversample, draw=draw, limit=limit, pad_token_id=pad_token_id
        )
        self.generator, self.inferencer = generator, inferencer
        self.scorer = scorer if scorer is not None else scores_of(inferencer)
        self.samples_per_prompt, self.prompt_width = samples_per_prompt, prompt_width

    def _filled(self, candidates: Candidates, iteration: int, on_stage: StageHook) -> Filled:
        tally = GroupTally(self.groups)
        width = max(self.prompt_width, candidates.pending.input_ids_BP.shape[1])
        capacity = math.ceil(self.oversample * self.groups) * self.samples_per_prompt
        batch = self.generator.open_rollout(iteration=iteration, capacity=capacity, prompt_width=width)
        kept: list[Rollout] = []
        order: list[Tensor] = []  # per kept part, each row's group number (candidate order)
        gen_s = inf_s = 0.0
        on_stage("generation")
        start = t0 = time.perf_counter()
        try:
            while tally.missing > 0:
                short = math.ceil(self.oversample * tally.missing) - batch.groups_open
                if short > 0:
                    batch.add(candidates.take(short))
                done = batch.finished()
                if done is None:
                    raise candidates.exhausted(iteration, tally.found, self.groups)
                groups, rollout = done
                t1 = time.perf_counter()
                gen_s += t1 - t0
                chosen_B = tally.take(rollout, self.scorer(rollout), len(groups))
                inf_s += time.perf_counter() - t1
                if chosen_B.any():
                    kept.append(rollout.select(chosen_B))
                    order.append(torch.tensor(groups).repeat_interleave(self.samples_per_prompt)[chosen_B])
                t0 = time.perf_counter()
        finally:  # the groups still decoding: started, never trained
            tally.sampled += batch.groups_open
            tally.extra_tokens += batch.close()
        gen_s += time.perf_counter() - t0
        on_stage("inference")
        t1 = time.perf_counter()
        trained = Rollout.cat(kept, self.pad_token_id).select(torch.argsort(torch.cat(order), stable=True))
        experience = self.inferencer.infer(trained)
        inf_s += time.perf_counter() - t1
        generation = self.generator.generation_stats()
        return experience, RolloutStats(
            generation_s=gen_s,
            inference_s=inf_s,
            generation_inference_s=time.perf_counter() - start if generation is not None else None,
            generation=generation,
            sampling=tally.stats(1),
        )


def scores_of(inferencer: Inferencer) -> Callable[[Rollout], Tensor]:
    """What dynamic sampling decides on: the inferencer's reward stage alone where it has one (`Scorer`), else
    the scores of its whole inference (a user's inferencer that changes the scores, e.g. a wrapper)."""
    if isinstance(inferencer, Scorer):
        return inferencer.score
    return lambda rollout: inferencer.infer(rollout).scores_B


def training_rollout(
    stage: RolloutStage,
    data: DataConfig,
    prompts: PromptLoader,
    pad_token_id: int,
    *,
    opening: tuple[OpeningGenerator, Inferencer] | None = None,
) -> RolloutStage:
    """The training iterations' rollout: `stage`, or with data.oversample on dynamic sampling over it (its extra
    candidates drawn from `prompts`, the loader of the iteration's own): inside one open rollout of `opening`'s
    generator and inferencer (`StreamedDynamicSampling`) where the build gives them, else in `DynamicSampling`'s
    rounds of `stage`."""
    if data.oversample == 0:
        return stage
    draw: PromptDraw = lambda count: collate_prompts(prompts.take(count), pad_token_id)  # noqa: E731
    limit = len(prompts.prompts)
    if opening is not None:
        generator, inferencer = opening
        return StreamedDynamicSampling(
            stage, generator, inferencer, data.prompts_per_iteration,
            samples_per_prompt=data.samples_per_prompt, oversample=data.oversample, draw=draw, limit=limit,
            prompt_width=max((len(p.token_ids) for p in prompts.prompts), default=1), pad_token_id=pad_token_id,
        )  # fmt: skip
    return DynamicSampling(
        stage,
        data.prompts_per_iteration,
        oversample=data.oversample,
        draw=draw,
        limit=limit,
        pad_token_id=pad_token_id,
    )
