"""Whole-iteration simulator: generation (long tail, migration), inference (fused or not), training
(fused or serial pipelines), and task-switching overheads, on the analytical `CostModel`.

Time origin: the start of generation. All times in seconds. Legend: N = samples in the global batch,
n = generation instances (data-parallel Actor replicas of `gen_tp` devices each).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal, Protocol

import numpy as np
from numpy.typing import NDArray

from rlhfuse.pipeline.colocation import Colocation
from rlhfuse.planner.cost import CostModel, stage_fraction
from rlhfuse.planner.lengths import PROMPT_CAP, PROMPTS, RESPONSES, LengthDistribution
from rlhfuse.planner.memory import bytes_per_param
from rlhfuse.planner.migration_decision import (
    Mechanism,
    MigrationDecision,
    choose_mechanism,
    decide_migration,
)
from rlhfuse.planner.schedule import (
    PipeModel,
    fused_lower_bound,
    greedy_fused_makespan,
    one_f_one_b,
    pipeline_problem,
)
from rlhfuse.planner.specs import ModelSpec

if TYPE_CHECKING:
    from rlhfuse.pipeline import SearchConfig

INFERENCE_BATCH = 16
"""Sequences per inference forward (sets the GEMM size, hence MFU, of Ref/RW/Critic passes)."""


@dataclass(frozen=True)
class Workload:
    """One PPO iteration's data: `global_batch` prompts, one response each, trained in mini-batches."""

    global_batch: int = 512
    mini_batch: int = 64
    max_len: int = 1024
    """Longest response (tokens); longer ones are truncated by the engine."""
    responses: LengthDistribution = RESPONSES
    prompts: LengthDistribution = PROMPTS
    prompt_cap: int = PROMPT_CAP
    seed: int = 0

    def validate(self) -> Workload:
        problems = []
        if self.global_batch < 1 or self.mini_batch < 1 or self.global_batch % self.mini_batch:
            problems.append(
                f"global_batch={self.global_batch} must be a positive multiple of mini_batch={self.mini_batch}"
            )
        if self.max_len < 1:
            problems.append(f"max_len={self.max_len} must be >= 1")
        if problems:
            raise ValueError("invalid Workload: " + "; ".join(problems))
        return self

    @property
    def max_context(self) -> int:
        return self.prompt_cap + self.max_len

    def sample(self) -> Samples:
        rng = np.random.default_rng(self.seed)
        prompt = self.prompts.sample(self.global_batch, self.prompt_cap, rng)
        response = self.responses.sample(self.global_batch, self.max_len, rng)
        return Samples(prompt, response)


@dataclass(frozen=True)
class Samples:
    """Token counts of one batch: `prompt[i]`, `response[i]` for sample i (int arrays of length N)."""

    prompt: NDArray[np.int64]
    response: NDArray[np.int64]

    @property
    def seq(self) -> NDArray[np.int64]:
        out: NDArray[np.int64] = self.prompt + self.response
        return out

    def __len__(self) -> int:
        return len(self.prompt)


@dataclass(frozen=True)
class RLHFModels:
    """The four PPO models: Ref has the Actor's shape, the reward model (RW) the Critic's (as in the paper)."""

    actor: ModelSpec
    critic: ModelSpec

    def inference(self) -> list[tuple[ModelSpec, str]]:
        """Ref (LM head), RW and Critic (value heads): the models of the inference stage."""
        return [(self.actor, "lm"), (self.critic, "value"), (self.critic, "value")]

    @property
    def name(self) -> str:
        return f"{self.actor.name}/{self.critic.name}"


# ---------------------------------------------------------------------------------------------------------
# Generation
# ---------------------------------------------------------------------------------------------------------
StepTime = Callable[[NDArray, NDArray], NDArray]
"""Seconds of each decode step from (samples running, KV entries read) per step: the cost model's
`decode_step_time` here, a measured `a + b x batch` fit in `rlhfuse.generation.tuning`."""


def continuous_batching(
    step_time: StepTime, ctx0: NDArray, remaining: NDArray, t0: float
) -> tuple[NDArray, NDArray]:
    """Continuous-batching decode of one instance from time `t0`.

    Sample i holds `ctx0[i]` KV entries and needs `remaining[i]` more tokens; every step decodes one token of
    every unfinished sample. Returns (finish time per sample, end time of every step).
    """
    if len(remaining) == 0:
        return np.zeros(0), np.zeros(0)
    order = np.argsort(remaining, kind="stable")
    r_sorted = remaining[order]
    c_sorted = ctx0[order].astype(np.float64)
    k = np.arange(int(r_sorted[-1]))
    first_alive = np.searchsorted(r_sorted, k, side="right")
    alive = len(r_sorted) - first_alive
    suffix_ctx = np.concatenate([np.cumsum(c_sorted[::-1])[::-1], [0.0]])
    ctx = suffix_ctx[first_alive] + alive * (k + 1)
    steps = t0 + np.cumsum(step_time(alive, ctx))
    return steps[remaining - 1], steps


def decode_finish_times(
    cost: CostModel, model: ModelSpec, tp: int, ctx0: NDArray, remaining: NDArray, t0: float
) -> tuple[NDArray, NDArray]:
    """`continuous_batching` with the cost model's decode steps of `model` on `tp` devices."""
    return continuous_batching(
        lambda alive, ctx: cost.decode_step_time(model, tp, alive, ctx), ctx0, remaining, t0
    )


@dataclass(frozen=True)
class GenerationResult:
    """Per-sample finish times (s) and what migration did (all None / 0 without migration)."""

    finish: NDArray
    end: float
    instances: int
    t_migrate: float | None = None
    decision: MigrationDecision | None = None
    mechanism: Mechanism | None = None
    migration_seconds: float = 0.0
    freed_at: float | None = None


def free_kv_bytes(cost: CostModel, actor: ModelSpec, tp: int, resident_bytes: float) -> float:
    """KV-cache memory of one generation instance: usable memory - what stays resident from training (weights,
    master copies, optimizer states, resident frozen models: `search.resident_train_bytes`) - the generation
    copy's shard (`CostModel.generation_weight_bytes`), on each of its tp devices."""
    per_device = cost.usable_memory() - resident_bytes - cost.generation_weight_bytes(actor, tp)
    return per_device * tp


