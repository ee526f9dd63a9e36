"""Generation stage: batched sampling with the engine-owned KV cache.

Each sample's randomness comes from its own stream of uniforms, seeded by (run seed, iteration, prompt id,
sample index), and tokens are drawn by inverse-CDF sampling from that stream: a sample's tokens therefore do not
depend on which other samples share its batch, nor on the batch size or order.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from rlhfuse.core.sampling import GeneratorConfig, filter_logits, sample_from, sample_seed
from rlhfuse.core.types import PromptBatch, Rollout
from rlhfuse.models import KVCache, ModelConfig, Transformer


class SamplingGenerator:
    """Single-process generator owning a copy of the Actor (the "engine" weights, updated by `load_weights`)."""

    def __init__(
        self,
        actor: Transformer,
        config: GeneratorConfig,
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

    def load_weights(self, named_tensors: Mapping[str, Tensor]) -> None:
        with torch.no_grad():
            self.model.load_state_dict(dict(named_tensors), strict=True)

    def generation_stats(self) -> None:
        """One batched decode, no instances: nothing to report beyond the stage's timings."""
        return None

    def actor_copies(self) -> list[torch.nn.Module]:
        return [self.model]

    @torch.no_grad()
    def generate(self, prompts: PromptBatch, *, iteration: int) -> Iterator[Rollout]:
        n = self.samples_per_prompt
        device = next(self.model.parameters()).device
        ids_BP = prompts.input_ids_BP.repeat_interleave(n, dim=0).to(device)
        mask_BP = prompts.attention_mask_BP.repeat_interleave(n, dim=0).to(device)
        prompt_index_B = prompts.prompt_ids_B.repeat_interleave(n)
        sample_index_B = torch.arange(n).repeat(len(prompts))
        chunk = self.config.max_batch_size or len(ids_BP)
        for start in range(0, len(ids_BP), chunk):
            rows = slice(start, start + chunk)
            yield self._generate_chunk(
                ids_BP[rows], mask_BP[rows], prompt_index_B[rows], sample_index_B[rows], iteration
            )

    def _cache_config(self) -> ModelConfig:
        """The shape the KV cache is allocated for (a tensor-parallel shard caches only its kv heads)."""
        return self.model.config

    def _uniforms(self, prompt_index_B: Tensor, sample_index_B: Tensor, iteration: int) -> Tensor:
        streams = []
        for prompt_id, sample_index in zip(prompt_index_B.tolist(), sample_index_B.tolist()):
            rng = torch.Generator().manual_seed(sample_seed(self.seed, iteration, prompt_id, sample_index))
            streams.append(torch.rand(self.config.max_new_tokens, generator=rng, dtype=torch.float64))
        return torch.stack(streams)

    def _next_tokens(self, logits_BV: Tensor, uniforms_B: Tensor, rows_B: Tensor) -> Tensor:
        """Next token of each active row (`rows_B`: their indices in the chunk; used by subclasses)."""
        cfg = self.config
        if cfg.temperature == 0:
            return logits_BV.argmax(dim=-1)
        probs_BV = filter_logits(
            logits_BV.float(), temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p
        )
        return sample_from(probs_BV, uniforms_B.to(probs_BV.device))

    def _generate_chunk(
        self, ids_BP: Tensor, mask_BP: Tensor, prompt_index_B: Tensor, sample_index_B: Tensor, iteration: int
    ) -> Rollout:
        # Trim the chunk's all-padding prompt columns so a chunk's prefill does not depend on other chunks.
        first_real = int((mask_BP.sum(dim=0) > 0).nonzero().min())
        ids_BP, mask_BP = ids_BP[:, first_real:], mask_BP[:, first_real:]
        batch, prompt_len = ids_BP.shape
        max_new = self.config.max_new_tokens
        device = ids_BP.device
        uniforms_BN = self._uniforms(prompt_index_B, sample_index_B, iteration)
        cache = KVCache.allocate(
            self._cache_config(),
            batch,
            prompt_len + max_new,
            dtype=next(self.model.parameters()).dtype,
            device=device,
        )
        positions_BP = (mask_BP.cumsum(dim=1) - 1).clamp(min=0)
        logits_BV = self.model(ids_BP, attention_mask_BT=mask_BP, position_ids_BT=positions_BP, cache=cache)[
            :, -1
        ]
        next_pos_B = mask_BP.sum(dim=1)
        response_BN = torch.full((batch, max_new), self.pad_token_id, dtype=torch.long, device=device)
        lengths_B = torch.zeros(batch, dtype=torch.long, device=device)
        finished_B = torch.zeros(batch, dtype=torch.bool, device=device)
        active_A = torch.arange(batch, device=device)  # rows still decoding; A <= B
        stop_ids = self.stop_ids.to(device)
        for step in range(max_new):
            tokens_A = self._next_tokens(logits_BV, uniforms_BN[active_A.cpu(), step], active_A)
            response_BN[active_A, step] = tokens_A
            lengths_B[active_A] = step + 1
            stopped_A = torch.isin(tokens_A, stop_ids)
            finished_B[active_A[stopped_A]] = True
            active_A, tokens_A = active_A[~stopped_A], tokens_A[~stopped_A]
            if step == max_new - 1 or len(active_A) == 0:
                break
            ones_A1 = torch.ones(len(active_A), 1, dtype=torch.long, device=device)
            logits_BV = self.model(
                tokens_A[:, None],
                attention_mask_BT=ones_A1,
                position_ids_BT=next_pos_B[active_A][:, None],
                cache=cache,
                cache_slots_B=active_A,
            )[:, -1]
            next_pos_B[active_A] += 1
        width = max(int(lengths_B.max()), 1)
        response_mask_BR = (torch.arange(width, device=device)[None, :] < lengths_B[:, None]).long()
        return Rollout(
            prompt_ids_BP=ids_BP.cpu(),
            prompt_mask_BP=mask_BP.cpu(),
            response_ids_BR=response_BN[:, :width].cpu(),
            response_mask_BR=response_mask_BR.cpu(),
            prompt_index_B=prompt_index_B.cpu(),
            sample_index_B=sample_index_B.cpu(),
            finished_B=finished_B.cpu(),
        )


