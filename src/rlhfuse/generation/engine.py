"""`GenerationEngine`: continuous batching over engine-owned KV-cache slots, one generation instance.

Legend: B rows of one forward call, P prompt tokens, N max new tokens, V vocabulary, S cache slots.

A sample's life: it waits in the queue, is admitted when a slot is free (its prompt prefilled, or copied from a
sibling's prefill with prefix sharing), then decodes one token per `step()` with whatever other samples are
running, and leaves (its slot freed, reset, reused) as soon as it stops. Between steps a running sample holds in
its slot the KV of prompt + all generated tokens but the last one, which the next step feeds: that is the whole
state migration moves (`evict` / `admit`), by KV transfer or by re-prefilling prompt + tokens[:-1].

Token t of a sample is drawn with uniform t of the sample's own stream, seeded by (run seed, iteration, prompt
id, sample index) exactly as `rlhfuse.generation.batched.SamplingGenerator` does, with the same filtering and
inverse-CDF sampling: a sample's tokens do not depend on its batch, its slot, its instance or a migration.

With `speculative="ngram"|"auto"` a decode step may instead verify k drafted tokens per sample in one forward
pass of k+1 positions (`rlhfuse.generation.speculative`): the same uniforms, the same tokens, fewer steps.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from rlhfuse.algorithms.logits import logprobs_from_logits
from rlhfuse.core.sampling import (
    Sampling,
    SamplingConfig,
    filter_logits,
    sample_from,
    sample_seed,
    sampling_dtype,
)
from rlhfuse.core.timing import OpTimer
from rlhfuse.core.types import PromptBatch, Rollout
from rlhfuse.generation.prefix_store import PrefixStore
from rlhfuse.generation.speculative import Drafter, SpeculationCosts, speculation_problems
from rlhfuse.models import KVCache, SlotState, Transformer, load_weights, upload


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
    def of(config: SamplingConfig, eos_token_id: int) -> SamplingParams:
        """The `generator.*` sampling settings, with the tokenizer's EOS among the stop tokens."""
        return SamplingParams(
            max_new_tokens=config.max_new_tokens,
            temperature=config.temperature,
            top_k=config.top_k,
            top_p=config.top_p,
            stop_token_ids=tuple(sorted({eos_token_id, *config.stop_token_ids})),
        )


def call_settings(
    sampling: Sampling | None, params: SamplingParams, samples_per_prompt: int, eos_token_id: int
) -> tuple[SamplingParams, int]:
    """The sampling parameters and samples per prompt of one `generate` call: `sampling`'s when it has its own
    (held-out evaluation), else the generator's (`params`, `samples_per_prompt`)."""
    if sampling is None:
        return params, samples_per_prompt
    return SamplingParams.of(sampling.config, eos_token_id), sampling.samples_per_prompt


class TokenChoice(Protocol):
    """How a step's tokens are chosen from its logits rows (one row per token to choose: a sample's next
    position, or each position of a verify step). `lockstep`: the choice is a collective over ranks that must
    therefore make every step's decisions alike (no timing-driven choice such as speculative="auto")."""

    lockstep: bool

    def greedy(self, logits_NV: Tensor) -> Tensor:
        """The most likely token of each row (long [N])."""
        ...

    def sample(self, logits_NV: Tensor, uniforms_N: Tensor, params: SamplingParams) -> Tensor:
        """Each row's token after temperature / top-k / top-p filtering, drawn by inverse CDF with its uniform
        (float64 [N] on the logits' device; the choice may compute in less, `sampling_dtype`)."""
        ...

    def logprobs(self, logits_NV: Tensor, tokens_N: Tensor, temperature: float) -> Tensor:
        """The chosen tokens' log-probs, log softmax(logits / temperature)[token] over the whole vocabulary in
        float32 (float32 [N]): what the trainer recomputes for them (`rollout/logprob_abs_diff`)."""
        ...


