"""`GenerationEngine`: continuous batching over engine-owned KV-cache slots, one generation instance.

Legend: B rows of one forward call, P prompt tokens, N max new tokens, V vocabulary, S cache slots.

A sample's life: it waits in the queue, is admitted when a slot is free (its prompt prefilled, or copied from a
sibling's prefill with prefix sharing), then decodes one token per `step()` with whatever other samples are
running, and leaves (its slot freed, reset, reused) as soon as it stops. Between steps a running sample holds in
its slot the KV of prompt + all generated tokens but the last one, which the next step feeds: that is the whole
state migration moves (`evict` / `admit`), by KV transfer or by re-prefilling prompt + tokens[:-1].

Token t of a sample is drawn with uniform t of the sample's own stream, seeded by (run seed, iteration, prompt
id, sample index) exactly as `rlhfuse.trainer.generator.SamplingGenerator` does, with the same filtering and
inverse-CDF sampling: a sample's tokens do not depend on its batch, its slot, its instance or a migration.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from rlhfuse.core.sampling import GeneratorConfig, filter_logits, sample_from, sample_seed
from rlhfuse.core.types import PromptBatch, Rollout
from rlhfuse.models import KVCache, SlotState, Transformer


@dataclass(frozen=True)
class SamplingParams:
    """Sampling and stop conditions shared by every sample of one engine."""

    max_new_tokens: int
    # 0 = greedy.
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    # EOS and any extra stop tokens: a response ends with the first of them (kept as its last token).
    stop_token_ids: tuple[int, ...] = ()

    @staticmethod
    def of(config: GeneratorConfig, eos_token_id: int) -> SamplingParams:
        """The `generator.*` sampling settings, with the tokenizer's EOS among the stop tokens."""
        return SamplingParams(
            max_new_tokens=config.max_new_tokens,
            temperature=config.temperature,
            top_k=config.top_k,
            top_p=config.top_p,
            stop_token_ids=tuple(sorted({eos_token_id, *config.stop_token_ids})),
        )


@dataclass
class SampleRequest:
    """One sample to generate and its progress (what migration moves besides the KV cache).

    row: the sample's row in the iteration's rollout; prompt_index / sample_index: its RNG key (dataset prompt
    id, which of the prompt's samples); group: samples with the same group share their prompt's prefill;
    prompt_P: long [P], the unpadded prompt; seed: the sample's stream seed; tokens: generated so far.
    """

    row: int
    prompt_index: int
    sample_index: int
    group: int
    prompt_P: Tensor
    seed: int
    tokens: list[int] = field(default_factory=list)
    stopped: bool = False
    _uniforms_N: Tensor | None = field(default=None, repr=False)

    def uniforms(self, max_new_tokens: int) -> Tensor:
        """The sample's stream, float64 [N] (drawn as SamplingGenerator draws it)."""
        if self._uniforms_N is None:
            rng = torch.Generator().manual_seed(self.seed)
            self._uniforms_N = torch.rand(max_new_tokens, generator=rng, dtype=torch.float64)
        return self._uniforms_N


@dataclass
class MigratingSample:
    """A running sample leaving its instance: its request (tokens so far) and, for KV transfer, its slot's
    cache (prompt + tokens[:-1]); `kv is None` means the destination re-prefills."""

    request: SampleRequest
    kv: SlotState | None


@dataclass
class EngineStats:
    """Per-engine counters. batch_sizes / step_times / step_seconds: running samples of each decode step, when
    it ended (perf_counter seconds) and how long it took; tokens: generated tokens; prefill_tokens: prompt (and re-prefill) tokens computed."""

    batch_sizes: list[int] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    tokens: int = 0
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    busy_seconds: float = 0.0

    def tokens_per_second(self) -> float:
        return self.tokens / self.busy_seconds if self.busy_seconds > 0 else 0.0

    def batch_size_p50(self) -> float:
        if not self.batch_sizes:
            return 0.0
        return float(torch.quantile(torch.tensor(self.batch_sizes, dtype=torch.float64), 0.5))


def requests_for(
    prompts: PromptBatch, *, samples_per_prompt: int, seed: int, iteration: int
) -> list[SampleRequest]:
    """The iteration's samples in rollout order (prompt-major, as SamplingGenerator orders them)."""
    out = []
    for b in range(len(prompts)):
        prompt_P = prompts.input_ids_BP[b][prompts.attention_mask_BP[b].bool()].clone()
        prompt_id = int(prompts.prompt_ids_B[b])
        for i in range(samples_per_prompt):
            out.append(
                SampleRequest(
                    row=b * samples_per_prompt + i,
                    prompt_index=prompt_id,
                    sample_index=i,
                    group=b,
                    prompt_P=prompt_P,
                    seed=sample_seed(seed, iteration, prompt_id, i),
                )
            )
    return out


