"""Generation stage: batched sampling with the engine-owned KV cache.

Each sample's randomness comes from its own stream of uniforms, seeded by (run seed, iteration, prompt id,
sample index), and tokens are drawn by inverse-CDF sampling from that stream: a sample's tokens therefore do not
depend on which other samples share its batch, nor on the batch size or order, nor on which generation instance
decodes it.

Two generators share the decode loop (`decode_chunk`): `SamplingGenerator` (one process, a whole Actor copy)
and `InstanceGenerator` (the pipeline strategies: world / generator.tp instances, each decoding its own share).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from rlhfuse import distributed
from rlhfuse.core.sampling import Sampling, SamplingConfig, filter_logits, sample_from, sample_seed
from rlhfuse.core.types import PromptBatch, Rollout
from rlhfuse.models import KVCache, ModelConfig, Transformer, load_weights, upload

PickTokens = Callable[[Tensor, Tensor, Tensor], Tensor]
"""(logits_AV of the active rows, their uniforms_A for this step, their rows_A in the chunk) -> next tokens_A."""


def expand_prompts(prompts: PromptBatch, n: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Every sample's row, prompt-major (n samples per prompt): ids_BP, mask_BP, prompt_index_B, sample_index_B."""
    return (
        prompts.input_ids_BP.repeat_interleave(n, dim=0),
        prompts.attention_mask_BP.repeat_interleave(n, dim=0),
        prompts.prompt_ids_B.repeat_interleave(n),
        torch.arange(n).repeat(len(prompts)),
    )


def sample_uniforms(
    seed: int, iteration: int, prompt_index_B: Tensor, sample_index_B: Tensor, max_new_tokens: int
) -> Tensor:
    """Each sample's stream of uniforms, float64 [B, max_new_tokens] (on the CPU)."""
    streams = []
    for prompt_id, sample_index in zip(prompt_index_B.tolist(), sample_index_B.tolist()):
        rng = torch.Generator().manual_seed(sample_seed(seed, iteration, prompt_id, sample_index))
        streams.append(torch.rand(max_new_tokens, generator=rng, dtype=torch.float64))
    return torch.stack(streams)


def single_process_pick(config: SamplingConfig) -> PickTokens:
    """Greedy argmax, or `filter_logits` + `sample_from` over whole logits."""

    def pick(logits_AV: Tensor, uniforms_A: Tensor, rows_A: Tensor) -> Tensor:
        if config.temperature == 0:
            return logits_AV.argmax(dim=-1)
        probs_AV = filter_logits(
            logits_AV.float(), temperature=config.temperature, top_k=config.top_k, top_p=config.top_p
        )
        return sample_from(probs_AV, uniforms_A.to(probs_AV.device))

    return pick