class WholeVocabulary:
    """`TokenChoice` over whole logits in one process (`filter_logits` + `sample_from`), filtering and sampling
    in `dtype` (the engine's: `sampling_dtype` of its device)."""

    lockstep = False

    def __init__(self, dtype: torch.dtype = torch.float64) -> None:
        self.dtype = dtype

    def greedy(self, logits_NV: Tensor) -> Tensor:
        return logits_NV.argmax(dim=-1)

    def sample(self, logits_NV: Tensor, uniforms_N: Tensor, params: SamplingParams) -> Tensor:
        probs_NV = filter_logits(
            logits_NV.float(), temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
            dtype=self.dtype,
        )  # fmt: skip
        return sample_from(probs_NV, uniforms_N)

    def logprobs(self, logits_NV: Tensor, tokens_N: Tensor, temperature: float) -> Tensor:
        return logprobs_from_logits(logits_NV.float(), tokens_N, temperature=temperature)


def logprob_temperature(params: SamplingParams) -> float:
    """The temperature the sampler's log-probs are taken at: the sampling one, 1 for greedy (as the trainer's)."""
    return params.temperature if params.temperature > 0 else 1.0


def read_choices(tokens: Tensor, logprobs: Tensor) -> tuple[list[Any], list[Any]]:
    """A step's chosen tokens and their log-probs in one device read (host lists, same nesting as the
    tensors; a token id is exact in float64)."""
    both = torch.stack((tokens.to(torch.float64), logprobs.to(torch.float64))).tolist()
    ints = [[int(t) for t in row] for row in both[0]] if tokens.dim() == 2 else [int(t) for t in both[0]]
    return ints, both[1]


@dataclass
class SampleRequest:
    """One sample to generate and its progress (what migration moves besides the KV cache).

    row: the sample's row in the iteration's rollout; prompt_index / sample_index: its RNG key (dataset prompt
    id, which of the prompt's samples); group: samples with the same group share their prompt's prefill;
    prompt_P: long [P], the unpadded prompt; seed: the sample's stream seed; tokens: generated so far;
    logprobs: the sampler's log-prob of each of them (`TokenChoice.logprobs`), kept beside them.
    """

    row: int
    prompt_index: int
    sample_index: int
    group: int
    prompt_P: Tensor
    seed: int
    tokens: list[int] = field(default_factory=list)
    stopped: bool = False
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    """The weight version each token was sampled with, recorded by an engine with a `StepGate` (else empty)."""
    _uniforms: list[float] | None = field(default=None, repr=False)
    prompt_len: int = field(init=False, repr=False)
    """len(prompt_P), kept as a host int (a tensor's len() is a Python call the decode loop would pay per row)."""

    def __post_init__(self) -> None:
        self.prompt_len = int(self.prompt_P.shape[0])

    def uniforms(self, max_new_tokens: int) -> list[float]:
        """The sample's stream of `max_new_tokens` float64 uniforms, as host floats (exact: a Python float is a
        float64), so that a decode step gathers its rows' uniforms into one tensor without indexing tensors."""
        if self._uniforms is None:
            rng = torch.Generator().manual_seed(self.seed)
            self._uniforms = torch.rand(max_new_tokens, generator=rng, dtype=torch.float64).tolist()
        return self._uniforms


@dataclass
class MigratingSample:
    """A running sample leaving its instance: its request (tokens so far) and, for KV transfer, its slot's
    cache (prompt + tokens[:-1]); `kv is None` means the destination re-prefills."""

    request: SampleRequest
    kv: SlotState | None