@dataclass(frozen=True)
class Unmigrated:
    """Generation without migration, per instance (reused by every Rt of a sweep)."""

    tp: int
    instance: NDArray
    """Instance of each sample (sample i on instance i mod n)."""
    finish: NDArray
    steps: tuple[NDArray, ...]
    """End time of every decode step, per instance."""
    prefill_end: NDArray


def decode_instances(
    step_time: StepTime, samples: Samples, instances: int, prefill_end: NDArray, tp: int = 1
) -> Unmigrated:
    """Sample i on instance i mod `instances`, each instance decoding its samples from `prefill_end[i]`."""
    inst = np.arange(len(samples)) % instances
    finish = np.zeros(len(samples))
    steps_of = []
    for i in range(instances):
        idx = np.flatnonzero(inst == i)
        f, steps = continuous_batching(step_time, samples.prompt[idx], samples.response[idx], prefill_end[i])
        finish[idx] = f
        steps_of.append(steps)
    return Unmigrated(tp, inst, finish, tuple(steps_of), prefill_end)


def generate_unmigrated(cost: CostModel, actor: ModelSpec, samples: Samples, tp: int) -> Unmigrated:
    """`unmigrated_generation` on the cost model's figures (`ModeledCosts`)."""
    return replace(unmigrated_generation(ModeledCosts(cost, actor, tp, max_context=0), samples), tp=tp)


@dataclass(frozen=True)
class Tail:
    """The batch when Rt samples remain: at `t_mig`, which samples are `unfinished`, tokens `generated` so
    far (each unfinished sample still needs response - generated >= 1), and the instances' unfinished
    `counts` (what `decide_migration` reads)."""

    t_mig: float
    unfinished: NDArray
    generated: NDArray
    counts: list[int]

    def moves(
        self, base: Unmigrated, decision: MigrationDecision
    ) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
        """(every sample each destination decodes after the moves, the samples that moved to it)."""
        pending = {
            i: [int(j) for j in np.flatnonzero(self.unfinished & (base.instance == i))]
            for i in range(len(base.steps))
        }
        members = {d: list(pending[d]) for d in decision.destinations}
        incoming: dict[int, list[int]] = {d: [] for d in decision.destinations}
        for src, dst, count in decision.moves:
            moved, pending[src] = pending[src][:count], pending[src][count:]
            incoming[dst] += moved
            members[dst] += moved
        return members, incoming


def tail_at(base: Unmigrated, samples: Samples, rt: int) -> Tail:
    """The `Tail` of `base` (generation without migration) when `rt` samples remain."""
    size = len(samples)
    t_mig = float(np.sort(base.finish)[size - rt - 1])
    unfinished = base.finish > t_mig
    generated = np.zeros(size, dtype=np.int64)
    for i, steps in enumerate(base.steps):
        idx = np.flatnonzero(base.instance == i)
        done_steps = int(np.searchsorted(steps, t_mig, side="right")) if t_mig >= base.prefill_end[i] else 0
        generated[idx] = np.minimum(done_steps, samples.response[idx] - 1)
    counts = np.bincount(base.instance[unfinished], minlength=len(base.steps))
    return Tail(t_mig, unfinished, generated, counts.tolist())


def rt_values(fractions: Sequence[float], batch: int) -> list[tuple[float, int]]:
    """(fraction, Rt) for each distinct Rt the sweep's `fractions` give on a batch (Rt in [1, batch - 1])."""
    out: list[tuple[float, int]] = []
    seen: set[int] = set()
    for frac in fractions:
        rt = min(max(1, round(frac * batch)), batch - 1)  # a small batch: fewer distinct Rt
        if rt < 1 or rt in seen:
            continue
        seen.add(rt)
        out.append((frac, rt))
    return out


def simulate_generation(
    cost: CostModel,
    actor: ModelSpec,
    samples: Samples,
    tp: int,
    *,
    max_context: int,
    resident_bytes: float = 0.0,
    rt: int | None = None,
    unmigrated: Unmigrated | None = None,
    kv_read_slack: float | None = None,
) -> GenerationResult:
    """Generate `samples` on `cluster.gpus // tp` instances (sample i on instance i mod n): `generation` on
    the cost model's figures (`ModeledCosts`).

    With `rt`, migrate when `rt` samples remain (docs/paper.md §2): destinations from `decide_migration`, mechanism
    (KV transfer or re-prefill) by cost, destinations pause for the migration, sources are freed after it.
    `unmigrated` (from `generate_unmigrated` with the same arguments) saves recomputing the first phase.
    `kv_read_slack` adds the KV-read rule of `decide_migration`, with a budget of that fraction of the
    instance's weight bytes (each destination's step may grow by about that fraction).
    """
    costs = ModeledCosts(
        cost, actor, tp, max_context=max_context, resident_bytes=resident_bytes, kv_read_slack=kv_read_slack
    )
    base = unmigrated if unmigrated is not None else unmigrated_generation(costs, samples)
    return generation(costs, samples, rt, base)


# ---------------------------------------------------------------------------------------------------------
# Inference
# ---------------------------------------------------------------------------------------------------------
def inference_tps(models: RLHFModels, group: int) -> tuple[int, ...]:
    """tp of Ref, RW and Critic in a pool of `group`-device groups: for each, the largest tp that divides the
    group and its heads (a group runs group / tp replicas of it)."""
    out = []
    for m, _ in models.inference():
        tp = group
        while tp > 1 and (group % tp or m.heads % tp or m.n_kv_heads % tp):
            tp -= 1
        out.append(tp)
    return tuple(out)


def inference_seconds(
    cost: CostModel, models: list[tuple[ModelSpec, str]], seq: NDArray, tps: tuple[int, ...]
) -> tuple[NDArray, NDArray]:
    """(device-seconds, latency seconds) of each sample's forward passes through `models`, model k on a tp
    group of `tps[k]` devices, batched by INFERENCE_BATCH sequences of similar length, TP all-reduces included."""
    s = np.asarray(seq, dtype=np.float64)
    dev = cost.device
    work = np.zeros_like(s)
    latency = np.zeros_like(s)
    for (model, head), tp in zip(models, tps):
        flops = s * cost.matmul_flops_per_token(model, head) + 2.0 * model.layers * model.hidden * s * s
        mfu = cost.eff.mfu(cost.eff.prefill_mfu, INFERENCE_BATCH * s)
        comm = 2 * model.layers * cost.allreduce_time_array(s * model.hidden * dev.dtype_bytes, tp)
        seconds = flops / (tp * dev.peak_flops * mfu) + comm / INFERENCE_BATCH
        work += seconds * tp
        latency += seconds
    return work, latency


