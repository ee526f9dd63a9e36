"""Executor: runs one rank's instruction stream (from `rlhfuse.runtime.lower`) over torch.distributed;
`PlanExecutor` runs and measures the training steps of a `StepSchedule` (`rlhfuse.runtime.plan`).

Receives are posted early with `irecv` and waited just before their consumer; sends are `isend`s kept alive
until the optimizer step (both through `rlhfuse.runtime.streams.StreamComm`, shared with pipeline inference, one
process group per model and direction); gradient reductions are asynchronous `all_reduce`s launched after a
stage's last backward. Compute is timed with CUDA events on a GPU (`rlhfuse.core.timing.OpTimer`), so the profile
the schedule search plans from is the device's, not the host's launch times. The PPO policy loss and the value loss run on the last stage of each model, which reads the
experience tensors of its micro-batch from the mini-batch every rank holds.

Legend: B batch rows, T tokens, D model width, R response tokens, V vocabulary.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor

from rlhfuse import distributed
from rlhfuse.core.advantages import AlgorithmConfig
from rlhfuse.core.errors import NonFiniteError
from rlhfuse.core.stats import LossStats, LossTensors
from rlhfuse.core.step_losses import actor_loss, critic_loss
from rlhfuse.core.timing import OpTimer
from rlhfuse.core.types import TrainBatch
from rlhfuse.distributed.grad_buckets import DEFAULT_BUCKET_MB, GradReducer
from rlhfuse.models import Stage
from rlhfuse.models.masks import MaskLayout, mask_layout
from rlhfuse.pipeline.colocation import placed_on
from rlhfuse.pipeline.ir import Action, Kind
from rlhfuse.pipeline.problem import Problem
from rlhfuse.runtime.layout import ParallelLayout, ProcessGroups, RankGeometry
from rlhfuse.runtime.lower import WEIGHT_GRAD_KINDS, Instr, Message, Program, grad_peers
from rlhfuse.runtime.plan import StageProfile, StepSchedule
from rlhfuse.runtime.split_backward import PendingWeights, backward_input, backward_weight
from rlhfuse.runtime.streams import PipelineError as PipelineError  # re-exported: raised by the executor
from rlhfuse.runtime.streams import StreamComm, wait_for

StageKey = tuple[str, int, int]  # (model, replica, stage)
LossFn = Callable[[Tensor, TrainBatch], tuple[Tensor, LossTensors]]


def ppo_losses(
    algorithm: AlgorithmConfig, temperature: float = 1.0, vocab: Any = None, tp_group: Any = None
) -> dict[str, LossFn]:
    """Last-stage losses: the Actor's PPO clipped loss (+ entropy bonus), the Critic's clipped value loss, on
    the response positions of a micro-batch (`rlhfuse.core.step_losses`, the same functions as `PlainStrategy`).

    vocab (a `VocabShard`) with tp_group: the Actor's last stage is tensor-parallel and returns its slice of the
    logits; the chosen-token log-probs and the entropy are then vocabulary-parallel (never gathering the
    logits)."""
    read_out: dict[str, Any] = {}
    if vocab is not None:
        from rlhfuse.runtime.tensor_parallel import vocab_parallel_entropy, vocab_parallel_logprobs

        read_out = {
            "logprobs_fn": lambda logits, ids, t: vocab_parallel_logprobs(logits, ids, vocab, tp_group, t),
            "entropy_fn": lambda logits: vocab_parallel_entropy(logits, vocab, tp_group),
        }

    def actor(logits_BTV: Tensor, micro: TrainBatch) -> tuple[Tensor, LossTensors]:
        return actor_loss(logits_BTV, micro, algorithm, temperature, **read_out)

    def critic(values_BT: Tensor, micro: TrainBatch) -> tuple[Tensor, LossTensors]:
        return critic_loss(values_BT, micro, algorithm)

    return {"actor": actor, "critic": critic}


@dataclass
class StepWork:
    """The data of one training step as every rank sees it.

    micro[g][i]: micro-batch i of data-parallel group g (the larger model runs all of a group's micro-batches,
    replica r of the smaller model runs those with i // (M / K) == r); weight[g][i]: its share of the mini-batch
    loss (token share for token-mean losses, sample share otherwise), so summed gradients equal the mini-batch's.
    """

    micro: Sequence[Sequence[TrainBatch]]
    weight: Sequence[Sequence[float]]
    layout: Sequence[Sequence[MaskLayout]] | None = None
    """layout[g][i]: micro-batch i's mask layout, worked out on the host (`with_layouts`): the stages' forwards
    then read no mask value (None: each forward reads its mask, host syncs)."""

    def with_layouts(self, *, packed: bool) -> StepWork:
        """This work with every micro-batch's mask layout, computed from its host mask (no sync when the
        micro-batches carry theirs, `TrainBatch.host_mask_BT`, or are on the host)."""
        layouts = [[mask_layout(m.host_mask(), packed=packed) for m in g] for g in self.micro]
        return StepWork(self.micro, self.weight, layouts)

    def to(self, device: torch.device) -> StepWork:
        layouts = None if self.layout is None else [[lay.to(device) for lay in g] for g in self.layout]
        return StepWork([[m.to(device) for m in g] for g in self.micro], self.weight, layouts)


@dataclass
class StepResult:
    """What one rank measured: summed statistics (all ranks agree), gradient norms, compute times per
    (model, stage, kind) and per (action, data-parallel group)."""

    stats: LossStats
    grad_norm: dict[str, float]
    seconds: float
    compute_seconds: float
    op_seconds: dict[tuple[str, int, str], list[float]] = field(default_factory=dict)
    action_seconds: dict[tuple[Action, int], float] = field(default_factory=dict)
    # with track_memory: bytes autograd saved for backward per forward (parameters excluded), and the peak of
    # the bytes held at once on this rank (added when an F saves them, freed when its B ends)
    action_bytes: dict[tuple[Action, int], int] = field(default_factory=dict)
    peak_activation_bytes: int = 0


class PipelineExecutor:
    """Runs `program.streams[rank]` with this rank's stages.

    stages: (model, replica, stage) -> module for every stage placed on this rank (`split_stages` outputs);
    p2p_groups: (model, direction, low rank, high rank) -> process group for point-to-point messages
    (`ProcessGroups.p2p`);
    grad_groups: (model, stage) -> group over the ranks holding that stage (None when one rank holds it);
    timeout_s: how long a wait may block.

    Gradient reduction (REDUCE_GRAD, placed right after a stage's last B): the stage's `GradReducer` is armed
    before that last B, so each bucket of `grad_bucket_mb` MiB is all-reduced asynchronously as soon as its
    gradients are final, overlapping the rest of that backward and whatever the stream runs next; REDUCE_GRAD
    launches the buckets still left, and OPTIMIZER_STEP waits for them. `reducers` holds the reducers (and
    their bucket buffers) across steps.

    tp: the width of a pipeline rank's group of consecutive ranks (the larger tp degree); model_tp: each model's
    own tp degree (default: tp) and model_tp_groups its tp group on this rank (default: tp_group). A model with
    model_tp < tp has merge = tp / model_tp consecutive stages merged onto each pipeline rank (the problem's
    stages are merged stages, `ParallelLayout.merged_stages`): this rank runs sub-stage `position` of each, the
    sub-stages of one F run in order (the activation passed point to point to the next sub-stage's ranks, same
    tp position), those of one B in reverse; the messages between merged stages leave from the last sub-stage
    and arrive at the first (gradients: the reverse). `stages` are then keyed by the sub-stage (module) index.
    The arithmetic is `RankGeometry`'s and the messages `StreamComm`'s, shared with pipeline inference.

    Host syncs: none while the stream runs (loss statistics and gradient norms stay on the device); one read of
    both at the end of the step.
    """

    def __init__(
        self,
        rank: int,
        program: Program,
        problem: Problem,
        stages: Mapping[StageKey, torch.nn.Module],
        *,
        losses: Mapping[str, LossFn],
        p2p_groups: Mapping[Any, Any] | None = None,
        grad_groups: Mapping[tuple[str, int], Any] | None = None,
        timeout_s: float = 300.0,
        track_memory: bool = False,
        autocast: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
        tp: int = 1,
        tp_group: Any = None,
        model_tp: Mapping[str, int] | None = None,
        model_tp_groups: Mapping[str, Any] | None = None,
        grad_bucket_mb: float = DEFAULT_BUCKET_MB,
        reducers: dict[tuple[str, int], GradReducer] | None = None,
    ) -> None:
        self.rank, self.program, self.problem = rank, program, problem
        # tensor parallelism: the streams are per pipeline rank (tp group of consecutive ranks); every rank of a
        # tp group runs its group's stream on its own shards, and exchanges activations with its peer (same tp
        # position) in the neighbouring stage's tp group
        self.tp, self.tp_group = tp, tp_group
        self.stages = dict(stages)
        self.losses = losses
        self.p2p = dict(p2p_groups or {})
        self.grad_groups = dict(grad_groups or {})
        # (model, sub-stage) -> its bucketed gradient reducer; the caller's dict keeps the bucket buffers from
        # step to step
        self.grad_bucket_mb = grad_bucket_mb
        self.reducers = reducers if reducers is not None else {}
        self.timeout_s = timeout_s
        self.autocast = autocast
        self.track_memory = track_memory
        # per model: its tp degree and group, stages merged per pipeline rank, and this rank's sub-stage slot
        self.model_tp = {m.name: (model_tp or {}).get(m.name, tp) for m in problem.models}
        self.model_tp_groups = {m.name: (model_tp_groups or {}).get(m.name, tp_group) for m in problem.models}
        self.geometry = RankGeometry(rank, tp, self.model_tp)
        self.stream = program.streams[self.geometry.pipeline_rank]
        self.group = self.geometry.pipeline_rank // program.group_size
        local = self.geometry.pipeline_rank % problem.ranks
        expected = {
            (m.name, r, self.geometry.sub_stage(m.name, s))
            for m in problem.models
            for r, s in placed_on(m.placement, local)
        }
        if set(self.stages) != expected:
            raise ValueError(
                f"rank {rank} holds stages {sorted(expected)} in the layout but got modules for {sorted(self.stages)}"
            )
        first = next(next(iter(self.stages.values())).parameters())
        self.dtype, self.device = first.dtype, first.device
        # id(parameter) -> the ranks of this tp group holding an identical copy (replicated parameters are
        # counted once in the gradient norm)
        self._tp_copies: dict[int, int] = {}
        if tp > 1:
            from rlhfuse.runtime.tensor_parallel import tp_copies

            for (m, _, _), module in self.stages.items():
                if self.model_tp[m] > 1:
                    self._tp_copies.update(tp_copies(module, self.model_tp[m]))

    # --- helpers ---------------------------------------------------------------------------------------------
    def _micro_index(self, model: str, replica: int, mb: int) -> int:
        return replica * self.problem.model(model).microbatches + mb

    def _micro(
        self, work: StepWork, model: str, group: int, replica: int, mb: int
    ) -> tuple[TrainBatch, float]:
        i = self._micro_index(model, replica, mb)
        return work.micro[group][i], work.weight[group][i]

    def _message_shape(self, work: StepWork, msg: Message) -> tuple[int, ...]:
        micro, _ = self._micro(work, msg.model, msg.group, msg.replica, msg.microbatch)
        b, t = micro.input_ids_BT.shape
        return (b, t, self.stages_config_width(msg.model))

    def stages_config_width(self, model: str) -> int:
        for (m, _, _), stage in self.stages.items():
            if m == model:
                config: Any = stage.config
                return int(config.hidden_size)
        raise ValueError(f"rank {self.rank} holds no stage of {model}")

    def _params(self, model: str, stage: int | None = None) -> list[torch.nn.Parameter]:
        return [
            p
            for (m, _, s), mod in sorted(self.stages.items())
            if m == model and (stage is None or s == stage)
            for p in mod.parameters()
        ]

    def _last_backwards(self) -> dict[int, int]:
        """Stream index of each reduced stage's last B or W (the op finishing its weight gradients) -> that stage
        (REDUCE_GRAD follows it)."""
        last: dict[tuple[str, int], int] = {}
        out: dict[int, int] = {}
        for i, ins in enumerate(self.stream):
            if ins.kind in WEIGHT_GRAD_KINDS and ins.action is not None:
                last[(ins.model, ins.action.stage)] = i
            elif ins.kind is Kind.REDUCE_GRAD:
                out[last[(ins.model, ins.stage)]] = ins.stage
        return out

    def _reducer(self, model: str, stage: int) -> GradReducer:
        sub = self.geometry.sub_stage(model, stage)
        reducer = self.reducers.get((model, sub))
        if reducer is None:
            reducer = self.reducers[(model, sub)] = GradReducer(
                [self._params(model, sub)],
                self.grad_groups.get((model, sub)),
                bucket_mb=self.grad_bucket_mb,
                wait_fn=lambda work, what: wait_for(work, what, self.rank, self.timeout_s, self.device),
            )
        return reducer

    # --- run -------------------------------------------------------------------------------------------------
    def run(
        self,
        work: StepWork,
        optimizer_step: Callable[[str, float], None] | None = None,
    ) -> StepResult:
        """Run this rank's stream for one mini-batch. At each OPTIMIZER_STEP the model's sends and gradient
        reductions are waited for and its global gradient norm computed (on the device); at the end the step's
        statistics and norms are read at once, and `optimizer_step(model, grad_norm)` is called for every model
        (None: leave the summed gradients in `.grad`)."""
        t0 = time.perf_counter()
        comm = StreamComm(
            self.geometry,
            self.p2p,
            lambda msg: self._message_shape(work, msg),
            dtype=self.dtype,
            device=self.device,
            timeout_s=self.timeout_s,
        )
        timer = OpTimer(self.device)
        inputs: dict[tuple[Action, int], Tensor] = {}
        outputs: dict[tuple[Action, int], Tensor] = {}
        self._pending: dict[tuple[Action, int], PendingWeights] = {}
        reducing: dict[str, list[GradReducer]] = defaultdict(list)
        last_b = self._last_backwards()
        stats_S = torch.zeros(len(LossStats._fields), dtype=torch.float64, device=self.device)
        norms_sq: dict[str, Tensor] = {}
        self._bytes: dict[tuple[Action, int], int] = {}
        self._live = self._peak = 0
        for index, ins in enumerate(self.stream):
            if ins.kind in (Kind.RECV, Kind.SEND):
                comm.run(ins)
            elif ins.kind is Kind.F:
                stats_S += self._forward(ins, work, comm, inputs, outputs, timer)
            elif ins.kind in (Kind.B, Kind.I, Kind.W):
                if index in last_b:  # its gradients become final in this op: buckets launch as they do
                    self._reducer(ins.model, last_b[index]).arm()
                if ins.kind is Kind.W:
                    self._weight_gradients(ins, timer)
                else:
                    self._backward(ins, comm, inputs, outputs, timer)
            elif ins.kind is Kind.REDUCE_GRAD:
                reducing[ins.model].append(self._reducer(ins.model, ins.stage))
                reducing[ins.model][-1].finish()
            elif ins.kind is Kind.OPTIMIZER_STEP:
                comm.wait_sends(ins.model)
                for reducer in reducing.pop(ins.model, []):
                    reducer.wait(f"gradient reduction of {ins.model}")
                if self.model_tp[ins.model] > 1:  # kv heads replicated over the tp group: gradients summed
                    from rlhfuse.runtime.tensor_parallel import sync_replicated_grads

                    for (m, _, _), module in sorted(self.stages.items()):
                        if m == ins.model:
                            sync_replicated_grads(module, self.model_tp_groups[m])
                norms_sq[ins.model] = self._grad_norm_sq(ins.model)
        comm.wait_sends()
        comm.check_drained()
        # the step's one host sync: every rank's weighted statistics (each rank counted 1 / its model's tp) and
        # the gradient norms, read together
        distributed.all_reduce(stats_S)
        models = list(self.program.models or norms_sq)
        values = torch.cat([stats_S, *(norms_sq[m].reshape(1) for m in models)]).tolist()
        stats = LossStats(*values[: len(stats_S)])
        norms = {m: math.sqrt(v) for m, v in zip(models, values[len(stats_S) :], strict=True)}
        for name, value in (("loss/policy", stats.policy_loss), ("loss/value", stats.value_loss)):
            if not math.isfinite(value):  # the same on every rank (summed): all stop, no weight changed
                raise NonFiniteError(f"{name} is {value}")
        op_seconds: dict[tuple[str, int, str], list[float]] = defaultdict(list)
        action_seconds: dict[tuple[Action, int], float] = {}
        for key, took in timer.seconds():
            op: tuple[str, int, str, Action, int] = key  # type: ignore[assignment]
            op_seconds[op[:3]].append(took)
            if self.geometry.model_tp_rank(op[0]) == 0:  # one report per sub-stage: a merged op sums them
                action_seconds[(op[3], op[4])] = took
        seconds = time.perf_counter() - t0
        if optimizer_step is not None:
            # every model's norm is known (and identical on all ranks) before any model steps: a non-finite
            # norm stops the step with no weight changed, on every rank alike
            for model in models:
                optimizer_step(model, norms[model])
        compute = sum(sum(v) for v in op_seconds.values())
        return StepResult(
            stats, norms, seconds, compute, dict(op_seconds), action_seconds, dict(self._bytes), self._peak
        )

    def _forward(
        self,
        ins: Instr,
        work: StepWork,
        comm: StreamComm,
        inputs: dict[tuple[Action, int], Tensor],
        outputs: dict[tuple[Action, int], Tensor],
        timer: OpTimer,
    ) -> Tensor:
        """Run one F (this rank's sub-stage of it); returns its weighted loss statistics (zeros but on a last
        stage), on the device."""
        a = ins.action
        assert a is not None
        micro, weight = self._micro(work, a.model, ins.group, a.replica, a.microbatch)
        geo = self.geometry
        sub, j, k = geo.sub_stage(a.model, a.stage), geo.position(a.model), geo.merge(a.model)
        stage = self.stages[(a.model, a.replica, sub)]
        produced = Message(a.model, ins.group, a.replica, a.stage, a.microbatch, False)
        if sub == 0:
            x = micro.input_ids_BT
        else:
            if j == 0:  # from the previous merged stage (received, or produced on this rank)
                assert ins.needs is not None
                x = comm.take(ins.needs)
            else:  # from the previous sub-stage of this merged stage (waited for before the clock starts)
                x = comm.receive_sub(produced, j - 1, f"sub-stage input of {ins}")
            x = x.requires_grad_(True)
            inputs[(a, ins.group)] = x
        spec = self.problem.model(a.model)
        last = a.stage == spec.stages - 1 and j == k - 1
        stats_S = torch.zeros(len(LossStats._fields), dtype=torch.float64, device=self.device)
        with timer.measure((a.model, sub, ins.kind.value, a, ins.group)):
            with self._saved_tensors(a, ins.group):  # the loss's saved tensors count too
                with self.autocast():
                    layout = (
                        None
                        if work.layout is None
                        else work.layout[ins.group][self._micro_index(a.model, a.replica, a.microbatch)]
                    )
                    out = stage(x, attention_mask_BT=micro.attention_mask_BT, layout=layout)
                if last:
                    loss, stats = self.losses[a.model](out, micro)
        if last:
            # every rank of the model's tp group computes the same statistics: each counts 1 / model_tp
            stats_S = stats.vector() * (weight / self.model_tp[a.model])
            outputs[(a, ins.group)] = loss * weight
        else:
            outputs[(a, ins.group)] = out
            if j < k - 1:  # the next sub-stage of this merged stage
                comm.send_sub(produced, out.detach(), j + 1)
            else:  # the next stage's input: sent (SEND follows) or consumed on this rank
                comm.put(produced, out.detach())
        return stats_S

    def _backward(
        self,
        ins: Instr,
        comm: StreamComm,
        inputs: dict[tuple[Action, int], Tensor],
        outputs: dict[tuple[Action, int], Tensor],
        timer: OpTimer,
    ) -> None:
        """Run one B, or the I of a split backward (the input gradient now; the weight gradients kept for its W),
        and pass the input gradient upstream."""
        a = ins.action
        assert a is not None
        f = (Action(a.model, a.replica, a.stage, Kind.F, a.microbatch), ins.group)
        geo = self.geometry
        sub, j, k = geo.sub_stage(a.model, a.stage), geo.position(a.model), geo.merge(a.model)
        produced = Message(a.model, ins.group, a.replica, a.stage, a.microbatch, True)
        out = outputs.pop(f)
        x = inputs.pop(f) if sub > 0 else None
        grad_out: Tensor | None = None
        if j < k - 1:  # from the next sub-stage of this merged stage (waited for before the clock starts)
            grad_out = comm.receive_sub(produced, j + 1, f"sub-stage gradient of {ins}")
        elif ins.needs is not None:
            grad_out = comm.take(ins.needs)
        grad: Tensor | None = None
        with timer.measure((a.model, sub, ins.kind.value, a, ins.group)):
            if ins.kind is Kind.I:
                params = [p for p in self.stages[(a.model, a.replica, sub)].parameters() if p.requires_grad]
                grad, self._pending[f] = backward_input(out, grad_out, x, params)
            elif grad_out is None:  # last stage: out is the weighted loss
                out.backward()
            else:
                torch.autograd.backward(out, grad_out)
        if ins.kind is Kind.B:
            self._live -= self._bytes.get(f, 0)
        if x is not None:
            if grad is None:
                grad = x.grad if x.grad is not None else torch.zeros_like(x)
            if j > 0:  # to the previous sub-stage of this merged stage
                comm.send_sub(produced, grad, j - 1)
            else:
                comm.put(produced, grad)

    def _weight_gradients(self, ins: Instr, timer: OpTimer) -> None:
        """Run one W: the weight gradients its I left, accumulated into `.grad`; the micro-batch's activation is
        freed at its end (as the simulator counts it)."""
        a = ins.action
        assert a is not None
        f = (Action(a.model, a.replica, a.stage, Kind.F, a.microbatch), ins.group)
        with timer.measure(
            (a.model, self.geometry.sub_stage(a.model, a.stage), ins.kind.value, a, ins.group)
        ):
            backward_weight(self._pending.pop(f))
        self._live -= self._bytes.get(f, 0)

    @contextlib.contextmanager
    def _saved_tensors(self, action: Action, group: int) -> Any:
        """Count the bytes autograd saves during this forward (storages counted once; parameters excluded)."""
        if not self.track_memory:
            yield
            return
        params = {
            t.untyped_storage().data_ptr()
            for m in self.stages.values()
            for t in [*m.parameters(), *m.buffers()]
        }
        seen: set[int] = set()
        total = 0

        def pack(t: Tensor) -> Tensor:
            nonlocal total
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in params and ptr not in seen:
                seen.add(ptr)
                total += storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        self._bytes[(action, group)] = total
        self._live += total
        self._peak = max(self._peak, self._live)

    def _grad_norm_sq(self, model: str) -> Tensor:
        """The whole model's squared gradient norm, on the device: every stage's squared norm, counted once over
        its copies, summed over the world (a collective; read at the end of the step)."""
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        for (m, _, s), mod in self.stages.items():
            if m != model:
                continue
            copies = len(grad_peers(self.problem, self.program.dp, model, self.geometry.merged_stage(m, s)))
            for p in mod.parameters():
                if p.grad is not None:
                    share = copies * self._tp_copies.get(id(p), 1)
                    sq += p.grad.detach().double().pow(2).sum() / share
        distributed.all_reduce(sq)
        return sq


class StepMeasurement(NamedTuple):
    """One executed step: this rank's result, the slowest rank's wall time and the step's bubble ratio
    (1 - total compute / (ranks x measured makespan))."""

    result: StepResult
    measured_s: float
    bubble_ratio: float


class PlanExecutor:
    """Runs training steps of `StepSchedule`s on this rank's stages and measures them (collective: every rank
    runs its stream of the same plan).

    stages: this rank's (model, replica, stage) modules; groups: the layout's process groups; losses: the
    last-stage losses (`ppo_losses`); timeout_s: how long a wait may block; model_tp: each model's tp degree
    (`ParallelLayout.model_tp`; default: the groups' tp size); grad_bucket_mb: the gradient reduction's bucket
    size (`pipeline.grad_bucket_mb`; the reducers and their buffers are kept from step to step).
    """

    def __init__(
        self,
        rank: int,
        world: int,
        stages: Mapping[StageKey, torch.nn.Module],
        groups: ProcessGroups,
        *,
        losses: Mapping[str, LossFn],
        timeout_s: float = 300.0,
        autocast: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
        model_tp: Mapping[str, int] | None = None,
        grad_bucket_mb: float = DEFAULT_BUCKET_MB,
    ) -> None:
        self.rank, self.world = rank, world
        self.stages, self.groups, self.losses = stages, groups, losses
        self.timeout_s, self.autocast = timeout_s, autocast
        self.model_tp = dict(model_tp or {})
        self.grad_bucket_mb = grad_bucket_mb
        self.reducers: dict[tuple[str, int], GradReducer] = {}

    @property
    def device(self) -> torch.device:
        """The stages' device: where the step's data and every collective's tensors live."""
        return next(next(iter(self.stages.values())).parameters()).device

    def run(
        self, plan: StepSchedule, work: StepWork, optimizer_step: Callable[[str, float], None]
    ) -> StepMeasurement:
        device = self.device
        if work.layout is None:
            packed = any(isinstance(module, Stage) and module.packing for module in self.stages.values())
            work = work.with_layouts(packed=packed)  # from the host masks: the step reads no mask value
        if device.type != "cpu":
            work = work.to(device)
        for module in self.stages.values():
            module.train()
        executor = PipelineExecutor(
            self.rank,
            plan.program,
            plan.problem,
            self.stages,
            losses=self.losses,
            p2p_groups=self.groups.p2p,
            grad_groups=self.groups.grad,
            timeout_s=self.timeout_s,
            autocast=self.autocast,
            tp=self.groups.tp_size,
            tp_group=self.groups.tp,
            model_tp_groups=self.groups.model_tp,
            model_tp=self.model_tp,
            grad_bucket_mb=self.grad_bucket_mb,
            reducers=self.reducers,
        )
        distributed.barrier(device)
        result = executor.run(work, optimizer_step=optimizer_step)
        timing = torch.tensor([result.seconds, result.compute_seconds], dtype=torch.float64, device=device)
        longest = timing[:1].clone()
        distributed.all_reduce(longest, op="max")
        distributed.all_reduce(timing)
        measured, compute = torch.cat([longest, timing[1:]]).tolist()  # one read
        bubble = 1.0 - compute / (self.world * measured) if measured > 0 else 0.0
        return StepMeasurement(result, measured, bubble)

    def profile(self, result: StepResult, layout: ParallelLayout, microbatches: int) -> StageProfile:
        """Collective: each stage's mean F, B, I and W seconds over every rank's ops of `result` (the kinds the
        step ran)."""
        keys = [
            (m, s, k) for m in layout.trained for s in range(layout.stages(m)) for k in ("F", "B", "I", "W")
        ]
        device = self.device
        sums = torch.tensor(
            [sum(result.op_seconds.get(key, [])) for key in keys], dtype=torch.float64, device=device
        )
        counts = torch.tensor(
            [len(result.op_seconds.get(key, [])) for key in keys], dtype=torch.float64, device=device
        )
        distributed.all_reduce(sums)
        distributed.all_reduce(counts)
        values = torch.cat([sums, counts]).tolist()  # one read
        mean = {key: values[i] / values[len(keys) + i] for i, key in enumerate(keys) if values[len(keys) + i]}
        return StageProfile.from_means(layout, microbatches, mean)

    def action_seconds(self, result: StepResult) -> dict[Action, float]:
        """Collective: the seconds of every op of fused group 0 in `result`, gathered from every rank (a merged
        stage's op: the sum of its sub-stages' seconds, each reported by the sub-stage's first tp rank)."""
        mine = [
            [a.model, a.replica, a.stage, a.kind.value, a.microbatch, t]
            for (a, g), t in result.action_seconds.items()
            if g == 0
        ]
        times: dict[Action, float] = {}
        for part in distributed.all_gather_json(mine, self.device):  # a tensor message: NCCL carries it
            for model, replica, stage, kind, mb, t in part:
                key = Action(model, int(replica), int(stage), Kind(kind), int(mb))
                times[key] = times.get(key, 0.0) + float(t)  # a merged op: the sum of its sub-stages
        return times
