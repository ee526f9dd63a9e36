"""`EngineGenerator`: the trainer's `Generator` (generator=engine) on top of `GenerationEngine` instances.

Samples come back in the iteration's canonical order (prompt-major, sample index minor: the order
`SamplingGenerator` yields), whatever instance finished them and whether they migrated, so that training (whose
mini-batches are shuffles of row indices) sees the same batch with or without migration. The per-sample
completion stream is `EngineGenerator.stream(prompts, iteration=...)`.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor

from rlhfuse import distributed
from rlhfuse.core.protocols import Inferencer
from rlhfuse.core.sampling import Sampling
from rlhfuse.core.stats import GenerationStats, RolloutStats
from rlhfuse.core.types import Experience, PromptBatch, Rollout
from rlhfuse.core.wire import pack_tensors, unpack_tensors
from rlhfuse.generation.coordinator import Coordinator, Instance, MigrationReport, balance
from rlhfuse.generation.distributed import DistributedCoordinator, gather_finished
from rlhfuse.generation.engine import (
    GenerationEngine,
    SampleRequest,
    SamplingParams,
    StepGate,
    call_settings,
    requests_for,
    to_rollout,
)
from rlhfuse.generation.fusion import FusedResult, fused_generate_infer
from rlhfuse.generation.generation_config import EngineOptions, GenerationConfig
from rlhfuse.generation.lockstep import LockstepLeader, follow, shared_result
from rlhfuse.generation.migration import BatchObservation, MigrationPolicy, NoMigration
from rlhfuse.generation.open_rollout import OpenRollout
from rlhfuse.generation.prefix_store import PrefixStore
from rlhfuse.generation.transport import PointToPoint, collective_device
from rlhfuse.generation.tuning import AutoThreshold, CostProfile, SimResult
from rlhfuse.models import Transformer, load_weights


@dataclass(frozen=True)
class InstanceSetup:
    """What every multi-instance generator takes besides the Actor and `generator.*`: the tokenizer's EOS and
    pad ids, samples per prompt, the run seed (per-sample streams), the migration policy and BSmax."""

    eos_token_id: int
    pad_token_id: int
    samples_per_prompt: int
    seed: int
    policy: MigrationPolicy = field(default_factory=NoMigration)
    bs_max: int = 32


class InstancePool(Protocol):
    """Where a multi-instance generator's instances come from, and the Actor weights they hold: `EnginePool`
    (rlhfuse's `GenerationEngine` on copies of the Actor) or `VLLMPool` (vLLM engines,
    `rlhfuse.generation.vllm_engine`). The generator drives whichever it is given the same way."""

    @property
    def device(self) -> torch.device:
        """Where this process's instances compute (and so its collectives' tensors live under NCCL)."""
        ...

    def instances(
        self, count: int, prompt_width: int, batch: int, params: SamplingParams, gate: StepGate | None = None
    ) -> list[Instance]:
        """`count` instances able to run a batch of `batch` samples with prompts up to `prompt_width` tokens,
        sampling with `params`, their statistics reset (kept instances are reused); `gate`: each decode step
        under it (partial rollouts: weights that may change between steps, each token's version recorded)."""
        ...

    def load_weight_buckets(self, buckets: Iterable[Mapping[str, Tensor]]) -> None:
        """The Actor's weights (all of them, or the part that changed) into every instance, streamed in buckets
        (`rlhfuse.core.protocols.Generator.load_weight_buckets`: each consumed, in order, before the next)."""
        ...

    def actor_copies(self) -> list[torch.nn.Module]:
        """The Actor copies held as modules of this process (none for vLLM's engines)."""
        ...

    def release(self, index: int) -> None:
        """Instance `index` was freed by a migration: release what memory it can until the next batch."""
        ...

    def rest(self) -> None:
        """The rollout is over: release what memory the instances can until the next weight sync or batch
        (vLLM's sleep mode through the training step)."""
        ...

    def close(self) -> None:
        """Release what outlives the modules (vLLM's engine processes)."""
        ...


class LockstepRole(NamedTuple):
    """A rank's part in an instance of generator.tp ranks (`rlhfuse.generation.lockstep`): the instance's index,
    its first rank, its control group, the first ranks' group, and the first rank's `LockstepLeader` (None on the
    other ranks, whose `following` makes the leader's calls as it is read)."""

    instance: int
    leader: int
    group: Any
    leaders: Any
    lead: LockstepLeader | None
    following: Iterator[SampleRequest]


class EnginePool:
    """`InstancePool` of rlhfuse's own engine: one copy of the Actor per instance (the in-process mode adds the
    other instances' copies on first use), each with its KV cache."""

    def __init__(self, actor: Transformer, options: EngineOptions) -> None:
        self.options = options
        self.models = [copy.deepcopy(actor).eval().requires_grad_(False)]
        self.engines: list[GenerationEngine] = []
        # one store for every engine of the pool, kept when an engine is rebuilt for longer prompts
        self.prefixes = PrefixStore(options.prefix_cache) if options.prefix_cache else None

    @property
    def device(self) -> torch.device:
        return next(self.models[0].parameters()).device

    def instances(
        self, count: int, prompt_width: int, batch: int, params: SamplingParams, gate: StepGate | None = None
    ) -> list[Instance]:
        max_len = prompt_width + params.max_new_tokens
        slots = self.options.num_slots or batch
        while len(self.models) < count:
            self.models.append(copy.deepcopy(self.models[0]))
        if (
            len(self.engines) != count
            or any(e.has_work() for e in self.engines)  # an earlier generate stopped part-way
            or self.engines[0].cache.max_len < max_len
            or self.engines[0].cache.num_slots != slots
        ):
            self.engines = [
                GenerationEngine(
                    model,
                    params,
                    num_slots=slots,
                    max_len=max_len,
                    prefix_sharing=self.options.prefix_sharing,
                    prefixes=self.prefixes,
                    speculative=self.options.speculative,
                    speculative_tokens=self.options.speculative_tokens,
                )
                for model in self.models[:count]
            ]
        for engine in self.engines:
            engine.stats = type(engine.stats)()
            engine.params = params
            engine.gate = gate
        return list(self.engines)

    def load_weight_buckets(self, buckets: Iterable[Mapping[str, Tensor]]) -> None:
        for bucket in buckets:  # copied into every instance's copy, then freed
            for model in self.models:
                load_weights(model, bucket)
        if self.prefixes is not None:  # the kept KV was computed with the weights now replaced
            self.prefixes.clear()

    def actor_copies(self) -> list[torch.nn.Module]:
        return list(self.models)

    def release(self, index: int) -> None:
        """The engine keeps its cache: nothing to release between batches."""

    def rest(self) -> None:
        """Nothing: the caches are reused by the next batch."""

    def close(self) -> None:
        """In-process modules: nothing outlives them."""


class EngineGenerator:
    """`config.instances` generation instances from an `InstancePool` (rlhfuse's engine, or vLLM's).

    On an initialised torch.distributed world of exactly `config.instances` ranks (e.g. `distributed.
    nproc_per_node=2 generator.instances=2`), each rank is one instance (`DistributedCoordinator`: migration
    point-to-point) and every rank gets the whole rollout (all-gathered); otherwise the instances are stepped in
    turn in this process (`Coordinator`). Both give the same samples.
    """

    def __init__(
        self,
        pool: InstancePool,
        config: GenerationConfig,
        setup: InstanceSetup,
        *,
        mechanism: str = "auto",
        link_bytes_per_s: float = 1e9,
    ) -> None:
        if config.instances < 1:
            raise ValueError(f"generator.instances={config.instances} must be >= 1")
        self.pool = pool
        self.config = config
        self.params = SamplingParams.of(config.sampling, setup.eos_token_id)
        self.eos_token_id = setup.eos_token_id
        self.pad_token_id = setup.pad_token_id
        self.samples_per_prompt = setup.samples_per_prompt
        self.seed = setup.seed
        self.policy: MigrationPolicy = setup.policy
        self.coordinator = Coordinator(
            [], bs_max=setup.bs_max, mechanism=mechanism, link_bytes_per_s=link_bytes_per_s
        )
        # the last batch's migration report (one per batch, whichever path ran it)
        self.report = MigrationReport()
        self.engines: list[Instance] = []  # the last batch's instances (their statistics)
        self._predicted: tuple[object, object] | None = None
        # a partial rollout's gate (`generate_partial`), handed to the instances it runs
        self._gate: StepGate | None = None
        # instances of generator.tp ranks: (this rank's instance control group, the instances' first ranks' group)
        self._lockstep_groups: tuple[Any, Any] | None = None

    def load_weights(self, named_tensors: Mapping[str, Tensor]) -> None:
        self.pool.load_weight_buckets([named_tensors])

    def load_weight_buckets(self, buckets: Iterable[Mapping[str, Tensor]]) -> None:
        self.pool.load_weight_buckets(buckets)

    def actor_copies(self) -> list[torch.nn.Module]:
        """The Actor copies of this process's instances (none for vLLM's engines)."""
        return self.pool.actor_copies()

    def close(self) -> None:
        """The pool's instances shut down, and no reference to them kept here: an engine holding process-wide
        state (vLLM's groups) must not outlive its shutdown until the interpreter's exit tears things down in
        arbitrary order."""
        self.engines, self.coordinator.engines = [], []
        self.pool.close()

    @property
    def device(self) -> torch.device:
        """Where this rank's instances compute (and so its collectives' tensors live under NCCL)."""
        return self.pool.device

    def is_distributed(self) -> bool:
        """The instances over the processes: a torch.distributed world of exactly `generator.instances` x
        `generator.tp` ranks (more than one), instance i on ranks i * tp .. i * tp + tp - 1 (tp > 1: one engine
        with the backend's own tensor parallelism, its ranks stepping it in lockstep), unless `generator.in_process`
        keeps them in this one (the split placement's generation rank, in a world of as many ranks)."""
        ranks = self.config.instances * self.config.tp
        in_world = distributed.is_initialized() and distributed.world_size() == ranks
        return ranks > 1 and in_world and not self.config.in_process

    def _leads(self) -> bool:
        """This rank speaks for its instance (its first rank): what an instance of tp > 1 ranks finished or
        counted is the same on each of them, so only the first one's is gathered."""
        return distributed.rank() % self.config.tp == 0

    def _engines_for(
        self, prompt_width: int, batch: int, count: int, params: SamplingParams
    ) -> list[Instance]:
        self.engines = self.pool.instances(count, prompt_width, batch, params, self._gate)
        return self.engines

    def stream(
        self, prompts: PromptBatch, *, iteration: int, sampling: Sampling | None = None
    ) -> Iterator[tuple[int, SampleRequest]]:
        """(instance, finished sample) as each sample finishes."""
        params, per_prompt = call_settings(sampling, self.params, self.samples_per_prompt, self.eos_token_id)
        requests = requests_for(prompts, samples_per_prompt=per_prompt, seed=self.seed, iteration=iteration)
        width = max(r.prompt_len for r in requests)
        threshold = self.policy.threshold(len(requests))
        if not self.is_distributed():
            self.coordinator.engines = self._engines_for(width, len(requests), self.config.instances, params)
            released = False
            for index, sample in self.coordinator.run(requests, threshold=threshold):
                yield index, sample
                self.report = self.coordinator.report
                if not released and self.report.at:  # the freed instances have nothing left
                    released = True
                    for freed in self.report.freed:
                        self.pool.release(freed)
            return
        # every rank must use the same Rt (policies tune on rank-local timings): rank 0's
        agreed = torch.tensor([threshold], dtype=torch.int64, device=collective_device(None, self.device))
        distributed.broadcast(agreed, 0)
        (engine,) = self._engines_for(width, len(requests), 1, params)
        if self.config.tp > 1:
            yield from self._stream_lockstep(engine, requests, int(agreed))
            return
        release = functools.partial(self.pool.release, 0)
        yield from self._coordinated(engine, requests, int(agreed), distributed.rank(), None, release)

    def _coordinated(
        self, engine: Instance, requests: Sequence[SampleRequest], threshold: int, index: int, group: Any,
        release: Callable[[], None],
    ) -> Iterator[tuple[int, SampleRequest]]:  # fmt: skip
        """(index, finished sample) as `engine`, instance `index` of the instances on `group`'s ranks, finishes
        them under a `DistributedCoordinator`; `release` once a migration has freed this instance."""
        c = self.coordinator
        coordinator = DistributedCoordinator(
            engine, bs_max=c.bs_max, mechanism=c.mechanism, link_bytes_per_s=c.link_bytes_per_s, group=group
        )
        released = False
        for sample in coordinator.run(requests, threshold=threshold):
            yield index, sample
            report = self.report = coordinator.report
            if not released and report.at and index in report.freed:
                released = True
                release()

    def _groups_of_lockstep(self) -> tuple[Any, Any]:
        """(this rank's instance control group, the instances' first ranks' group), made once: a collective over
        the world (every rank makes every group)."""
        if self._lockstep_groups is None:
            tp, count = self.config.tp, self.config.instances
            groups = distributed.WorldGroups.current()
            self._lockstep_groups = (
                groups.control(
                    ("lockstep", "instance", tp), [range(i * tp, (i + 1) * tp) for i in range(count)]
                ),
                groups.control(("lockstep", "leaders", tp), [range(0, count * tp, tp)]),
            )
        return self._lockstep_groups

    def _lockstep_role(self, engine: Instance, requests: Sequence[SampleRequest]) -> LockstepRole:
        """This rank's part in its instance of generator.tp ranks for one batch of `requests`."""
        instance, position = divmod(distributed.rank(), self.config.tp)
        group, leaders = self._groups_of_lockstep()
        leader = instance * self.config.tp
        release = functools.partial(self.pool.release, 0)
        if position:
            share = balance(requests, self.config.instances)[instance]
            following = follow(engine, share, group, leader, release)
            return LockstepRole(instance, leader, group, leaders, None, following)
        return LockstepRole(
            instance, leader, group, leaders, LockstepLeader(engine, group, leader, release), iter(())
        )

    def _fused_lockstep(
        self, engine: Instance, inferencer: Inferencer, requests: Sequence[SampleRequest], threshold: int,
        micro_batch: int,
    ) -> FusedResult:  # fmt: skip
        """`fused_generate_infer` with instances of generator.tp ranks: the instances' first ranks run it among
        themselves, each instance's other ranks repeat its engine calls, then take its result."""
        role = self._lockstep_role(engine, requests)
        if role.lead is None:
            for _ in role.following:
                pass  # the leader's samples, inferred there
            return shared_result(None, role.group, role.leader, self.pad_token_id)
        lead = role.lead
        result = self._fused(lead, inferencer, requests, threshold, micro_batch, role.leaders, lead.release)
        lead.finish()
        return shared_result(result, role.group, role.leader, self.pad_token_id)

    def _fused(
        self, engine: Instance, inferencer: Inferencer, requests: Sequence[SampleRequest], threshold: int,
        micro_batch: int, group: Any, on_freed: Callable[[], None],
    ) -> FusedResult:  # fmt: skip
        """`fused_generate_infer` of `engine` among the instances on `group`'s ranks (None: the world)."""
        c = self.coordinator
        return fused_generate_infer(
            engine, inferencer, requests, threshold=threshold, bs_max=c.bs_max, mechanism=c.mechanism,
            micro_batch=micro_batch, pad_token_id=self.pad_token_id, group=group,
            link_bytes_per_s=c.link_bytes_per_s, on_freed=on_freed,
        )  # fmt: skip

    def _stream_lockstep(
        self, engine: Instance, requests: Sequence[SampleRequest], threshold: int
    ) -> Iterator[tuple[int, SampleRequest]]:
        """`stream` with instances of generator.tp ranks (`rlhfuse.generation.lockstep`): the instances' first
        ranks run the coordinator among themselves (migration included), each instance's other ranks repeat its
        engine calls; (instance, finished sample) on every rank of the instance."""
        role = self._lockstep_role(engine, requests)
        if role.lead is None:
            for sample in role.following:
                yield role.instance, sample
            return
        lead = role.lead
        yield from self._coordinated(lead, requests, threshold, role.instance, role.leaders, lead.release)
        lead.finish()

    def open_rollout(
        self, *, iteration: int, capacity: int, prompt_width: int, sampling: Sampling | None = None
    ) -> OpenRollout:
        """A rollout whose prompts join while the instances decode (`OpenRollout`): the instances of this process
        (in-process only: instances over processes decide together what each decodes), sized for `capacity`
        samples at once with prompts up to `prompt_width` tokens, migration at the policy's Rt for that batch;
        `sampling`: the call's own, else the run's."""
        if self.is_distributed():
            raise RuntimeError(
                "open_rollout: instances over the processes run fixed batches (dynamic sampling runs in rounds "
                "there: rlhfuse.trainer.rollout.DynamicSampling)"
            )
        params, per_prompt = call_settings(sampling, self.params, self.samples_per_prompt, self.eos_token_id)
        self._predicted = predictions(self.policy)
        self.coordinator.engines = self._engines_for(prompt_width, capacity, self.config.instances, params)

        def freed(indices: tuple[int, ...]) -> None:
            for index in indices:
                self.pool.release(index)

        open_ = OpenRollout(
            self.coordinator, samples_per_prompt=per_prompt, seed=self.seed, iteration=iteration,
            pad_token_id=self.pad_token_id, threshold=self.policy.threshold(capacity), on_migrated=freed,
        )  # fmt: skip
        self.report = self.coordinator.report  # the batch's, filled in place by its migration
        return open_

    def generate_partial(self, prompts: PromptBatch, *, iteration: int, gate: StepGate) -> Iterator[Rollout]:
        """`generate`, each decode step of every instance under `gate`: the weights may be replaced between two
        steps (a partial rollout continues its samples under the new ones, their KV cache kept), and each token
        records the version it was sampled with (`Rollout.versions_BR`). In-process instances only: the migration
        wire format carries no versions."""
        if self.is_distributed():
            raise ValueError(
                "generate_partial: instances over processes carry no token versions across migrations"
            )
        self._gate = gate
        try:
            yield from self.generate(prompts, iteration=iteration)
        finally:
            self._gate = None

    def generate(
        self, prompts: PromptBatch, *, iteration: int, sampling: Sampling | None = None
    ) -> Iterator[Rollout]:
        # what migration=auto predicted for this batch's Rt (made from the previous batches)
        self._predicted = predictions(self.policy)
        start = time.perf_counter()
        done = [sample for _, sample in self.stream(prompts, iteration=iteration, sampling=sampling)]
        seconds = time.perf_counter() - start
        if self.is_distributed():
            done = gather_finished(done if self._leads() else [])
        else:
            done = sorted(done, key=lambda r: r.row)
        measured = dataclasses.replace(
            observation(done, self.params.max_new_tokens, self.engines),
            measured_s=seconds,
            rt=self.migration.threshold,
            fused=False,
        )
        self.policy.observe(measured)
        self._rest_after(sampling)
        yield to_rollout(done, self.pad_token_id)

    def _rest_after(self, sampling: Sampling | None) -> None:
        """After a training rollout (no `sampling` of its own) training and a weight sync follow: the pool may
        release its memory until then (vLLM's sleep, weights discarded at level 2). An evaluation's rollout may be
        followed by the next one with no sync between: its instances stay as they are."""
        if sampling is None:
            self.pool.rest()

    def fused_rollout(
        self,
        prompts: PromptBatch,
        *,
        iteration: int,
        inferencer: Inferencer,
        sampling: Sampling | None = None,
        micro_batch: int = 16,
    ) -> tuple[Experience, RolloutStats]:
        """Generation fused with inference (`fused_generate_infer`), the instances over the processes (one per
        rank, or generator.tp ranks each: `_fused_lockstep`): the rollout's Experience (the same on every rank)
        and its statistics (`FusedRollout` runs this)."""
        if not self.is_distributed():
            raise RuntimeError(
                f"fused generation + inference needs the generation instances over the processes: "
                f"generator.instances={self.config.instances} x generator.tp={self.config.tp} on a world of "
                f"{distributed.world_size()} process(es)"
            )
        params, per_prompt = call_settings(sampling, self.params, self.samples_per_prompt, self.eos_token_id)
        requests = requests_for(prompts, samples_per_prompt=per_prompt, seed=self.seed, iteration=iteration)
        self._predicted = predictions(self.policy)
        agreed = torch.tensor(
            [self.policy.threshold(len(requests))],
            dtype=torch.int64,
            device=collective_device(None, self.device),
        )
        distributed.broadcast(agreed, 0)
        width = max(r.prompt_len for r in requests)
        (engine,) = self._engines_for(width, len(requests), 1, params)
        if self.config.tp > 1:
            result = self._fused_lockstep(engine, inferencer, requests, int(agreed), micro_batch)
        else:
            release = functools.partial(self.pool.release, 0)
            result = self._fused(engine, inferencer, requests, int(agreed), micro_batch, None, release)
        self._rest_after(sampling)
        self.report = result.report
        experience = result.experience.to(self.device)  # rewards, KL and GAE run on the device
        rollout = experience.rollout
        self.policy.observe(
            BatchObservation(
                response_lengths=rollout.response_lengths_B.tolist(),
                prompt_len=round(float(rollout.prompt_mask_BP.sum()) / len(rollout)),
                cap=self.params.max_new_tokens,
                slots=engine.cache.num_slots,
                profile=CostProfile.fit([engine.stats]),
                measured_s=result.gen_inf_s,
                rt=int(agreed),
            )
        )
        return experience, RolloutStats(
            generation_s=result.generation_s,
            inference_s=result.gen_inf_s - result.generation_s,
            generation_inference_s=result.gen_inf_s,
            generation=self.generation_stats(),
        )

    @property
    def migration(self) -> MigrationReport:
        return self.report

    def generation_stats(self) -> GenerationStats:
        """Statistics of the last `generate`: migration, running batch size, engine tokens/s (over every
        instance: with one instance per rank, a collective, so every rank calls it)."""
        stats = [e.stats for e in self.engines]
        sizes = [b for s in stats for b in s.batch_sizes]
        busy = sum(s.busy_seconds for s in stats)
        # generated tokens; draft tokens proposed and accepted; tokens made by decode (and verify) steps
        counts = [
            sum(s.tokens for s in stats),
            sum(s.spec_proposed for s in stats),
            sum(s.spec_accepted for s in stats),
            sum(sum(s.step_tokens) for s in stats),
        ]
        if self.is_distributed():  # every instance's counts, decode batch sizes and busy seconds
            if not self._leads():  # the instance's first rank counts for it
                counts, sizes, busy = [0] * len(counts), [], 0.0
            mine = pack_tensors([*counts, *sizes], [torch.tensor([busy], dtype=torch.float64)])
            transport = PointToPoint(collective_device(None, self.device))
            parts = [unpack_tensors(p) for p in transport.all_gather(mine)]
            sizes = [b for ints, _ in parts for b in ints[len(counts) :]]
            busy = sum(float(t[0]) for _, (t,) in parts)
            counts = [sum(ints[i] for ints, _ in parts) for i in range(len(counts))]
        tokens, proposed, accepted, step_tokens = counts
        speculation = None
        if self.config.engine.speculative != "off":
            speculation = (
                accepted / proposed if proposed else 0.0,
                step_tokens / sum(sizes) if sizes else 0.0,
            )
        measured = (
            (self.policy.migrating.median, self.policy.serial.median)
            if isinstance(self.policy, AutoThreshold)
            else (None, None)
        )
        return generation_stats(sizes, busy, tokens, self.migration, self._predicted, speculation, measured)


def predictions(policy: MigrationPolicy) -> tuple[object, object] | None:
    """What migration=auto predicted for the coming batch (fused, serial), made from the previous batches."""
    if isinstance(policy, AutoThreshold):
        return policy.predicted, policy.predicted_serial
    return None


def observation(done: Sequence[SampleRequest], cap: int, engines: Sequence[Any]) -> BatchObservation:
    """A finished batch as a migration policy sees it (lengths, prompt length, KV slots, fitted costs)."""
    return BatchObservation(
        response_lengths=[len(r.tokens) for r in done],
        prompt_len=round(sum(r.prompt_len for r in done) / len(done)),
        cap=cap,
        slots=engines[0].cache.num_slots,
        profile=CostProfile.fit([e.stats for e in engines]),
    )


def generation_stats(
    sizes: Sequence[int],
    busy: float,
    tokens: int,
    report: MigrationReport,
    predicted: tuple[object, object] | None,
    speculation: tuple[float, float] | None = None,
    measured: tuple[float | None, float | None] = (None, None),
) -> GenerationStats:
    """One batch's generation statistics: running batch sizes of every decode step, busy seconds and generated
    tokens summed over the instances, the migration report, the auto-tuner's predictions, with speculative
    decoding on (acceptance rate, tokens per sample per decode step), and migration=auto's measured ratios
    (migrating, Rt = 0) after this batch."""
    fused = serial = None
    if predicted is not None and all(isinstance(p, SimResult) for p in predicted):
        fused, serial = (p.gen_inf_s for p in predicted)  # type: ignore[attr-defined]
    return GenerationStats(
        threshold=float(report.threshold),
        samples_moved=float(report.samples_moved),
        destinations=float(report.destinations),
        batch_size_p50=float(torch.tensor(list(sizes), dtype=torch.float64).quantile(0.5)) if sizes else 0.0,
        tokens_per_s=tokens / busy if busy > 0 else math.nan,
        predicted_gen_inf_s=fused,
        predicted_serial_s=serial,
        spec_accept_rate=None if speculation is None else speculation[0],
        spec_tokens_per_step=None if speculation is None else speculation[1],
        measured_migrating=measured[0],
        measured_serial=measured[1],
    )