def drain_time(
    arrivals: NDArray, work: NDArray, servers: int, ready: float, latency: NDArray | None = None
) -> float:
    """When a pool of `servers` identical servers, available from `ready`, finishes jobs of `work` server-seconds
    arriving at `arrivals`: fluid bound max_j (a_j + later work / servers), and no job faster than its
    `latency` (default: its work on one server)."""
    if len(work) == 0:
        return ready
    if servers < 1:
        raise ValueError(f"servers={servers} must be >= 1")
    order = np.argsort(arrivals, kind="stable")
    a = np.maximum(arrivals[order], ready)
    w = work[order]
    lat = w if latency is None else latency[order]
    suffix = np.cumsum(w[::-1])[::-1]
    return float(max(np.max(a + suffix / servers), np.max(a + lat)))


@dataclass(frozen=True)
class GenInfResult:
    """Generation + inference of one iteration."""

    generation: GenerationResult
    end: float
    """Time the last inference pass ends (the Gen+Inf stage time)."""
    inference_tp: int
    inference_exposed: float
    """end - generation end: inference not hidden under generation."""
    rt: int | None
    swap_seconds: float = 0.0


def inference_weight_bytes(cost: CostModel, models: RLHFModels, tps: tuple[int, ...]) -> float:
    """Ref + RW + Critic bf16 weights on one device of the inference pool."""
    return sum(cost.weight_bytes(m, h) / tp for (m, h), tp in zip(models.inference(), tps))


def swap_exposed(
    cost: CostModel,
    models: RLHFModels,
    tps: tuple[int, ...],
    prefetch_from: float | None,
    hidden_until: float,
    passes: int = 1,
    critic_train: tuple[int, int] | None = None,
) -> tuple[float, float]:
    """(swap seconds, time the inference weights are ready) for loading Ref/RW/Critic onto the pool.

    Ref and RW come from host memory (PCIe); with `critic_train` = the Critic's training (tp, pp), the Critic
    is resharded from its resident training weights over the network instead (docs/paper.md §4), in parallel with
    the host copies; without it, the Critic is copied from host memory too.

    docs/paper.md §4: the swap-in is overlapped with the previous task. From `prefetch_from` (see `prefetch_start`)
    the weights stream in beside generation, so they are ready at max(`hidden_until`, prefetch_from + swap).
    With None (they never fit beside generation) they are loaded one model at a time after `hidden_until`,
    `passes` times (Base: 1; fused: 2, once for the bulk of the samples, once more for the tail).
    """
    if critic_train is None:
        swap = cost.host_copy_time(inference_weight_bytes(cost, models, tps))
    else:
        (critic, head), critic_tp = models.inference()[2], tps[2]
        host = inference_weight_bytes(cost, models, tps) - cost.weight_bytes(critic, head) / critic_tp
        reshard = cost.reshard_time(critic, head, critic_train[0], critic_train[1], critic_tp)
        swap = max(cost.host_copy_time(host), reshard)
    if prefetch_from is not None:
        return swap, max(hidden_until, prefetch_from + swap)
    return passes * swap, hidden_until + passes * swap