@dataclass
class EngineStats:
    """Per-engine counters. batch_sizes / step_times / step_seconds: running samples of each decode step, when
    it ended (perf_counter seconds) and how long it took; step_positions: positions per row it computed (1, or
    k+1 for a speculative verify step); step_tokens: tokens it generated; tokens: generated tokens;
    prefill_tokens: prompt (and re-prefill) tokens computed; spec_proposed / spec_accepted: draft tokens verified
    and accepted; inference_* / lockstep_* / migration*: a fused rollout's measured costs."""

    batch_sizes: list[int] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    step_positions: list[int] = field(default_factory=list)
    step_tokens: list[int] = field(default_factory=list)
    tokens: int = 0
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    busy_seconds: float = 0.0
    spec_proposed: int = 0
    spec_accepted: int = 0
    # a fused rollout's measured costs (`rlhfuse.generation.fusion`, read by the Rt tuner's `CostProfile.fit`):
    # inference calls, the count watch per decode step before the migration, the migration itself
    inference_seconds: float = 0.0
    inference_tokens: int = 0
    lockstep_seconds: float = 0.0
    lockstep_steps: int = 0
    migration_seconds: float = 0.0
    migrations: int = 0

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
    prompt_lengths = torch.tensor([r.prompt_len for r in requests])
    width_p = int(prompt_lengths.max())
    prompt_BP = torch.nn.utils.rnn.pad_sequence(
        [r.prompt_P for r in requests], batch_first=True, padding_value=pad_token_id, padding_side="left"
    )
    width_r = max(max((len(r.tokens) for r in requests), default=1), 1)
    responses = [r.tokens + [pad_token_id] * (width_r - len(r.tokens)) for r in requests]
    lengths = torch.tensor([len(r.tokens) for r in requests])
    logprobs_BR = None
    if all(len(r.logprobs) == len(r.tokens) for r in requests):
        logprobs_BR = torch.tensor(
            [r.logprobs + [0.0] * (width_r - len(r.logprobs)) for r in requests], dtype=torch.float32
        )
    versions_BR = None
    if any(r.versions for r in requests) and all(len(r.versions) == len(r.tokens) for r in requests):
        versions_BR = torch.tensor([r.versions + [0] * (width_r - len(r.versions)) for r in requests])
    return Rollout(
        prompt_ids_BP=prompt_BP,
        prompt_mask_BP=(torch.arange(width_p) >= width_p - prompt_lengths[:, None]).long(),
        response_ids_BR=torch.tensor(responses, dtype=torch.long),
        response_mask_BR=(torch.arange(width_r) < lengths[:, None]).long(),
        prompt_index_B=torch.tensor([r.prompt_index for r in requests], dtype=torch.long),
        sample_index_B=torch.tensor([r.sample_index for r in requests], dtype=torch.long),
        finished_B=torch.tensor([r.stopped for r in requests], dtype=torch.bool),
        sampler_logprobs_BR=logprobs_BR,
        versions_BR=versions_BR,
    )


class StepGate(Protocol):
    """What the decode steps of an engine whose weights may change between steps run under (partial rollouts:
    `rlhfuse.trainer.asynchronous`): `step()` holds the weights for one step and yields their version, which
    the step's tokens record (`SampleRequest.versions`); a weight load waits for the step to end."""

    def step(self) -> AbstractContextManager[int]: ...


