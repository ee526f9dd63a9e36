"""`OpenRollout`: one rollout whose batch stays open. Prompts join while the instances decode (`add`), each prompt
group leaves as soon as its last sample finishes (`finished`), and what is still decoding when the caller has what
it needs is dropped (`close`). Dynamic sampling runs inside the rollout on it
(`rlhfuse.trainer.rollout.StreamedDynamicSampling`): a group whose samples all scored alike costs its own tokens
and no more, and the prompts that replace it start decoding beside the others at once, instead of in a new round
once the whole batch has ended.

It drives a `Coordinator` (the instances of this process, long-tail migration included: a prompt added after the
migration goes to its destinations), so its samples are the ones `EngineGenerator` and `SamplingGenerator` would
decode for the same prompts: each sample's tokens come from its own stream of uniforms, keyed by (run seed,
iteration, prompt id, sample index), whatever else shares its batch.
"""

from __future__ import annotations

from collections.abc import Callable

from rlhfuse.core.types import PromptBatch, Rollout
from rlhfuse.generation.coordinator import Coordinator
from rlhfuse.generation.engine import SampleRequest, requests_for, to_rollout


class OpenRollout:
    """The samples of the prompts `add`ed, `samples_per_prompt` each, decoded by `coordinator`'s instances with
    migration at Rt = `threshold`; `on_migrated(freed)` once a migration has freed instances."""

    def __init__(
        self,
        coordinator: Coordinator,
        *,
        samples_per_prompt: int,
        seed: int,
        iteration: int,
        pad_token_id: int,
        threshold: int = 0,
        on_migrated: Callable[[tuple[int, ...]], None] | None = None,
    ) -> None:
        self.coordinator = coordinator
        self.samples_per_prompt, self.seed, self.iteration = samples_per_prompt, seed, iteration
        self.pad_token_id = pad_token_id
        self.on_migrated = on_migrated
        self.groups_added = 0
        """Prompt groups added so far: the next group's number (its samples' rows follow on from the others')."""
        self._groups_done = 0
        self._partial: dict[int, list[SampleRequest]] = {}  # group -> its finished samples, while some decode
        self._released = False
        coordinator.start(threshold)

    @property
    def groups_open(self) -> int:
        """Prompt groups added whose samples have not all finished."""
        return self.groups_added - self._groups_done

    def add(self, prompts: PromptBatch) -> None:
        """Start decoding `prompts`' samples beside those already decoding; their groups are numbered on from the
        groups added before (`Rollout` rows of a group: `group * samples_per_prompt + sample index`)."""
        if len(prompts) == 0:
            return
        requests = requests_for(
            prompts, samples_per_prompt=self.samples_per_prompt, seed=self.seed, iteration=self.iteration
        )
        first = self.groups_added
        for request in requests:
            request.group += first
            request.row += first * self.samples_per_prompt
        self.groups_added += len(prompts)
        self.coordinator.add(requests)

    def finished(self) -> tuple[list[int], Rollout] | None:
        """Step the instances until at least one prompt group has all of its samples: (the groups' numbers in
        the order they were added, their samples as one Rollout, each group's rows together in sample order).
        None when nothing is decoding."""
        while self.coordinator.has_work():
            done = self.step()
            if done is not None:
                return done
        return None

    def step(self) -> tuple[list[int], Rollout] | None:
        """One step of every instance with work: the prompt groups it completed, as `finished` gives them (None:
        none completed)."""
        complete: list[int] = []
        for _, sample in self.coordinator.step():
            members = self._partial.setdefault(sample.group, [])
            members.append(sample)
            if len(members) == self.samples_per_prompt:
                complete.append(sample.group)
        report = self.coordinator.report
        if report.at and not self._released:
            self._released = True
            if self.on_migrated is not None:
                self.on_migrated(report.freed)
        if not complete:
            return None
        complete.sort()
        self._groups_done += len(complete)
        done = [r for g in complete for r in sorted(self._partial.pop(g), key=lambda r: r.sample_index)]
        return complete, to_rollout(done, self.pad_token_id)

    def close(self) -> int:
        """Drop every sample still decoding (their instances' slots freed for the next batch): the tokens they
        had generated, finished samples of incomplete groups included."""
        dropped = self.coordinator.abandon()
        tokens = sum(len(r.tokens) for r in dropped)
        tokens += sum(len(r.tokens) for members in self._partial.values() for r in members)
        self._partial.clear()
        self._groups_done = self.groups_added
        return tokens