def prefetch_start(
    cost: CostModel,
    models: RLHFModels,
    tps: tuple[int, ...],
    gen_tp: int,
    base: Unmigrated,
    instances: NDArray | list[int] | range,
    *,
    resident_bytes: float,
    max_context: int,
    freed_at: float | None = None,
) -> float | None:
    """Earliest time every instance in `instances` has room for the inference weights beside the KV cache of
    its unfinished samples (each reserved at maximum length), or None if it never has while generating.
    With `freed_at`, an instance stops generating then (migration) and has room from that time at the latest.
    """
    room = free_kv_bytes(cost, models.actor, gen_tp, resident_bytes) / gen_tp - inference_weight_bytes(
        cost, models, tps
    )
    if room < 0:
        return None
    keep = int(room * gen_tp // (cost.kv_bytes_per_token(models.actor) * max_context))
    start = 0.0
    for i in instances:
        f = np.sort(base.finish[base.instance == i])
        t = float(f[len(f) - keep - 1]) if len(f) > keep else 0.0
        start = max(start, t if freed_at is None else min(t, freed_at))
    return start


# ---------------------------------------------------------------------------------------------------------
# Generation + inference: one simulator, fed by the cost model (paper scale) or by measured costs
# ---------------------------------------------------------------------------------------------------------
class RolloutCosts(Protocol):
    """The figures the Gen+Inf simulator (`generation`, `gen_inf`, `gen_inf_sweep`) reads. Two sources:
    `ModeledCosts` (the analytical `CostModel` on a paper-scale cluster, what `rlhfuse-plan` uses) and
    `rlhfuse.planner.measured.MeasuredCosts` (a `CostProfile` measured on the running engine, what
    `migration=auto` uses): the same timeline code for both."""

    @property
    def instances(self) -> int:
        """Generation instances (sample i on instance i mod instances)."""
        ...

    @property
    def lockstep_s(self) -> float:
        """Seconds added to every decode step of every instance while the instances watch for Rt (fused runs
        only, until the migration): the count synchronisation."""
        ...

    def step_time(self, alive: NDArray, ctx: NDArray) -> NDArray:
        """Seconds of each decode step of one instance (`StepTime`)."""
        ...

    def prefill_end(self, samples: Samples, instance: NDArray) -> NDArray:
        """When each instance's first decode step starts (its prompts prefilled)."""
        ...

    def decide(self, samples: Samples, tail: Tail) -> MigrationDecision:
        """The migration decision at the tail (`decide_migration` with this setting's limits)."""
        ...

    def move_seconds(self, ctx: Sequence[NDArray]) -> tuple[float, float, Mechanism | None]:
        """(KV transfer seconds, re-prefill seconds, forced mechanism or None = the cheaper) to move samples
        holding `ctx[d]` KV entries to destination d (the destinations pause for the slowest)."""
        ...

    def inference(self, seq: NDArray, *, fused: bool) -> tuple[NDArray, NDArray]:
        """(server-seconds, latency seconds) of each sample's Ref/RW/Critic passes."""
        ...

    def inference_tp(self, *, fused: bool) -> int:
        """Devices of one inference group (reported in `GenInfResult.inference_tp`)."""
        ...

    def servers(self, freed: Sequence[int] | None) -> int:
        """Inference servers: those of the `freed` instances (fused), or of every device (None)."""
        ...

    def weights_ready(
        self, base: Unmigrated, freed: Sequence[int] | None, freed_at: float | None, hidden_until: float,
        *, fused: bool,
    ) -> tuple[float, float]:  # fmt: skip
        """(swap seconds, when the inference weights are ready) on the `freed` instances (None: all)."""
        ...


def unmigrated_generation(costs: RolloutCosts, samples: Samples, *, lockstep: bool = False) -> Unmigrated:
    """Generation without migration (with `lockstep`: as the instances of a fused run decode it, paying
    `costs.lockstep_s` per step while they watch for Rt)."""
    inst = np.arange(len(samples)) % costs.instances
    extra = costs.lockstep_s if lockstep else 0.0
    step: StepTime = (
        costs.step_time if extra == 0 else (lambda alive, ctx: costs.step_time(alive, ctx) + extra)
    )
    return decode_instances(step, samples, costs.instances, costs.prefill_end(samples, inst))


def generation(costs: RolloutCosts, samples: Samples, rt: int | None, base: Unmigrated) -> GenerationResult:
    """Generation from `base` (without migration), migrating the tail when `rt` samples remain (docs/paper.md §2):
    destinations from `costs.decide`, mechanism (KV transfer or re-prefill) by cost, destinations pause for the
    migration and decode the tail without the lockstep cost, sources are freed after it."""
    n = costs.instances
    size = len(samples)
    finish = base.finish
    if rt is None or rt >= size or size == 0:
        return GenerationResult(finish, float(finish.max(initial=0.0)), n)
    tail = tail_at(base, samples, rt)
    decision = costs.decide(samples, tail)
    members, incoming = tail.moves(base, decision)
    ctx_now = samples.prompt + tail.generated
    kv_seconds, reprefill_seconds, forced = costs.move_seconds([ctx_now[m] for m in incoming.values() if m])
    mechanism = forced or choose_mechanism(kv_seconds, reprefill_seconds)
    pause = kv_seconds if mechanism == "kv" else reprefill_seconds
    finish = finish.copy()
    for mem in members.values():
        idx = np.asarray(mem, dtype=np.int64)
        f, _ = continuous_batching(
            costs.step_time, ctx_now[idx], samples.response[idx] - tail.generated[idx], tail.t_mig + pause
        )
        finish[idx] = f
    freed_at = tail.t_mig + (kv_seconds if mechanism == "kv" else 0.0)
    return GenerationResult(finish, float(finish.max()), n, tail.t_mig, decision, mechanism, pause, freed_at)


def gen_inf(
    costs: RolloutCosts, samples: Samples, rt: int | None = None, *, base: Unmigrated | None = None
) -> GenInfResult:
    """Generation + inference of one batch. `rt=None`: serial (RLHFuse-Base: generate everything, then infer
    on every server); `rt`: fused (migrate the tail at `rt` unfinished samples; the freed instances infer the
    finished samples, the tail streaming in as it finishes). `base`: the matching `unmigrated_generation`."""
    n = len(samples)
    if rt is None:
        base = base if base is not None else unmigrated_generation(costs, samples)
        gen = generation(costs, samples, None, base)
        work, latency = costs.inference(samples.seq, fused=False)
        swap, ready = costs.weights_ready(base, None, None, gen.end, fused=False)
        end = drain_time(np.full(n, gen.end), work, costs.servers(None), ready, latency)
        return GenInfResult(gen, end, costs.inference_tp(fused=False), end - gen.end, None, swap)
    if not 1 <= rt < n:
        raise ValueError(f"rt={rt} must be in [1, {n - 1}] for a batch of {n} samples")
    base = base if base is not None else unmigrated_generation(costs, samples, lockstep=True)
    gen = generation(costs, samples, rt, base)
    assert gen.decision is not None and gen.freed_at is not None
    work, latency = costs.inference(samples.seq, fused=True)
    freed = [i for i in range(gen.instances) if i not in gen.decision.destinations]
    if not freed:  # nothing freed: every server runs inference after generation, like Base
        swap, ready = costs.weights_ready(base, None, None, gen.end, fused=True)
        end = drain_time(np.full(n, gen.end), work, costs.servers(None), ready, latency)
    else:
        swap, ready = costs.weights_ready(base, freed, gen.freed_at, gen.freed_at, fused=True)
        end = drain_time(gen.finish, work, costs.servers(freed), ready, latency)
    return GenInfResult(gen, end, costs.inference_tp(fused=True), max(0.0, end - gen.end), rt, swap)


def gen_inf_sweep(
    costs: RolloutCosts,
    samples: Samples,
    fractions: Sequence[float] = (),
    *,
    base: Unmigrated | None = None,
) -> list[tuple[float, GenInfResult]]:
    """Fused Gen+Inf for each distinct Rt of `fractions` (default `RT_FRACTIONS`); the first phase is shared."""
    if base is None:
        base = unmigrated_generation(costs, samples, lockstep=True)
    return [
        (frac, gen_inf(costs, samples, rt, base=base))
        for frac, rt in rt_values(fractions or RT_FRACTIONS, len(samples))
    ]


@dataclass(frozen=True)
class Speculation:
    """Lossless speculative decoding of the tail (docs/paper.md §6) in the simulator: `tokens` (k) draft tokens per
    sample verified in one forward pass of k + 1 positions, each draft token accepted with probability
    `acceptance` (independently, until the first rejection)."""

    acceptance: float
    tokens: int = 4

    def validate(self) -> Speculation:
        if not 0.0 <= self.acceptance <= 1.0 or self.tokens < 1:
            raise ValueError(
                f"speculation acceptance={self.acceptance} must be in [0, 1] and tokens={self.tokens} >= 1"
            )
        return self

    @property
    def tokens_per_step(self) -> float:
        """Expected tokens a sample gains per verify step: sum_{i=0..k} a^i (the first rejected position still
        yields its sampled token)."""
        a, k = self.acceptance, self.tokens
        return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)

    def step_time(self, plain: StepTime, alive: NDArray, ctx: NDArray) -> NDArray:
        """Seconds per token-step of every sample: a plain decode step, or a verify step (the decode step of
        `alive` x (k + 1) positions over the same KV entries) over the tokens it yields, whichever is cheaper at
        that batch (`generator.speculative=auto`'s rule: in practice, the small batches of the tail)."""
        a = np.asarray(alive, dtype=np.float64)
        verify = plain(a * (self.tokens + 1), ctx) / self.tokens_per_step
        out: NDArray = np.minimum(plain(a, ctx), verify)
        return out


