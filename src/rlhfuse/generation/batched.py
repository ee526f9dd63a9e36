"""The batched generators: whole batches of samples decoded by one `GenerationEngine` per process, in plain
mode (no prefix sharing, no speculation; chunks of at most `generator.max_batch_size` samples, each decoded to
its end before the next is admitted).

Each sample's randomness comes from its own stream of uniforms, seeded by (run seed, iteration, prompt id,
sample index), and tokens are drawn by inverse-CDF sampling from that stream: a sample's tokens therefore do not
depend on which other samples share its batch, nor on the batch size or order, nor on which generation instance
decodes it.

`SamplingGenerator` is one process's whole Actor copy; `InstanceGenerator` the pipeline strategies' world /
generator.tp instances, each decoding its own share (a tensor-parallel instance's engine chooses tokens
vocabulary-parallel). The continuous-batching generator with migration is `rlhfuse.generation.generator`.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from rlhfuse import distributed
from rlhfuse.core.sampling import Sampling, SamplingConfig
from rlhfuse.core.types import PromptBatch, Rollout
from rlhfuse.generation.coordinator import Coordinator
from rlhfuse.generation.engine import (
    GenerationEngine,
    SampleRequest,
    SamplingParams,
    StepGate,
    TokenChoice,
    call_settings,
    requests_for,
    to_rollout,
)
from rlhfuse.generation.open_rollout import OpenRollout
from rlhfuse.models import Transformer, load_weights


def plain_engine(
    model: Transformer,
    params: SamplingParams,
    slots: int,
    prompt_width: int,
    *,
    choice: TokenChoice | None = None,
    gate: StepGate | None = None,
) -> GenerationEngine:
    """A plain engine on `model` (no prefix sharing, no speculation) of `slots` slots, for prompts up to
    `prompt_width` tokens."""
    return GenerationEngine(
        model, params, num_slots=slots, max_len=prompt_width + params.max_new_tokens,
        prefix_sharing=False, choice=choice, gate=gate,
    )  # fmt: skip


def plain_chunks(
    model: Transformer,
    requests: Sequence[SampleRequest],
    params: SamplingParams,
    chunk: int,
    *,
    pad_token_id: int,
    choice: TokenChoice | None = None,
    gate: StepGate | None = None,
) -> Iterator[Rollout]:
    """`requests` decoded by one plain engine on `model`, `chunk` at a time (each to its end), as one Rollout
    per chunk, rows in the given order; `gate`: each decode step under it (weights that may change between
    steps, each token's version recorded)."""
    if not requests:
        return
    width = max(r.prompt_len for r in requests)
    engine = plain_engine(model, params, min(chunk, len(requests)), width, choice=choice, gate=gate)
    for start in range(0, len(requests), chunk):
        yield to_rollout(engine.run(requests[start : start + chunk]), pad_token_id)


class ActorCopy:
    """What both batched generators do with their one Actor copy (`model`): a weight sync copies into it, bucket
    by bucket; they measure nothing beyond the stage's timings; nothing outlives this process's modules."""

    model: Transformer
    params: SamplingParams
    eos_token_id: int
    samples_per_prompt: int

    def load_weights(self, named_tensors: Mapping[str, Tensor]) -> None:
        load_weights(self.model, named_tensors)

    def load_weight_buckets(self, buckets: Iterable[Mapping[str, Tensor]]) -> None:
        for bucket in buckets:  # copied into the generation copy, then freed
            load_weights(self.model, bucket)

    def generation_stats(self) -> None:
        return None

    def actor_copies(self) -> list[torch.nn.Module]:
        return [self.model]

    def close(self) -> None:
        """Nothing outlives this process's modules."""


class SamplingGenerator(ActorCopy):
    """Single-process generator owning a copy of the Actor (the "engine" weights, updated by `load_weights`)."""

    def __init__(
        self,
        actor: Transformer,
        config: SamplingConfig,
        *,
        eos_token_id: int,
        pad_token_id: int,
        samples_per_prompt: int,
        seed: int,
    ) -> None:
        self.model = copy.deepcopy(actor).eval().requires_grad_(False)
        self.config = config
        self.params = SamplingParams.of(config, eos_token_id)
        self.eos_token_id, self.pad_token_id = eos_token_id, pad_token_id
        self.samples_per_prompt = samples_per_prompt
        self.seed = seed

    @torch.no_grad()
    def generate(
        self, prompts: PromptBatch, *, iteration: int, sampling: Sampling | None = None
    ) -> Iterator[Rollout]:
        yield from self._chunks(prompts, iteration, sampling, None)

    @torch.no_grad()
    def generate_partial(self, prompts: PromptBatch, *, iteration: int, gate: StepGate) -> Iterator[Rollout]:
        """`generate`, each decode step under `gate`: the weights may be replaced between two steps (a partial
        rollout continues its samples under the new ones, their KV cache kept), and each token records the
        version it was sampled with (`Rollout.versions_BR`)."""
        yield from self._chunks(prompts, iteration, None, gate)

    def open_rollout(
        self, *, iteration: int, capacity: int, prompt_width: int, sampling: Sampling | None = None
    ) -> OpenRollout:
        """A rollout whose prompts join while the engine decodes (`OpenRollout`): one plain engine of
        min(`generator.max_batch_size`, `capacity`) slots, prompts up to `prompt_width` tokens; `sampling`: the
        call's own, else the run's."""
        params, per_prompt = call_settings(sampling, self.params, self.samples_per_prompt, self.eos_token_id)
        slots = min(self.config.max_batch_size or capacity, capacity)
        engine = plain_engine(self.model, params, slots, prompt_width)
        return OpenRollout(
            Coordinator([engine], bs_max=slots), samples_per_prompt=per_prompt, seed=self.seed,
            iteration=iteration, pad_token_id=self.pad_token_id,
        )  # fmt: skip

    def _chunks(
        self, prompts: PromptBatch, iteration: int, sampling: Sampling | None, gate: StepGate | None
    ) -> Iterator[Rollout]:
        params, per_prompt = call_settings(sampling, self.params, self.samples_per_prompt, self.eos_token_id)
        requests = requests_for(prompts, samples_per_prompt=per_prompt, seed=self.seed, iteration=iteration)
        yield from plain_chunks(
            self.model, requests, params,
            self.config.max_batch_size or len(requests), pad_token_id=self.pad_token_id, gate=gate,
        )  # fmt: skip


def instance_group(world: int, tp: int, groups: distributed.WorldGroups | None = None) -> Any:
    """Collective over the world (every rank, same order): the process group of this rank's generation
    instance, ranks i*tp .. i*tp + tp - 1 (every instance's group is made on every rank, as torch requires, by
    `groups`: the process's `WorldGroups` by default); None for tp = 1."""
    if tp == 1:
        return None
    owner = groups if groups is not None else distributed.WorldGroups.current()
    return owner.subgroups(
        ("generation", "instances", tp), [range(i * tp, (i + 1) * tp) for i in range(world // tp)]
    )


class InstanceGenerator(ActorCopy):
    """The generator of the pipeline strategies: world / tp generation instances (generator.tp = tp, 1
    included), instance i on ranks i*tp .. i*tp + tp - 1, each decoding only its contiguous share of the
    iteration's samples; then every instance's rollout chunks are broadcast from its first rank, so every rank
    ends with the whole batch (in the single-process order) and no rank decodes a sample another rank decodes.

    tp = 1: a whole Actor copy per rank. tp > 1: the instance's ranks hold `shard_transformer` shards of the
    Actor (the engine's KV cache holds the shard's kv heads only) and choose tokens vocabulary-parallel from the
    logit slices (`rlhfuse.generation.vocab_parallel.VocabularyShards`: temperature, top-k and top-p without
    gathering the logits). Tokens equal `SamplingGenerator`'s for every tp (each sample's own uniforms).
    `load_weights` takes this rank's generation shard (`PipelineStrategy.actor_weights`).

    `group`: the instance's process group (default: made by `instance_group`, a collective)."""

    def __init__(
        self,
        actor: Transformer,
        config: SamplingConfig,
        *,
        tp: int,
        eos_token_id: int,
        pad_token_id: int,
        samples_per_prompt: int,
        seed: int,
        group: Any = None,
    ) -> None:
        self.rank, self.world = distributed.rank(), distributed.world_size()
        if tp < 1 or self.world % tp:
            raise ValueError(
                f"generator.tp={tp} does not divide the world size {self.world}: set generator.tp to a divisor"
            )
        self.tp, self.instances, self.instance = tp, self.world // tp, self.rank // tp
        self.group = group if group is not None or tp == 1 else instance_group(self.world, tp)
        self.config = config
        self.params = SamplingParams.of(config, eos_token_id)
        self.eos_token_id, self.pad_token_id = eos_token_id, pad_token_id
        self.samples_per_prompt, self.seed = samples_per_prompt, seed
        self.choice: TokenChoice | None = None  # the engine's default: whole logits
        if tp == 1:
            self.model = copy.deepcopy(actor).eval().requires_grad_(False)
        else:
            from rlhfuse.generation.vocab_parallel import VocabularyShards
            from rlhfuse.runtime.tensor_parallel import shard_transformer

            # shard_transformer copies the module (one holding a process group cannot be deep-copied after)
            self.model = shard_transformer(actor, self.rank % tp, tp, self.group).eval().requires_grad_(False)
            self.choice = VocabularyShards(self.model, self.group)
        self.decoded_rows = torch.zeros(0, dtype=torch.long)
        """The sample rows (indices into the iteration's prompt-major samples) this rank decoded last."""

    def shares(self, samples: int) -> list[Tensor]:
        """Per instance, its rows: contiguous shares of the prompt-major samples (sizes differing by at most
        one)."""
        return list(torch.tensor_split(torch.arange(samples), self.instances))

    @torch.no_grad()
    def generate(
        self, prompts: PromptBatch, *, iteration: int, sampling: Sampling | None = None
    ) -> Iterator[Rollout]:
        params, per_prompt = call_settings(sampling, self.params, self.samples_per_prompt, self.eos_token_id)
        requests = requests_for(prompts, samples_per_prompt=per_prompt, seed=self.seed, iteration=iteration)
        shares = self.shares(len(requests))
        chunk = self.config.max_batch_size or len(requests)
        # this instance's share, decoded before any instance's result is sent
        mine = list(
            plain_chunks(
                self.model, [requests[i] for i in shares[self.instance].tolist()],
                params, chunk, pad_token_id=self.pad_token_id,
                choice=self.choice,
            )
        )  # fmt: skip
        self.decoded_rows = shares[self.instance]
        wire = distributed.rank_device()
        for instance, rows in enumerate(shares):
            for j in range(-(-len(rows) // chunk)):  # the instance's chunks, as many on every rank
                own = mine[j] if instance == self.instance else None
                if self.instances == 1:
                    got = own
                else:
                    got = distributed.broadcast_dataclass(own, Rollout, instance * self.tp, wire)
                assert got is not None
                yield got.to("cpu")