class GenerationEngine:
    """One generation instance: a copy of the Actor (or its tensor-parallel shard) and a KV cache of `num_slots`
    x `max_len` positions (the kv heads the model computes).

    `choice`: how tokens are chosen from the logits (default `WholeVocabulary`; a shard's instance passes
    `rlhfuse.generation.vocab_parallel.VocabularyShards`, and its ranks then step in lockstep: the same requests
    in the same order give the same admissions, forward calls and tokens on each of them)."""

    def __init__(
        self,
        model: Transformer,
        params: SamplingParams,
        *,
        num_slots: int,
        max_len: int,
        prefix_sharing: bool = True,
        speculative: str = "off",
        speculative_tokens: int = 4,
        choice: TokenChoice | None = None,
        gate: StepGate | None = None,
        prefixes: PrefixStore | None = None,
    ) -> None:
        if params.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={params.max_new_tokens} must be >= 1")
        self.device = next(model.parameters()).device
        self.choice: TokenChoice = WholeVocabulary(sampling_dtype(self.device)) if choice is None else choice
        problems = speculation_problems(
            speculative, speculative_tokens, params.max_new_tokens, model.config.attention_backend
        )
        if self.choice.lockstep and speculative == "auto":
            problems.append(
                "speculative=auto chooses from this rank's timings, which ranks choosing tokens together would "
                "not share: use speculative=off or ngram"
            )
        if problems:
            raise ValueError("; ".join(problems))
        self.model = model
        self.params = params
        self.prefix_sharing = prefix_sharing
        self.prefixes = prefixes
        """Finished samples' KV kept for a prompt that continues one (`rlhfuse.generation.prefix_store`)."""
        self.speculative = speculative
        self.speculative_tokens = speculative_tokens
        self.drafter = Drafter()
        self.costs = SpeculationCosts()  # kept across batches: `auto` learns this machine's step costs
        parameter = next(model.parameters())
        self.cache = KVCache.allocate(
            model.cache_config(), num_slots, max_len, dtype=parameter.dtype, device=self.device
        )
        # checked on the host, against the tokens a step reads once
        self.stop_ids = frozenset(params.stop_token_ids)
        self.waiting: deque[SampleRequest] = deque()
        self.arrived: deque[MigratingSample] = deque()  # migrated in, started, waiting for a slot
        self.running: dict[int, SampleRequest] = {}  # slot -> sample
        self.free_slots: list[int] = list(range(num_slots))
        self.stats = EngineStats()
        self.gate = gate
        self.version = 0  # the weights' version during the current step (with a gate)
        self.prefill_timer = OpTimer(self.device)
        """Times each prefill on the device (CUDA events: the host only launches it); read at the step's end."""

    # ------------------------------------------------------------------ queue
    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.arrived)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.arrived)

    def add(self, requests: Iterable[SampleRequest]) -> None:
        """Queue samples; they are admitted in order as slots free up."""
        if not self.has_work():
            self.drafter.clear()  # a new batch: its prompt groups are new
        for request in requests:
            longest = request.prompt_len + self.params.max_new_tokens
            if longest > self.cache.max_len:
                raise ValueError(
                    f"sample row {request.row}: prompt of {request.prompt_len} tokens + max_new_tokens="
                    f"{self.params.max_new_tokens} needs {longest} cache positions but max_len="
                    f"{self.cache.max_len}; build the engine with a larger max_len"
                )
            self.waiting.append(request)

    def load_weights(self, named_tensors: Mapping[str, Tensor]) -> None:
        load_weights(self.model, named_tensors)

    def run(self, requests: Sequence[SampleRequest]) -> list[SampleRequest]:
        """Queue `requests` and step until every sample this engine holds finished: the requests, in the order
        given, with their tokens (static batching when they fit the slots; continuous batching beyond)."""
        self.add(requests)
        while self.has_work():
            self.step()
        return list(requests)

    # ------------------------------------------------------------------ one step
    def step(self) -> list[SampleRequest]:
        """Admit waiting samples into free slots (prefill), then one decode step of every running sample.
        Returns the samples that finished during this step (their slots are already free). With a gate, under
        it: the weights hold still for the step, and its tokens record their version."""
        if self.gate is None:
            return self._step()
        with self.gate.step() as version:
            self.version = version
            return self._step()

    @torch.no_grad()
    def _step(self) -> list[SampleRequest]:
        start = time.perf_counter()
        self._admit_arrived()
        finished = self._admit_waiting()
        if self.running:
            finished += self._decode()
        if self.prefill_timer.pending:  # after the step's read of its tokens: the prefill's events are done
            self.stats.prefill_seconds += sum(seconds for _, seconds in self.prefill_timer.take())
        self.stats.busy_seconds += time.perf_counter() - start
        return finished

    def _admit_waiting(self) -> list[SampleRequest]:
        take: list[SampleRequest] = []
        while self.waiting and len(take) < len(self.free_slots):
            take.append(self.waiting.popleft())
        if not take:
            return []
        slots = [self.free_slots.pop(0) for _ in take]
        # a prompt continuing a kept sample's KV (a multi-turn episode's next turn) prefills only its new tokens
        kept = self._continued(take, slots)
        # prefix sharing: one prefill per group among the other admitted samples, copied to the others' slots
        groups: dict[int, list[int]] = {}
        for k, request in enumerate(take):
            if k not in kept:
                key = request.group if self.prefix_sharing else -1 - k
                groups.setdefault(key, []).append(k)
        leaders = [members[0] for members in groups.values()]
        parts = []
        logits_rows = [0] * len(take)
        if leaders:
            parts.append(self._prefill([take[k].prompt_P for k in leaders], [slots[k] for k in leaders]))
        for g, members in enumerate(groups.values()):
            self.cache.copy_slot(slots[members[0]], [slots[k] for k in members[1:]])
            for k in members:
                logits_rows[k] = g
        if kept:
            parts.append(self._extend([take[k] for k in kept], [slots[k] for k in kept], list(kept.values())))
            for j, k in enumerate(kept):
                logits_rows[k] = len(leaders) + j
        logits_XV = torch.cat(parts) if len(parts) > 1 else parts[0]
        first, logprobs = read_choices(*self._sample(logits_XV[upload(logits_rows, self.device)], take))
        done = []
        for request, slot, token, logprob in zip(take, slots, first, logprobs, strict=True):  # the one read
            self.running[slot] = request
            self._track(request)
            if self._append(request, token, logprob):
                done.append(slot)
        return self._release(done)

    def _continued(self, take: Sequence[SampleRequest], slots: Sequence[int]) -> dict[int, int]:
        """The admitted requests (index in `take`) whose prompt continues a kept state, each imported into its
        slot: index -> the positions imported."""
        if self.prefixes is None or not self.prefixes.entries:
            return {}
        kept: dict[int, int] = {}
        for k, request in enumerate(take):
            found = self.prefixes.take(request.prompt_P.tolist())
            if found is not None:
                length, state = found
                self.cache.import_slot(slots[k], state)
                kept[k] = length
        return kept

    def _extend(self, requests: Sequence[SampleRequest], slots: Sequence[int], kept: Sequence[int]) -> Tensor:
        """The prompts' positions after the `kept` ones already in their slots, appended (right-padded, the
        padding's positions cut off after); each row's last-position logits [B, V]. One forward pass, or one per
        row where the padding would pass a slot's `max_len`."""
        rest = [request.prompt_P[n:] for request, n in zip(requests, kept, strict=True)]
        width = max(len(r) for r in rest)
        if max(n for n in kept) + width <= self.cache.max_len:
            return self._extend_rows(rest, slots)
        return torch.cat([self._extend_rows([r], [slot]) for r, slot in zip(rest, slots, strict=True)])

    def _extend_rows(self, rest: Sequence[Tensor], slots: Sequence[int]) -> Tensor:
        lengths = [self.cache.lengths[s] for s in slots]
        with self.prefill_timer.measure("prefill"):
            logits_BTV = self._forward_rows(rest, slots)
        self.cache.truncate(slots, [n + len(r) for n, r in zip(lengths, rest, strict=True)])
        self.stats.prefill_tokens += sum(len(r) for r in rest)
        last_B = upload([len(r) - 1 for r in rest], self.device)
        return logits_BTV[torch.arange(len(rest), device=self.device), last_B]

    def _forward_rows(self, rows: Sequence[Tensor | Sequence[int]], slots: Sequence[int]) -> Tensor:
        """Token ids appended to their slots' caches in one forward pass, right-padded to the longest row (the
        padding masked; the caller cuts its positions off): logits [B, T, V]."""
        width = max(len(r) for r in rows)
        ids_BT = torch.zeros((len(rows), width), dtype=torch.long)
        mask_BT = torch.zeros((len(rows), width), dtype=torch.long)
        for b, row in enumerate(rows):
            ids_BT[b, : len(row)] = torch.as_tensor(row, dtype=torch.long)
            mask_BT[b, : len(row)] = 1
        return self.model(
            upload(ids_BT, self.device),
            attention_mask_BT=upload(mask_BT, self.device),
            cache=self.cache,
            cache_slots_B=list(slots),
        )

    def _prefill(self, sequences: Sequence[Tensor], slots: Sequence[int]) -> Tensor:
        """Left-padded prefill of `sequences` into `slots` (emptied first); last-position logits [G, V]."""
        width = max(len(s) for s in sequences)
        ids_BP = torch.zeros((len(sequences), width), dtype=torch.long)
        mask_BP = torch.zeros((len(sequences), width), dtype=torch.long)
        for b, seq in enumerate(sequences):
            ids_BP[b, width - len(seq) :] = seq
            mask_BP[b, width - len(seq) :] = 1
        # timed on the device: `perf_counter` here would time the launches (the migration mechanism's choice and
        # the Rt tuner read these seconds); added to the stats once the step has read its tokens (`step`)
        with self.prefill_timer.measure("prefill"):
            self.cache.reset(list(slots))
            logits_BPV = self.model(
                upload(ids_BP, self.device),
                attention_mask_BT=upload(mask_BP, self.device),
                cache=self.cache,
                cache_slots_B=list(slots),
            )
        self.stats.prefill_tokens += sum(len(s) for s in sequences)
        return logits_BPV[:, -1]

    def _decode(self) -> list[SampleRequest]:
        start = time.perf_counter()
        slots = sorted(self.running)
        requests = [self.running[s] for s in slots]
        drafts = self._drafts(slots, requests)
        if drafts:
            return self._verify(start, slots, requests, drafts)
        # slots, lengths, positions and stops are host bookkeeping: the step's one device read is the sampled
        # tokens. The last token's position: the real tokens before it (the prompt's and the earlier generated).
        inputs_2B = upload(
            [[r.tokens[-1] for r in requests], [r.prompt_len + len(r.tokens) - 1 for r in requests]],
            self.device,
        )
        logits_BV = self.model(
            inputs_2B[0][:, None],
            position_ids_BT=inputs_2B[1][:, None],
            cache=self.cache,
            cache_slots_B=slots,
        )[:, -1]
        tokens, logprobs = read_choices(*self._sample(logits_BV, requests))  # the one read
        finished = self._release(
            [
                slot
                for slot, request, token, logprob in zip(slots, requests, tokens, logprobs, strict=True)
                if self._append(request, token, logprob)
            ]
        )
        seconds = self._record_step(start, len(slots), 1, len(slots))
        if self.speculative == "auto":
            self.costs.observe_decode(len(slots), seconds)
        return finished

    def _record_step(self, start: float, rows: int, positions: int, tokens: int) -> float:
        self.stats.batch_sizes.append(rows)
        self.stats.step_times.append(time.perf_counter())
        self.stats.step_seconds.append(self.stats.step_times[-1] - start)
        self.stats.step_positions.append(positions)
        self.stats.step_tokens.append(tokens)
        return self.stats.step_seconds[-1]

    def _drafts(self, slots: Sequence[int], requests: Sequence[SampleRequest]) -> list[list[int]]:
        """Each running sample's draft, all cut to one width K (the verify step's k+1 positions must fit every
        slot and stay within max_new_tokens); [] = decode plainly this step."""
        k = self.speculative_tokens
        if self.speculative == "off" or (self.speculative == "auto" and not self.costs.decide(len(slots), k)):
            return []
        n = self.params.max_new_tokens
        drafts = [self.drafter.draft(r.row, min(k, n - len(r.tokens) - 1)) for r in requests]
        width = max(len(d) for d in drafts)
        if width == 0:
            return []
        width = min(width, self.cache.max_len - 1 - max(self.cache.lengths[s] for s in slots))
        if width <= 0:
            return []
        return [d[:width] for d in drafts]

    def _verify(
        self,
        start: float,
        slots: Sequence[int],
        requests: Sequence[SampleRequest],
        drafts: Sequence[Sequence[int]],
    ) -> list[SampleRequest]:
        """One forward pass of [last token, draft...] per running sample; accept drafts while the token sampled
        with the sample's own uniform equals the draft, keep the first mismatch, trim the rejected positions."""
        width = 1 + max(len(d) for d in drafts)
        lengths = [self.cache.lengths[s] for s in slots]
        logits_BTV = self._forward_rows(
            [[request.tokens[-1], *draft] for request, draft in zip(requests, drafts, strict=True)], slots
        )
        # the step's one read
        tokens_BT, logprobs_BT = read_choices(*self._sample_positions(logits_BTV, requests, width))
        kept_B = [0] * len(slots)
        done: list[int] = []
        for b, (request, draft) in enumerate(zip(requests, drafts, strict=True)):
            self.stats.spec_proposed += len(draft)
            for j, token in enumerate(tokens_BT[b][: 1 + len(draft)]):
                kept_B[b] += 1
                if self._append(request, token, logprobs_BT[b][j]):
                    done.append(b)
                    break
                if j == len(draft) or token != draft[j]:
                    break
                self.stats.spec_accepted += 1
        # the slot keeps [last token, accepted drafts]: again prompt + tokens[:-1]
        self.cache.truncate(slots, [n + k for n, k in zip(lengths, kept_B, strict=True)])
        finished = self._release([slots[b] for b in done])
        tokens = sum(kept_B)
        seconds = self._record_step(start, len(slots), width, tokens)
        if self.speculative == "auto":
            self.costs.observe_verify(len(slots), width, seconds, tokens)
        return finished

    def _sample(self, logits_BV: Tensor, requests: Sequence[SampleRequest]) -> tuple[Tensor, Tensor]:
        """Each row's next token and its log-prob (long [B], float32 [B]): `_sample_positions` of one position."""
        tokens_B1, logprobs_B1 = self._sample_positions(logits_BV[:, None], requests, 1)
        return tokens_B1[:, 0], logprobs_B1[:, 0]

    def _sample_positions(
        self, logits_BTV: Tensor, requests: Sequence[SampleRequest], width: int
    ) -> tuple[Tensor, Tensor]:
        """Token t + j of each row sampled from position j's distribution with uniform u(s, t + j): what plain
        decoding samples for that position when the row's earlier tokens are the drafts (long [B, width]), and
        their log-probs (float32 [B, width])."""
        p = self.params
        logits_NV = logits_BTV.flatten(0, 1)
        if p.temperature == 0:
            tokens_N = self.choice.greedy(logits_NV)
        else:
            n = p.max_new_tokens
            # positions past max_new_tokens are never kept: any uniform will do for them
            uniforms_N = torch.tensor(
                [
                    r.uniforms(n)[min(t, n - 1)]
                    for r in requests
                    for t in range(len(r.tokens), len(r.tokens) + width)
                ],
                dtype=torch.float64,
            )
            tokens_N = self.choice.sample(logits_NV, upload(uniforms_N, logits_NV.device), p)
        logprobs_N = self.choice.logprobs(logits_NV, tokens_N, logprob_temperature(p))
        return tokens_N.view(len(requests), width), logprobs_N.view(len(requests), width)

    def _track(self, request: SampleRequest) -> None:
        if self.speculative != "off":
            self.drafter.track(request.row, request.group, request.prompt_P.tolist(), request.tokens)

    def _append(self, request: SampleRequest, token: int, logprob: float) -> bool:
        """Record a sampled token and its log-prob; True when the sample is done."""
        request.tokens.append(token)
        request.logprobs.append(logprob)
        if self.gate is not None:
            request.versions.append(self.version)
        if self.speculative != "off":
            self.drafter.append(request.row, (token,))
        self.stats.tokens += 1
        request.stopped = token in self.stop_ids
        return request.stopped or len(request.tokens) >= self.params.max_new_tokens

    def _release(self, slots: Sequence[int]) -> list[SampleRequest]:
        """Finished (or leaving) samples out of `slots`, whose blocks go back to the pool in one reset."""
        if not slots:
            return []
        requests = [self.running.pop(slot) for slot in slots]
        if self.prefixes is not None:  # a finished sample's KV, for a prompt that continues it
            for slot, request in zip(slots, requests, strict=True):
                if request.stopped or len(request.tokens) >= self.params.max_new_tokens:
                    ids = [*request.prompt_P.tolist(), *request.tokens[:-1]]
                    self.prefixes.put(ids, self.cache.export_slot(slot))
        self.cache.reset(list(slots))
        self.free_slots.extend(slots)
        self.free_slots.sort()
        return requests

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
            (request,) = self._release([slot])
            out.append(MigratingSample(request, kv))
        if len(out) < count:
            raise ValueError(f"evict({count}): this instance holds only {len(out)} unfinished samples")
        return out

    def admit(self, samples: Sequence[MigratingSample]) -> None:
        """Take over migrated samples. Started ones wait (ahead of the queue) for a free slot, where the next
        `step()` imports their KV (transfer) or re-prefills prompt + tokens[:-1] (no KV sent); samples not started
        yet join the front of the waiting queue."""
        if not self.has_work():
            self.drafter.clear()  # an idle instance taking migrated samples: a new batch
        self.arrived.extend(s for s in samples if s.request.tokens)
        self.waiting.extendleft(reversed([s.request for s in samples if not s.request.tokens]))

    def _admit_arrived(self) -> None:
        reprefill: list[tuple[SampleRequest, int]] = []
        while self.arrived and self.free_slots:
            sample = self.arrived.popleft()
            slot = self.free_slots.pop(0)
            self.running[slot] = sample.request
            self._track(sample.request)
            if sample.kv is not None:
                self.cache.import_slot(slot, sample.kv)
            else:
                reprefill.append((sample.request, slot))
        if reprefill:
            sequences = [
                torch.cat([r.prompt_P, torch.tensor(r.tokens[:-1], dtype=torch.long)]) for r, _ in reprefill
            ]
            self._prefill(sequences, [slot for _, slot in reprefill])