@dataclass(frozen=True)
class ModeledCosts:
    """`RolloutCosts` from the analytical `CostModel`: `cluster.gpus // gen_tp` instances of `actor` on
    `gen_tp` devices each, `resident_bytes` of training state per device; inference (with `models`) on tp
    groups inside the instances (fused) or on groups of `group` devices over the cluster (serial)."""

    cost: CostModel
    actor: ModelSpec
    gen_tp: int
    max_context: int
    resident_bytes: float = 0.0
    models: RLHFModels | None = None
    group: int | None = None
    kv_read_slack: float | None = None
    critic_train: tuple[int, int] | None = None
    speculation: Speculation | None = None
    """Speculative decoding where it pays (the tail); None = plain decoding."""

    @property
    def instances(self) -> int:
        return self.cost.cluster.gpus // self.gen_tp

    @property
    def lockstep_s(self) -> float:
        return 0.0  # the paper's engine watches the counts asynchronously

    def step_time(self, alive: NDArray, ctx: NDArray) -> NDArray:
        if self.speculation is not None:
            return self.speculation.step_time(self._decode, alive, ctx)
        return self._decode(alive, ctx)

    def _decode(self, alive: NDArray, ctx: NDArray) -> NDArray:
        return self.cost.decode_step_time(self.actor, self.gen_tp, alive, ctx)

    def prefill_end(self, samples: Samples, instance: NDArray) -> NDArray:
        return np.array(
            [self.cost.prefill_time(self.actor, samples.prompt[instance == i], self.gen_tp)
             for i in range(self.instances)]
        )  # fmt: skip

    def decide(self, samples: Samples, tail: Tail) -> MigrationDecision:
        cost, actor, tp = self.cost, self.actor, self.gen_tp
        kv_tok = cost.kv_bytes_per_token(actor)
        tail_kv = float((samples.prompt + tail.generated)[tail.unfinished].sum()) * kv_tok
        slack = self.kv_read_slack
        return decide_migration(
            tail.counts,
            cost.bs_max(actor, tp),
            kv_tok * self.max_context,
            free_kv_bytes(cost, actor, tp, self.resident_bytes),
            kv_read_bytes=tail_kv,
            kv_read_budget=None if slack is None else slack * cost.weight_bytes(actor),
        )

    def move_seconds(self, ctx: Sequence[NDArray]) -> tuple[float, float, Mechanism | None]:
        kv_tok = self.cost.kv_bytes_per_token(self.actor)
        kv = max(
            (self.cost.p2p_time(float(c.sum()) * kv_tok / self.gen_tp, inter_node=True) for c in ctx),
            default=0.0,
        )
        reprefill = max((self.cost.prefill_time(self.actor, c, self.gen_tp) for c in ctx), default=0.0)
        return kv, reprefill, None

    def _models(self) -> RLHFModels:
        if self.models is None:
            raise ValueError("ModeledCosts without models simulates generation only")
        return self.models

    def _tps(self, fused: bool) -> tuple[int, ...]:
        return inference_tps(self._models(), self.inference_tp(fused=fused))

    def inference(self, seq: NDArray, *, fused: bool) -> tuple[NDArray, NDArray]:
        return inference_seconds(self.cost, self._models().inference(), seq, self._tps(fused))

    def inference_tp(self, *, fused: bool) -> int:
        return self.gen_tp if fused or self.group is None else self.group

    def servers(self, freed: Sequence[int] | None) -> int:
        return self.cost.cluster.gpus if freed is None else len(freed) * self.gen_tp

    def weights_ready(
        self, base: Unmigrated, freed: Sequence[int] | None, freed_at: float | None, hidden_until: float,
        *, fused: bool,
    ) -> tuple[float, float]:  # fmt: skip
        models, tps = self._models(), self._tps(fused)
        start = prefetch_start(
            self.cost, models, tps, self.gen_tp, base, range(self.instances) if freed is None else list(freed),
            resident_bytes=self.resident_bytes, max_context=self.max_context, freed_at=freed_at,
        )  # fmt: skip
        return swap_exposed(
            self.cost, models, tps, start, hidden_until, passes=1 if freed is None else 2,
            critic_train=self.critic_train,
        )  # fmt: skip


def gen_inf_serial(
    cost: CostModel,
    models: RLHFModels,
    samples: Samples,
    gen_tp: int,
    group: int,
    *,
    max_context: int,
    resident_bytes: float,
    unmigrated: Unmigrated | None = None,
    critic_train: tuple[int, int] | None = None,
) -> GenInfResult:
    """RLHFuse-Base: generate everything, then run Ref/RW/Critic over the batch on all devices (groups of
    `group` devices, `inference_tps`), their weights prefetched during generation once memory allows."""
    costs = ModeledCosts(
        cost, models.actor, gen_tp, max_context, resident_bytes, models, group, critic_train=critic_train
    )
    return gen_inf(costs, samples, None, base=unmigrated)


def gen_inf_fused(
    cost: CostModel,
    models: RLHFModels,
    samples: Samples,
    gen_tp: int,
    rt: int,
    *,
    max_context: int,
    resident_bytes: float,
    unmigrated: Unmigrated | None = None,
    kv_read_slack: float | None = None,
    critic_train: tuple[int, int] | None = None,
) -> GenInfResult:
    """RLHFuse: migrate the tail at `rt` unfinished samples; freed instances run Ref/RW/Critic (tp groups
    inside the instance) on the finished samples, the tail streaming in as it finishes."""
    costs = ModeledCosts(
        cost, models.actor, gen_tp, max_context, resident_bytes, models, kv_read_slack=kv_read_slack,
        critic_train=critic_train,
    )  # fmt: skip
    return gen_inf(costs, samples, rt, base=unmigrated)