def to_rollout(requests: Sequence[SampleRequest], pad_token_id: int) -> Rollout:
    """Finished samples as a Rollout, rows in the given order: prompts left-padded to the longest, responses
    right-padded (the layout SamplingGenerator produces)."""
    width_p = max(len(r.prompt_P) for r in requests)
    width_r = max(max((len(r.tokens) for r in requests), default=1), 1)
    batch = len(requests)
    prompt_BP = torch.full((batch, width_p), pad_token_id, dtype=torch.long)
    prompt_mask_BP = torch.zeros((batch, width_p), dtype=torch.long)
    response_BR = torch.full((batch, width_r), pad_token_id, dtype=torch.long)
    response_mask_BR = torch.zeros((batch, width_r), dtype=torch.long)
    for b, r in enumerate(requests):
        p, n = len(r.prompt_P), len(r.tokens)
        prompt_BP[b, width_p - p :] = r.prompt_P
        prompt_mask_BP[b, width_p - p :] = 1
        response_BR[b, :n] = torch.tensor(r.tokens, dtype=torch.long)
        response_mask_BR[b, :n] = 1
    return Rollout(
        prompt_ids_BP=prompt_BP,
        prompt_mask_BP=prompt_mask_BP,
        response_ids_BR=response_BR,
        response_mask_BR=response_mask_BR,
        prompt_index_B=torch.tensor([r.prompt_index for r in requests], dtype=torch.long),
        sample_index_B=torch.tensor([r.sample_index for r in requests], dtype=torch.long),
        finished_B=torch.tensor([r.stopped for r in requests], dtype=torch.bool),
    )