class TensorParallelGenerator(SamplingGenerator):
    """generator.tp > 1 under the pipeline strategies: each generation instance spans `tp` consecutive ranks and
    holds a tensor-parallel shard of the Actor (`rlhfuse.runtime.tensor_parallel.shard_transformer`; its KV cache
    holds the shard's kv heads only); the world / tp instances each generate their own contiguous share of the
    samples (tokens sampled vocabulary-parallel from the logit slices: `vocab_parallel_sample` /
    `vocab_parallel_argmax`, the same inverse-CDF draw from each sample's own uniforms as `SamplingGenerator`),
    and each instance's rollout is broadcast from its first rank, so every rank streams every instance's chunk
    and no rank generates a rollout that is thrown away. `load_weights` takes this rank's shard
    (`FusedPipelineStrategy.actor_weights` with generation_tp = tp)."""

    def __init__(
        self,
        actor: Transformer,
        config: GeneratorConfig,
        *,
        tp: int,
        rank: int,
        world: int,
        group: Any,
        eos_token_id: int,
        pad_token_id: int,
        samples_per_prompt: int,
        seed: int,
    ) -> None:
        from rlhfuse.runtime.tensor_parallel import shard_transformer

        if config.top_k or config.top_p < 1.0:
            raise ValueError(
                f"generator.tp={tp} samples from vocabulary slices without top-k / top-p filtering (not built): "
                "set generator.top_k=0 generator.top_p=1.0, or generator.tp=1"
            )
        super().__init__(
            actor,
            config,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            samples_per_prompt=samples_per_prompt,
            seed=seed,
        )
        # the shard replaces the whole copy (a module holding a process group cannot be deep-copied)
        self.model = shard_transformer(self.model, rank % tp, tp, group).eval().requires_grad_(False)
        self.tp, self.rank, self.world, self.group = tp, rank, world, group
        self.instances = world // tp

    def _cache_config(self) -> ModelConfig:
        attn: Any = self.model.layers[0].self_attn
        return dataclasses.replace(self.model.config, num_kv_heads=int(attn.num_kv_heads))

    def _next_tokens(self, logits_BV: Tensor, uniforms_B: Tensor, rows_B: Tensor) -> Tensor:
        from rlhfuse.runtime.tensor_parallel import vocab_parallel_argmax, vocab_parallel_sample

        shard: Any = self.model.vocab_shard
        if self.config.temperature == 0:
            return vocab_parallel_argmax(logits_BV, shard, self.group)
        return vocab_parallel_sample(logits_BV, uniforms_B, shard, self.group, self.config.temperature)

    @torch.no_grad()
    def generate(self, prompts: PromptBatch, *, iteration: int) -> Iterator[Rollout]:
        from rlhfuse import distributed

        n = self.samples_per_prompt
        device = next(self.model.parameters()).device
        ids_BP = prompts.input_ids_BP.repeat_interleave(n, dim=0)
        mask_BP = prompts.attention_mask_BP.repeat_interleave(n, dim=0)
        prompt_index_B = prompts.prompt_ids_B.repeat_interleave(n)
        sample_index_B = torch.arange(n).repeat(len(prompts))
        shares = torch.tensor_split(torch.arange(len(ids_BP)), self.instances)
        size = self.config.max_batch_size or len(ids_BP)
        chunks = [[rows[i : i + size] for i in range(0, len(rows), size)] for rows in shares]
        mine: list[Rollout] = [  # this instance's share, generated before any instance's result is sent
            self._generate_chunk(
                ids_BP[rows].to(device), mask_BP[rows].to(device), prompt_index_B[rows], sample_index_B[rows],
                iteration,
            )
            for rows in chunks[self.rank // self.tp]
        ]  # fmt: skip
        for instance, parts in enumerate(chunks):
            for j in range(len(parts)):
                own = mine[j] if instance == self.rank // self.tp else None
                got = distributed.broadcast_dataclass(own, Rollout, instance * self.tp, device)
                yield Rollout(**{k: (v.cpu() if isinstance(v, Tensor) else v) for k, v in vars(got).items()})