RT_FRACTIONS = tuple(round(0.05 * k, 2) for k in range(1, 20))
"""The sweep's migration thresholds, as fractions of the batch: 5%, 10%, ..., 95%."""
KV_READ_SLACK = 0.25
"""The planner's KV-aware migration policy: a destination may read KV worth 25% of its weight bytes per step."""


def rt_sweep(
    cost: CostModel,
    models: RLHFModels,
    samples: Samples,
    gen_tp: int,
    *,
    max_context: int,
    resident_bytes: float,
    fractions: tuple[float, ...] = RT_FRACTIONS,
    unmigrated: Unmigrated | None = None,
    kv_read_slack: float | None = None,
    critic_train: tuple[int, int] | None = None,
) -> list[tuple[float, GenInfResult]]:
    """Fused Gen+Inf time for each Rt fraction (the paper's Figure 9 sweep): `gen_inf_sweep` on the cost
    model's figures."""
    costs = ModeledCosts(
        cost, models.actor, gen_tp, max_context, resident_bytes, models, kv_read_slack=kv_read_slack,
        critic_train=critic_train,
    )  # fmt: skip
    return gen_inf_sweep(costs, samples, fractions, base=unmigrated)


# ---------------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TrainLayout:
    """Megatron layout of one model: tp x pp x dp devices, micro-batches of `micro_batch` samples."""

    tp: int
    pp: int
    dp: int
    micro_batch: int

    def microbatches(self, mini_batch: int) -> int:
        return mini_batch // (self.dp * self.micro_batch)


@dataclass(frozen=True)
class TrainResult:
    """Training-stage estimate per mini-batch and per iteration.

    `per_minibatch` is the schedule we can produce (serial 1F1B, or the greedy fused schedule); `bound` is the
    fused lower bound (what the paper's annealing reaches on most settings; equal to per_minibatch for serial).
    """

    mode: Literal["serial", "fused", "fsdp"]
    actor: TrainLayout
    critic: TrainLayout
    per_minibatch: float
    bound: float
    memory: float
    """Peak bytes per device: both models' training states + activations."""
    minibatches: int
    ranks: int = 0
    """Fused: ranks of one fused pipeline (tp groups); 0 for serial."""
    merged: bool = False
    """Modelled as `rlhfuse.runtime` runs unequal tp (`runtime=True`): the smaller-tp model's consecutive stages
    merged onto one larger-tp group, run one after the other (`fused_problem`)."""
    reshard_after_forward: bool = True
    """pipeline=fsdp (`mode` "fsdp"): each layer freed after its forward and gathered again for its backward
    (false: kept from its forward to its backward, one all-gather less per layer and micro-batch)."""
    detail: dict[str, float] = field(default_factory=dict, compare=False)

    @property
    def total(self) -> float:
        return self.per_minibatch * self.minibatches

    @property
    def total_bound(self) -> float:
        return self.bound * self.minibatches


def _stage(cost: CostModel, model: ModelSpec, head: str, lay: TrainLayout, seq: float) -> tuple[float, float]:
    return cost.stage_times(model, head, lay.tp, lay.pp, lay.dp, lay.micro_batch, seq)


def colocation(actor: TrainLayout, critic: TrainLayout, merged: bool) -> Colocation:
    """The co-location a pair is costed on: `merged`, the runtime's (`rlhfuse.pipeline.colocation`: the
    smaller-tp model's consecutive stages merged; refused pairs raise); otherwise the paper grid's, each model's
    pp stages on ranks of max(tp) devices (a smaller tp: lockstep sub-replicas side by side, nothing merged)."""
    if merged:
        return Colocation(actor.pp, actor.tp, critic.pp, critic.tp).check()
    return Colocation(actor.pp, 1, critic.pp, 1)


def merges(actor: TrainLayout, critic: TrainLayout, merged: bool) -> tuple[int, int]:
    """Consecutive stages of the Actor and of the Critic that run as one merged stage (`colocation`; 1 and 1
    unless `merged`)."""
    lay = colocation(actor, critic, merged)
    return lay.merge("actor"), lay.merge("critic")