class GenerationEngine:
    """One generation instance: a copy of the Actor and a KV cache of `num_slots` x `max_len` positions."""

    def __init__(
        self,
        model: Transformer,
        params: SamplingParams,
        *,
        num_slots: int,
        max_len: int,
        prefix_sharing: bool = True,
    ) -> None:
        if params.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={params.max_new_tokens} must be >= 1")
        self.model = model
        self.params = params
        self.prefix_sharing = prefix_sharing
        parameter = next(model.parameters())
        self.device = parameter.device
        self.cache = KVCache.allocate(
            model.config, num_slots, max_len, dtype=parameter.dtype, device=self.device
        )
        self.stop_ids = torch.tensor(sorted(set(params.stop_token_ids)), dtype=torch.long, device=self.device)
        self.waiting: deque[SampleRequest] = deque()
        self.arrived: deque[MigratingSample] = deque()  # migrated in, started, waiting for a slot
        self.running: dict[int, SampleRequest] = {}  # slot -> sample
        self.free_slots: list[int] = list(range(num_slots))
        self.stats = EngineStats()

    # ------------------------------------------------------------------ queue
    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.arrived)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.arrived)

    def add(self, requests: Iterable[SampleRequest]) -> None:
        """Queue samples; they are admitted in order as slots free up."""
        for request in requests:
            longest = len(request.prompt_P) + self.params.max_new_tokens
            if longest > self.cache.max_len:
                raise ValueError(
                    f"sample row {request.row}: prompt of {len(request.prompt_P)} tokens + max_new_tokens="
                    f"{self.params.max_new_tokens} needs {longest} cache positions but max_len="
                    f"{self.cache.max_len}; build the engine with a larger max_len"
                )
            self.waiting.append(request)

    def load_weights(self, named_tensors: Mapping[str, Tensor]) -> None:
        with torch.no_grad():
            self.model.load_state_dict(dict(named_tensors), strict=True)

    # ------------------------------------------------------------------ one step
    @torch.no_grad()
    def step(self) -> list[SampleRequest]:
        """Admit waiting samples into free slots (prefill), then one decode step of every running sample.
        Returns the samples that finished during this step (their slots are already free)."""
        start = time.perf_counter()
        self._admit_arrived()
        finished = self._admit_waiting()
        if self.running:
            finished += self._decode()
        self.stats.busy_seconds += time.perf_counter() - start
        return finished

    def _admit_waiting(self) -> list[SampleRequest]:
        take: list[SampleRequest] = []
        while self.waiting and len(take) < len(self.free_slots):
            take.append(self.waiting.popleft())
        if not take:
            return []
        slots = [self.free_slots.pop(0) for _ in take]
        # prefix sharing: one prefill per group among the admitted samples, copied to the others' slots
        groups: dict[int, list[int]] = {}
        for k, request in enumerate(take):
            key = request.group if self.prefix_sharing else -1 - k
            groups.setdefault(key, []).append(k)
        leaders = [members[0] for members in groups.values()]
        logits_GV = self._prefill([take[k].prompt_P for k in leaders], [slots[k] for k in leaders])
        logits_rows = torch.empty(len(take), dtype=torch.long)
        for g, members in enumerate(groups.values()):
            self.cache.copy_slot(slots[members[0]], [slots[k] for k in members[1:]])
            logits_rows[members] = g
        first_B = self._sample(logits_GV[logits_rows.to(self.device)], take)
        finished = []
        for request, slot, token in zip(take, slots, first_B.tolist(), strict=True):
            self.running[slot] = request
            if self._append(request, token):
                finished.append(self._release(slot))
        return finished

    def _prefill(self, sequences: Sequence[Tensor], slots: Sequence[int]) -> Tensor:
        """Left-padded prefill of `sequences` into `slots` (emptied first); last-position logits [G, V]."""
        width = max(len(s) for s in sequences)
        ids_BP = torch.zeros((len(sequences), width), dtype=torch.long)
        mask_BP = torch.zeros((len(sequences), width), dtype=torch.long)
        for b, seq in enumerate(sequences):
            ids_BP[b, width - len(seq) :] = seq
            mask_BP[b, width - len(seq) :] = 1
        start = time.perf_counter()
        slots_B = torch.tensor(list(slots), dtype=torch.long, device=self.device)
        self.cache.reset(slots_B)
        logits_BPV = self.model(
            ids_BP.to(self.device),
            attention_mask_BT=mask_BP.to(self.device),
            cache=self.cache,
            cache_slots_B=slots_B,
        )
        self.stats.prefill_tokens += int(mask_BP.sum())
        self.stats.prefill_seconds += time.perf_counter() - start
        return logits_BPV[:, -1]

    def _decode(self) -> list[SampleRequest]:
        start = time.perf_counter()
        slots = sorted(self.running)
        requests = [self.running[s] for s in slots]
        last_B1 = torch.tensor([[r.tokens[-1]] for r in requests], dtype=torch.long, device=self.device)
        slots_B = torch.tensor(slots, dtype=torch.long, device=self.device)
        logits_BV = self.model(last_B1, cache=self.cache, cache_slots_B=slots_B)[:, -1]
        tokens_B = self._sample(logits_BV, requests)
        self.stats.batch_sizes.append(len(slots))
        self.stats.step_times.append(time.perf_counter())
        self.stats.step_seconds.append(self.stats.step_times[-1] - start)
        finished = []
        for slot, request, token in zip(slots, requests, tokens_B.tolist(), strict=True):
            if self._append(request, token):
                finished.append(self._release(slot))
        return finished

    def _sample(self, logits_BV: Tensor, requests: Sequence[SampleRequest]) -> Tensor:
        p = self.params
        if p.temperature == 0:
            return logits_BV.argmax(dim=-1).cpu()
        n = p.max_new_tokens
        uniforms_B = torch.stack([r.uniforms(n)[len(r.tokens)] for r in requests])
        probs_BV = filter_logits(logits_BV.float(), temperature=p.temperature, top_k=p.top_k, top_p=p.top_p)
        return sample_from(probs_BV, uniforms_B.to(probs_BV.device)).cpu()

    def _append(self, request: SampleRequest, token: int) -> bool:
        """Record a sampled token; True when the sample is done."""
        request.tokens.append(token)
        self.stats.tokens += 1
        request.stopped = bool((self.stop_ids == token).any())
        return request.stopped or len(request.tokens) >= self.params.max_new_tokens

    def _release(self, slot: int) -> SampleRequest:
        request = self.running.pop(slot)
        self.cache.reset(slot)
        self.free_slots.append(slot)
        self.free_slots.sort()
        return request

    # ------------------------------------------------------------------ migration
    def evict(self, count: int, *, with_kv: bool) -> list[MigratingSample]:
        """Take `count` unfinished samples out of this instance: migrated-in ones not yet resumed and waiting
        ones first (nothing to move but the request), then running ones from the highest slot, with their KV cache when `with_kv`."""
        out: list[MigratingSample] = []
        while self.arrived and len(out) < count:
            out.append(self.arrived.pop())
        while self.waiting and len(out) < count:
            out.append(MigratingSample(self.waiting.pop(), None))
        for slot in sorted(self.running, reverse=True)[: count - len(out)]:
            kv = self.cache.export_slot(slot) if with_kv else None
            out.append(MigratingSample(self._release(slot), kv))
        if len(out) < count:
            raise ValueError(f"evict({count}): this instance holds only {len(out)} unfinished samples")
        return out

    def admit(self, samples: Sequence[MigratingSample]) -> None:
        """Take over migrated samples. Started ones wait (ahead of the queue) for a free slot, where the next
        `step()` imports their KV (transfer) or re-prefills prompt + tokens[:-1] (no KV sent); samples not started
        yet join the front of the waiting queue."""
        self.arrived.extend(s for s in samples if s.request.tokens)
        self.waiting.extendleft(reversed([s.request for s in samples if not s.request.tokens]))

    def _admit_arrived(self) -> None:
        reprefill: list[tuple[SampleRequest, int]] = []
        while self.arrived and self.free_slots:
            sample = self.arrived.popleft()
            slot = self.free_slots.pop(0)
            self.running[slot] = sample.request
            if sample.kv is not None:
                self.cache.import_slot(slot, sample.kv)
            else:
                reprefill.append((sample.request, slot))
        if reprefill:
            sequences = [
                torch.cat([r.prompt_P, torch.tensor(r.tokens[:-1], dtype=torch.long)]) for r, _ in reprefill
            ]
            self._prefill(sequences, [slot for _, slot in reprefill])