@torch.no_grad()
def decode_chunk(
    model: Transformer,
    cache_config: ModelConfig,
    pick: PickTokens,
    ids_BP: Tensor,
    mask_BP: Tensor,
    prompt_index_B: Tensor,
    sample_index_B: Tensor,
    uniforms_BN: Tensor,
    *,
    stop_ids: Tensor,
    pad_token_id: int,
) -> Rollout:
    """Prefill one chunk of samples, then decode until every row stopped or N = uniforms_BN.shape[1] tokens;
    the rollout's tensors on the CPU."""
    # Trim the chunk's all-padding prompt columns so a chunk's prefill does not depend on other chunks.
    # Read once per chunk (its prefill): the rows' positions are host ints from here on.
    first_real = mask_BP.any(dim=0).tolist().index(True)
    prompt_lengths = mask_BP.sum(dim=1).tolist()
    ids_BP, mask_BP = ids_BP[:, first_real:], mask_BP[:, first_real:]
    batch, prompt_len = ids_BP.shape
    max_new = uniforms_BN.shape[1]
    device = ids_BP.device
    cache = KVCache.allocate(
        cache_config, batch, prompt_len + max_new, dtype=next(model.parameters()).dtype, device=device
    )
    # No prefix sharing here: the chunk prefills every row (a prompt shorter than a block, the common case, is
    # one part-full block that each sample would copy on its first write anyway).
    positions_BP = (mask_BP.cumsum(dim=1) - 1).clamp(min=0)
    logits_BV = model(ids_BP, attention_mask_BT=mask_BP, position_ids_BT=positions_BP, cache=cache)[:, -1]
    uniforms_dev_BN = upload(uniforms_BN, device)
    stops = frozenset(stop_ids.tolist())
    # Host bookkeeping, in step with the device: the rows still decoding (A <= B), their next positions, the
    # tokens so far. A step's one device read is its sampled tokens.
    active = list(range(batch))
    active_A = upload(active, device)
    next_pos = [int(n) for n in prompt_lengths]
    responses: list[list[int]] = [[] for _ in range(batch)]
    finished = [False] * batch
    for step in range(max_new):
        tokens_A = pick(logits_BV, uniforms_dev_BN[active_A, step], active_A)
        kept: list[int] = []
        for row, token in zip(active, tokens_A.tolist(), strict=True):  # the step's one read
            responses[row].append(token)
            if token in stops:
                finished[row] = True
            else:
                kept.append(row)
        if len(kept) < len(active):
            cache.reset([r for r in active if finished[r]])  # stopped rows' blocks go back to the pool
        active = kept
        if step == max_new - 1 or not active:
            break
        inputs_3A = upload(
            [active, [responses[r][-1] for r in active], [next_pos[r] for r in active]], device
        )
        active_A = inputs_3A[0]
        logits_BV = model(
            inputs_3A[1][:, None],
            attention_mask_BT=torch.ones(len(active), 1, dtype=torch.long, device=device),
            position_ids_BT=inputs_3A[2][:, None],
            cache=cache,
            cache_slots_B=active,
        )[:, -1]
        for r in active:
            next_pos[r] += 1
    width = max(max(len(r) for r in responses), 1)
    response_BR = torch.full((batch, width), pad_token_id, dtype=torch.long)
    response_mask_BR = torch.zeros((batch, width), dtype=torch.long)
    for row, tokens in enumerate(responses):
        response_BR[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        response_mask_BR[row, : len(tokens)] = 1
    return Rollout(
        prompt_ids_BP=ids_BP.cpu(),
        prompt_mask_BP=mask_BP.cpu(),
        response_ids_BR=response_BR,
        response_mask_BR=response_mask_BR,
        prompt_index_B=prompt_index_B.cpu(),
        sample_index_B=sample_index_B.cpu(),
        finished_B=torch.tensor(finished, dtype=torch.bool),
    )


class ActorCopy:
    """What both batched generators do with their one Actor copy (`model`): a weight sync copies into it, bucket
    by bucket; they measure nothing beyond the stage's timings; nothing outlives this process's modules."""

    model: Transformer

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
        self.stop_ids = torch.tensor(sorted({eos_token_id, *config.stop_token_ids}))
        self.pad_token_id = pad_token_id
        self.samples_per_prompt = samples_per_prompt
        self.seed = seed
        self.pick = single_process_pick(config)

    @torch.no_grad()
    def generate(
        self, prompts: PromptBatch, *, iteration: int, sampling: Sampling | None = None
    ) -> Iterator[Rollout]:
        device = next(self.model.parameters()).device
        pick = self.pick if sampling is None else single_process_pick(sampling.config)
        per_prompt = self.samples_per_prompt if sampling is None else sampling.samples_per_prompt
        ids_BP, mask_BP, prompt_index_B, sample_index_B = expand_prompts(prompts, per_prompt)
        chunk = self.config.max_batch_size or len(ids_BP)
        for start in range(0, len(ids_BP), chunk):
            rows = slice(start, start + chunk)
            uniforms_BN = sample_uniforms(
                self.seed, iteration, prompt_index_B[rows], sample_index_B[rows], self.config.max_new_tokens
            )
            yield decode_chunk(
                self.model, self.model.config, pick, ids_BP[rows].to(device), mask_BP[rows].to(device),
                prompt_index_B[rows], sample_index_B[rows], uniforms_BN, stop_ids=self.stop_ids,
                pad_token_id=self.pad_token_id,
            )  # fmt: skip


def shard_cache_config(shard: Transformer) -> ModelConfig:
    """The shape a tensor-parallel shard's KV cache is allocated for: its own kv heads only."""
    attn: Any = shard.layers[0].self_attn
    return dataclasses.replace(shard.config, num_kv_heads=int(attn.num_kv_heads))


def instance_group(world: int, tp: int) -> Any:
    """Collective over the world (every rank, same order): the process group of this rank's generation
    instance, ranks i*tp .. i*tp + tp - 1 (every instance's group is created on every rank, as torch requires);
    None for tp = 1."""
    if tp == 1:
        return None
    groups = [distributed.new_group(range(i * tp, (i + 1) * tp)) for i in range(world // tp)]
    return groups[distributed.rank() // tp]


class InstanceGenerator(ActorCopy):
    """The generator of the pipeline strategies: world / tp generation instances (generator.tp = tp, 1
    included), instance i on ranks i*tp .. i*tp + tp - 1, each decoding only its contiguous share of the
    iteration's samples; then every instance's rollout chunks are broadcast from its first rank, so every rank
    ends with the whole batch (in the single-process order) and no rank decodes a sample another rank decodes.

    tp = 1: a whole Actor copy per rank. tp > 1: the instance's ranks hold `shard_transformer` shards of the
    Actor (its KV cache holds the shard's kv heads only) and sample vocabulary-parallel from the logit slices
    (`rlhfuse.generation.vocab_parallel`: temperature, top-k and top-p without gathering the logits; greedy:
    `vocab_parallel_argmax`). Tokens equal `SamplingGenerator`'s for every tp (each sample's own uniforms).
    `load_weights` takes this rank's generation shard (`FusedPipelineStrategy.actor_weights`).

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
        self.stop_ids = torch.tensor(sorted({eos_token_id, *config.stop_token_ids}))
        self.pad_token_id, self.samples_per_prompt, self.seed = pad_token_id, samples_per_prompt, seed
        if tp == 1:
            self.model = copy.deepcopy(actor).eval().requires_grad_(False)
            self.cache_config = self.model.config
        else:
            from rlhfuse.runtime.tensor_parallel import shard_transformer

            # shard_transformer copies the module (one holding a process group cannot be deep-copied after)
            self.model = shard_transformer(actor, self.rank % tp, tp, self.group).eval().requires_grad_(False)
            self.cache_config = shard_cache_config(self.model)
        self.pick = self._picker(config)
        self.device = next(self.model.parameters()).device
        self.decoded_rows = torch.zeros(0, dtype=torch.long)
        """The sample rows (indices into the iteration's prompt-major samples) this rank decoded last."""

    def _picker(self, config: SamplingConfig) -> PickTokens:
        """Token choice under `config` for this instance: over whole logits (tp = 1) or vocabulary-parallel."""
        if self.tp == 1:
            return single_process_pick(config)

        def pick(logits_AV: Tensor, uniforms_A: Tensor, rows_A: Tensor) -> Tensor:
            from rlhfuse.generation.vocab_parallel import vocab_parallel_filtered_sample
            from rlhfuse.runtime.tensor_parallel import vocab_parallel_argmax

            shard: Any = self.model.vocab_shard
            if config.temperature == 0:
                return vocab_parallel_argmax(logits_AV, shard, self.group)
            return vocab_parallel_filtered_sample(
                logits_AV, uniforms_A, shard, self.group, vocab_size=self.model.config.vocab_size,
                temperature=config.temperature, top_k=config.top_k, top_p=config.top_p,
            )  # fmt: skip

        return pick

    def shares(self, samples: int) -> list[list[Tensor]]:
        """Per instance, its rows in decode chunks of at most generator.max_batch_size: contiguous shares of
        the prompt-major samples (sizes differing by at most one)."""
        size = self.config.max_batch_size or samples
        out = []
        for rows in torch.tensor_split(torch.arange(samples), self.instances):
            out.append([rows[i : i + size] for i in range(0, len(rows), size)])
        return out

    @torch.no_grad()
    def generate(
        self, prompts: PromptBatch, *, iteration: int, sampling: Sampling | None = None
    ) -> Iterator[Rollout]:
        pick = self.pick if sampling is None else self._picker(sampling.config)
        per_prompt = self.samples_per_prompt if sampling is None else sampling.samples_per_prompt
        ids_BP, mask_BP, prompt_index_B, sample_index_B = expand_prompts(prompts, per_prompt)
        chunks = self.shares(len(ids_BP))
        mine: list[Rollout] = []  # this instance's share, decoded before any instance's result is sent
        for rows in chunks[self.instance]:
            uniforms_BN = sample_uniforms(
                self.seed, iteration, prompt_index_B[rows], sample_index_B[rows], self.config.max_new_tokens
            )
            mine.append(
                decode_chunk(
                    self.model, self.cache_config, pick, ids_BP[rows].to(self.device),
                    mask_BP[rows].to(self.device), prompt_index_B[rows], sample_index_B[rows], uniforms_BN,
                    stop_ids=self.stop_ids, pad_token_id=self.pad_token_id,
                )
            )  # fmt: skip
        self.decoded_rows = (
            torch.cat(chunks[self.instance]) if chunks[self.instance] else self.decoded_rows[:0]
        )
        wire = distributed.rank_device()
        for instance, parts in enumerate(chunks):
            for j in range(len(parts)):
                own = mine[j] if instance == self.instance else None
                if self.instances == 1:
                    got = own
                else:
                    got = distributed.broadcast_dataclass(own, Rollout, instance * self.tp, wire)
                assert got is not None
                yield Rollout(**{k: (v.cpu() if isinstance(v, Tensor) else v) for k, v in vars(got).items()})