def activation_peak(
    cost: CostModel, model: ModelSpec, lay: TrainLayout, mini_batch: int, seq: float, merge: int = 1
) -> float:
    """1F1B's peak on stage 0: min(stages, M) micro-batches in flight over the stage's layers (`merge` > 1:
    pp / merge merged stages, each device holding one sub-stage's layers)."""
    inflight = min(lay.pp // merge, lay.microbatches(mini_batch))
    layers = model.layers * stage_fraction(model, lay.pp)
    return inflight * cost.activation_bytes(model, lay.micro_batch * seq, lay.tp, layers)


def model_step_time(
    cost: CostModel,
    model: ModelSpec,
    head: str,
    lay: TrainLayout,
    mini_batch: int,
    seq: float,
    merge: int = 1,
) -> float:
    """One model's mini-batch with 1F1B on its own layout, + the exposed part of the DP gradient all-reduce +
    optimizer step (`merge` > 1: pp / merge merged stages, each running its `merge` sub-stages one after the
    other)."""
    f, b = _stage(cost, model, head, lay, seq)
    return (
        one_f_one_b(lay.pp // merge, lay.microbatches(mini_batch), merge * f, merge * b)
        + exposed_reduction(cost, model, head, lay, seq)
        + cost.optimizer_step_time(model, head, lay.tp, lay.pp)
    )


def exposed_reduction(cost: CostModel, model: ModelSpec, head: str, lay: TrainLayout, seq: float) -> float:
    """The DP gradient all-reduce left after the first stage's last backward (it ends the step; its buckets
    were launched during that backward, one micro-batch's backward of one stage: `exposed_grad_allreduce_time`)."""
    _, b = _stage(cost, model, head, lay, seq)
    return cost.exposed_grad_allreduce_time(
        model, head, lay.tp, lay.pp, lay.dp, overlap_s=b * cost.eff.grad_overlap
    )


def train_state_bytes(
    cost: CostModel, models: RLHFModels, actor: TrainLayout, critic: TrainLayout, *, merged: bool = False
) -> float:
    """What the busiest device holds while training, activations and the generation copy aside: both trained
    models' weights, gradients, master copies and optimizer states and the resident frozen models
    (`CostModel.rank_memory`; `merged`: the runtime's placement of unequal tp)."""
    rm = cost.rank_memory(
        models.actor, models.critic, (actor.tp, actor.pp), (critic.tp, critic.pp), merged=merged
    )
    return rm.resident + rm.gradients


def serial_training(
    cost: CostModel,
    models: RLHFModels,
    actor: TrainLayout,
    critic: TrainLayout,
    workload: Workload,
    seq: float,
    *,
    merged: bool = False,
) -> TrainResult:
    """Each model's 1F1B on its own pipeline, one after the other (`merged`: as `rlhfuse.runtime` runs unequal tp,
    the smaller-tp model's stages merged, `fused_problem`)."""
    mb = workload.mini_batch
    ma, mc = merges(actor, critic, merged)
    ta = model_step_time(cost, models.actor, "lm", actor, mb, seq, ma)
    tc = model_step_time(cost, models.critic, "value", critic, mb, seq, mc)
    memory = train_state_bytes(cost, models, actor, critic, merged=merged) + max(
        activation_peak(cost, models.actor, actor, mb, seq, ma),
        activation_peak(cost, models.critic, critic, mb, seq, mc),
    )
    n_mb = workload.global_batch // mb
    return TrainResult(
        "serial", actor, critic, ta + tc, ta + tc, memory, n_mb, merged=merged,
        detail={"actor": ta, "critic": tc},
    )  # fmt: skip


def fused_problem(
    cost: CostModel,
    models: RLHFModels,
    actor: TrainLayout,
    critic: TrainLayout,
    workload: Workload,
    seq: float,
    *,
    merged: bool = False,
) -> tuple[int, list[PipeModel]]:
    """The fused pipeline problem of a co-located layout (docs/paper.md §3): the model with more stages runs in order
    on ranks 0..N-1, the other's N / stages replicas run reversed over blocks of ranks. A rank is a group of
    max(tp) devices.

    A model with the smaller tp t < T = max(tp): by default (the paper's grid) it runs T / t lockstep
    sub-replicas side by side in a rank, one op each. `merged=True` is what `rlhfuse.runtime` runs
    (`rlhfuse.pipeline.colocation`): its m = T / t consecutive stages form one merged stage on a rank, which runs
    the m sub-stages one after the other (m x a sub-stage's time), and the problem is over merged stages
    (pp / m per model; equal tp: the same problem)."""
    placed = colocation(actor, critic, merged)
    mb = workload.mini_batch
    out = []
    for (model, head), lay, name in (
        ((models.actor, "lm"), actor, "actor"),
        ((models.critic, "value"), critic, "critic"),
    ):
        f, b = _stage(cost, model, head, lay, seq)
        m = placed.merge(name)
        placement = tuple(tuple(row) for row in placed.placement(name))
        out.append(
            PipeModel(
                placed.positions(name), placed.replicas(name), lay.microbatches(mb), m * f, m * b, placement
            )
        )
    return placed.ranks, out


def iteration_reduction(cost: CostModel, models: RLHFModels, train: TrainResult, seq: float) -> float:
    """The exposed DP gradient all-reduce of one iteration (both models, every mini-batch), included in
    `train.total`."""
    return train.minibatches * (
        exposed_reduction(cost, models.actor, "lm", train.actor, seq)
        + exposed_reduction(cost, models.critic, "value", train.critic, seq)
    )


def fused_extra(
    cost: CostModel, models: RLHFModels, actor: TrainLayout, critic: TrainLayout, seq: float
) -> float:
    """Per mini-batch work outside the fused pipelines: the exposed parts of both gradient all-reduces and the
    optimizer steps."""
    return (
        exposed_reduction(cost, models.actor, "lm", actor, seq)
        + exposed_reduction(cost, models.critic, "value", critic, seq)
        + cost.optimizer_step_time(models.actor, "lm", actor.tp, actor.pp)
        + cost.optimizer_step_time(models.critic, "value", critic.tp, critic.pp)
    )


def fused_bound(
    cost: CostModel,
    models: RLHFModels,
    actor: TrainLayout,
    critic: TrainLayout,
    workload: Workload,
    seq: float,
    *,
    merged: bool = False,
) -> float:
    """Lower bound of a fused mini-batch (pipeline lower bound + all-reduces + optimizer steps)."""
    ranks, problem = fused_problem(cost, models, actor, critic, workload, seq, merged=merged)
    return fused_lower_bound(ranks, problem) + fused_extra(cost, models, actor, critic, seq)


def fused_training(
    cost: CostModel,
    models: RLHFModels,
    actor: TrainLayout,
    critic: TrainLayout,
    workload: Workload,
    seq: float,
    *,
    merged: bool = False,
) -> TrainResult:
    """A co-located layout trained with the greedy fused schedule (`per_minibatch`) and its bound (`merged`: see
    `fused_problem`)."""
    ranks, problem = fused_problem(cost, models, actor, critic, workload, seq, merged=merged)
    extra = fused_extra(cost, models, actor, critic, seq)
    bound = fused_lower_bound(ranks, problem) + extra
    est = greedy_fused_makespan(ranks, problem) + extra
    mb = workload.mini_batch
    ma, mc = merges(actor, critic, merged)
    memory = (
        train_state_bytes(cost, models, actor, critic, merged=merged)
        + activation_peak(cost, models.actor, actor, mb, seq, ma)
        + activation_peak(cost, models.critic, critic, mb, seq, mc)
    )
    n_mb = workload.global_batch // mb
    return TrainResult("fused", actor, critic, est, bound, memory, n_mb, ranks, merged)


def searched_training(
    cost: CostModel,
    models: RLHFModels,
    train: TrainResult,
    workload: Workload,
    seq: float,
    search: SearchConfig,
) -> TrainResult:
    """A fused `train` re-scheduled by `rlhfuse.pipeline.solve` (the search the runtime runs) under `search`
    (`GRID_SEARCH`: a deterministic budget); the makespan used is the better of the searched and the greedy one.
    Serial results are returned unchanged."""
    from rlhfuse.pipeline import solve  # the search's kernels load numba: only when a plan is searched

    if train.mode != "fused":
        return train
    ranks, problem = fused_problem(
        cost, models, train.actor, train.critic, workload, seq, merged=train.merged
    )
    mb = workload.mini_batch
    placed = colocation(train.actor, train.critic, train.merged)
    acts = [
        activation_peak(cost, model, lay, mb, seq, placed.merge(name))
        / max(1, min(placed.positions(name), lay.microbatches(mb)))
        for model, lay, name in (
            (models.actor, train.actor, "actor"),
            (models.critic, train.critic, "critic"),
        )
    ]
    searchable = pipeline_problem(
        ranks,
        problem,
        names=("actor", "critic"),
        activations=[a / 1e9 for a in acts],
        name=f"{models.name} fused",
    )
    solution = solve(searchable, search)
    extra = fused_extra(cost, models, train.actor, train.critic, seq)
    # the search may reach the bound; summed in another order, its makespan can land a few ulps below it
    best = max(min(solution.makespan + extra, train.per_minibatch), train.bound)
    detail = dict(train.detail, searched_makespan=solution.makespan, search_seconds=solution.seconds,
                  search_wall_capped=solution.stats.get("wall_capped", 0))  # fmt: skip
    return replace(train, per_minibatch=best, detail=detail)


# ---------------------------------------------------------------------------------------------------------
# pipeline=fsdp: sharded data parallelism (FSDP2) over every device
# ---------------------------------------------------------------------------------------------------------
def fsdp_model_step_time(
    cost: CostModel,
    model: ModelSpec,
    head: str,
    lay: TrainLayout,
    mini_batch: int,
    seq: float,
    *,
    reshard_after_forward: bool = True,
) -> float:
    """One model's mini-batch under pipeline=fsdp on `lay.dp` devices (tp = pp = 1): each rank runs its
    `lay.microbatches(mini_batch)` micro-batches of `lay.micro_batch` samples whole, every forward all-gathering
    each layer (prefetched: hidden under the compute when it is shorter) and every backward again unless
    `reshard_after_forward` is off; the last backward also reduce-scatters the gradients (the earlier ones
    accumulate unreduced); then the optimizer steps 1 / dp of the states."""
    world = lay.dp
    f, b = _stage(cost, model, head, lay, seq)
    gather = cost.fsdp_gather_time(model, head, world, cost.fsdp_compute_bytes())
    reduce = cost.fsdp_gather_time(model, head, world, cost.fsdp_reduce_bytes())
    again = gather if reshard_after_forward else 0.0
    m = lay.microbatches(mini_batch)
    passes = m * max(f, gather) + (m - 1) * max(b, again) + max(b, again + reduce)
    return passes + cost.optimizer_step_time(model, head, 1, 1) / world


def fsdp_activations(cost: CostModel, models: RLHFModels, lay: TrainLayout, seq: float) -> float:
    """Activations one rank keeps under pipeline=fsdp: one micro-batch of each trained model (the Actor's and the
    Critic's forwards run before either backward), every layer on the rank."""
    tokens = lay.micro_batch * seq
    return sum(cost.activation_bytes(m, tokens, 1, m.layers) for m in (models.actor, models.critic))


def fsdp_training(
    cost: CostModel,
    models: RLHFModels,
    lay: TrainLayout,
    workload: Workload,
    seq: float,
    *,
    reshard_after_forward: bool = True,
) -> TrainResult:
    """Both models trained under pipeline=fsdp with layout `lay` (dp = every device): their mini-batch one after
    the other in each micro-batch (`fsdp_model_step_time` each), the busiest rank's training memory
    (`CostModel.fsdp_rank_memory`: shards, gradients, optimizer states, frozen shards, the gathered layers and
    unsharded gradients, activations; the generation copy aside, as for the pipelines)."""
    mb = workload.mini_batch
    times = {
        name: fsdp_model_step_time(cost, m, head, lay, mb, seq, reshard_after_forward=reshard_after_forward)
        for name, m, head in (("actor", models.actor, "lm"), ("critic", models.critic, "value"))
    }
    rm = cost.fsdp_rank_memory(
        models.actor, models.critic, lay.dp, reshard_after_forward=reshard_after_forward,
        microbatches=lay.microbatches(mb), activations=fsdp_activations(cost, models, lay, seq),
    )  # fmt: skip
    per = sum(times.values())
    memory = rm.resident - rm.generation_weights + rm.training
    return TrainResult(
        "fsdp", lay, lay, per, per, memory, workload.global_batch // mb,
        reshard_after_forward=reshard_after_forward, detail=times,
    )  # fmt: skip


def fsdp_inference_time(cost: CostModel, models: RLHFModels, samples: Samples, world: int) -> float:
    """pipeline=fsdp's inference after generation (`rlhfuse.trainer.strategies.fsdp.inference.ShardedInference`): every rank infers
    1 / world of the batch's work (shares balanced by sequence cost) with the sharded Ref, Reward and Critic, in
    passes of INFERENCE_BATCH rows; each pass all-gathers each model once, layer by layer, hidden under the pass's
    compute when shorter (every rank runs as many passes)."""
    per_rank = -(-len(samples) // world)
    passes = max(1, -(-per_rank // INFERENCE_BATCH))
    total = 0.0
    for model, head in models.inference():
        work, _ = inference_seconds(cost, [(model, head)], samples.seq, (1,))
        gather = cost.fsdp_gather_time(model, head, world, cost.fsdp_compute_bytes())
        total += max(float(work.sum()) / world, passes * gather)
    return total


def fsdp_rollout(
    cost: CostModel, models: RLHFModels, samples: Samples, unmigrated: Unmigrated | None = None
) -> GenInfResult:
    """pipeline=fsdp's rollout: one generation instance of the whole Actor copy per device (sample i on device
    i mod n, no migration: nothing would use a freed instance), then `fsdp_inference_time` on every device."""
    world = cost.cluster.gpus
    base = unmigrated if unmigrated is not None else generate_unmigrated(cost, models.actor, samples, 1)
    gen = GenerationResult(base.finish, float(base.finish.max(initial=0.0)), world)
    inference = fsdp_inference_time(cost, models, samples, world)
    return GenInfResult(gen, gen.end + inference, 1, inference, None)


def fsdp_weight_sync_time(cost: CostModel, actor: ModelSpec) -> float:
    """pipeline=fsdp's weight sync: the Actor's shards all-gathered on every device (each holds a whole generation
    copy), in the trained weights' dtype."""
    world = cost.cluster.gpus
    weight = bytes_per_param(cost.precision).weight
    return cost.fsdp_gather_time(actor, "lm", world, weight)
