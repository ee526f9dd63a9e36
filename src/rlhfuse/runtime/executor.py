"""Executor: runs one rank's instruction stream (from `rlhfuse.runtime.lower`) over torch.distributed;
`PlanExecutor` runs and measures the training steps of a `PipelinePlan` (`rlhfuse.runtime.plan`).

Receives are posted early with `irecv` and waited just before their consumer; sends are `isend`s kept alive
until the optimizer step; gradient reductions are asynchronous `all_reduce`s launched after a stage's last
backward. The PPO policy loss and the value loss run on the last stage of each model, which reads the
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
from rlhfuse.core.losses import actor_loss, critic_loss
from rlhfuse.core.stats import LossStats, scale_stats, sum_stats
from rlhfuse.core.types import TrainBatch
from rlhfuse.pipeline.ir import Action, Kind
from rlhfuse.pipeline.problem import Problem
from rlhfuse.runtime.layout import ParallelLayout, ProcessGroups
from rlhfuse.runtime.lower import Instr, Message, Program, grad_peers
from rlhfuse.runtime.plan import PipelinePlan, StageProfile

StageKey = tuple[str, int, int]  # (model, replica, stage)
LossFn = Callable[[Tensor, TrainBatch], tuple[Tensor, LossStats]]


class PipelineError(RuntimeError):
    """A rank failed or timed out while running its stream; the message names the rank and the instruction."""


def ppo_losses(
    algorithm: AlgorithmConfig, temperature: float = 1.0, vocab: Any = None, tp_group: Any = None
) -> dict[str, LossFn]:
    """Last-stage losses: the Actor's PPO clipped loss (+ entropy bonus), the Critic's clipped value loss, on
    the response positions of a micro-batch (`rlhfuse.core.losses`, the same functions as `PlainStrategy`).

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

    def actor(logits_BTV: Tensor, micro: TrainBatch) -> tuple[Tensor, LossStats]:
        return actor_loss(logits_BTV, micro, algorithm, temperature, **read_out)

    def critic(values_BT: Tensor, micro: TrainBatch) -> tuple[Tensor, LossStats]:
        return critic_loss(values_BT, micro, algorithm)

    return {"actor": actor, "critic": critic}


def wait_for(work: Any, what: str, rank: int, timeout_s: float) -> None:
    """Wait for an async point-to-point or collective handle; a failure or timeout is a PipelineError naming
    the rank and the instruction (another rank probably stopped)."""
    import datetime

    try:
        ok = work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as err:
        raise PipelineError(
            f"rank {rank}: {what} failed or timed out after {timeout_s:.0f}s ({err}); "
            "another rank probably stopped: see its error"
        ) from err
    if ok is False:
        raise PipelineError(f"rank {rank}: {what} timed out after {timeout_s:.0f}s")


@dataclass
class StepWork:
    """The data of one training step as every rank sees it.

    micro[g][i]: micro-batch i of data-parallel group g (the larger model runs all of a group's micro-batches,
    replica r of the smaller model runs those with i // (M / K) == r); weight[g][i]: its share of the mini-batch
    loss (token share for token-mean losses, sample share otherwise), so summed gradients equal the mini-batch's.
    """

    micro: Sequence[Sequence[TrainBatch]]
    weight: Sequence[Sequence[float]]


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
    p2p_groups: one process group per model for point-to-point messages; grad_groups: (model, stage) -> group
    over the ranks holding that stage (None when one rank holds it); timeout_s: how long a wait may block.

    tp: the width of a pipeline rank's group of consecutive ranks (the larger tp degree); model_tp: each model's
    own tp degree (default: tp) and model_tp_groups its tp group on this rank (default: tp_group). A model with
    model_tp < tp has merge = tp / model_tp consecutive stages merged onto each pipeline rank (the problem's
    stages are merged stages, `ParallelLayout.merged_stages`): this rank runs sub-stage `position` of each, the
    sub-stages of one F run in order (the activation passed point to point to the next sub-stage's ranks, same
    tp position), those of one B in reverse; the messages between merged stages leave from the last sub-stage
    and arrive at the first (gradients: the reverse). `stages` are then keyed by the sub-stage (module) index.
    """

    def __init__(
        self,
        rank: int,
        program: Program,
        problem: Problem,
        stages: Mapping[StageKey, torch.nn.Module],
        *,
        losses: Mapping[str, LossFn],
        p2p_groups: Mapping[str, Any] | None = None,
        grad_groups: Mapping[tuple[str, int], Any] | None = None,
        timeout_s: float = 300.0,
        track_memory: bool = False,
        autocast: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
        tp: int = 1,
        tp_group: Any = None,
        model_tp: Mapping[str, int] | None = None,
        model_tp_groups: Mapping[str, Any] | None = None,
    ) -> None:
        self.rank, self.program, self.problem = rank, program, problem
        # tensor parallelism: the streams are per pipeline rank (tp group of consecutive ranks); every rank of a
        # tp group runs its group's stream on its own shards, and exchanges activations with its peer (same tp
        # position) in the neighbouring stage's tp group
        self.tp, self.tp_group, self.tp_rank = tp, tp_group, rank % tp
        self.stream = program.streams[rank // tp]
        self.stages = dict(stages)
        self.losses = losses
        self.p2p = dict(p2p_groups or {})
        self.grad_groups = dict(grad_groups or {})
        self.timeout_s = timeout_s
        self.autocast = autocast
        self.track_memory = track_memory
        self.group = (rank // tp) // program.group_size
        # per model: its tp degree and group, stages merged per pipeline rank, and this rank's sub-stage slot
        self.model_tp = {m.name: (model_tp or {}).get(m.name, tp) for m in problem.models}
        self.model_tp_groups = {m.name: (model_tp_groups or {}).get(m.name, tp_group) for m in problem.models}
        bad = {m: t for m, t in self.model_tp.items() if t < 1 or tp % t}
        if bad:
            raise ValueError(f"model tp degrees {bad} must divide the pipeline rank's width tp={tp}")
        self.merge = {m: tp // t for m, t in self.model_tp.items()}
        self.position = {m: (rank % tp) // t for m, t in self.model_tp.items()}
        self.model_tp_rank = {m: rank % t for m, t in self.model_tp.items()}
        n = problem.ranks
        local = (rank // tp) % n
        expected = {
            (m.name, r, s * self.merge[m.name] + self.position[m.name])
            for m in problem.models
            for r, row in enumerate(m.placement)
            for s, k in enumerate(row)
            if k == local
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

    def _peer(self, pipeline_rank: int, model: str | None = None, position: int = 0) -> int:
        """The global rank of this rank's peer (same tp position of `model`) in sub-stage slot `position` of
        pipeline rank `pipeline_rank` (not merged: the same tp position)."""
        if model is None or self.merge[model] == 1:
            return pipeline_rank * self.tp + self.tp_rank
        t = self.model_tp[model]
        return pipeline_rank * self.tp + position * t + self.model_tp_rank[model]

    def _sub_stage(self, model: str, merged: int) -> int:
        """The stage (module) this rank runs for merged stage `merged` of `model`."""
        return merged * self.merge[model] + self.position[model]

    def _takes_part(self, ins: Instr) -> tuple[bool, int]:
        """Whether this rank takes part in a SEND / RECV between merged stages, and the peer's sub-stage slot:
        activations leave the last sub-stage and arrive at the first, gradients the reverse."""
        assert ins.message is not None
        last = self.merge[ins.model] - 1
        sender, receiver = (0, last) if ins.message.grad else (last, 0)
        mine, theirs = (sender, receiver) if ins.kind is Kind.SEND else (receiver, sender)
        return self.position[ins.model] == mine, theirs

    def _sub_recv(self, work: StepWork, a: Action, group: int, slot: int, grad: bool) -> Tensor:
        """Blocking receive of the activation (or gradient) of `a`'s micro-batch from sub-stage slot `slot` of
        this pipeline rank (the neighbouring sub-stage of the same merged stage)."""
        msg = Message(a.model, group, a.replica, a.stage, a.microbatch, grad)
        buf = torch.empty(self._message_shape(work, msg), dtype=self.dtype, device=self.device)
        start = time.perf_counter()
        peer = self._peer(self.rank // self.tp, a.model, slot)
        handle = distributed.irecv(buf, peer, group=self.p2p.get(a.model))
        self._wait(handle, f"sub-stage receive of {msg} from rank {peer}")
        self._waited += time.perf_counter() - start
        return buf

    def _sub_send(self, tensor: Tensor, a: Action, slot: int) -> None:
        """Send to sub-stage slot `slot` of this pipeline rank (kept alive until the model's optimizer step)."""
        peer = self._peer(self.rank // self.tp, a.model, slot)
        handle = distributed.isend(tensor, peer, group=self.p2p.get(a.model))
        self._sends[a.model].append((handle, tensor))

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

    def _wait(self, work: Any, what: str) -> None:
        wait_for(work, what, self.rank, self.timeout_s)

    def _params(self, model: str, stage: int | None = None) -> list[torch.nn.Parameter]:
        return [
            p
            for (m, _, s), mod in sorted(self.stages.items())
            if m == model and (stage is None or s == stage)
            for p in mod.parameters()
        ]

    # --- run -------------------------------------------------------------------------------------------------
    def run(
        self,
        work: StepWork,
        optimizer_step: Callable[[str, float], None] | None = None,
    ) -> StepResult:
        """Run this rank's stream for one mini-batch. At each OPTIMIZER_STEP the model's sends and gradient
        reductions are waited for and its global gradient norm computed; at the end `optimizer_step(model,
        grad_norm)` is called for every model (None: leave the summed gradients in `.grad`)."""
        t0 = time.perf_counter()
        pending_recv: dict[Message, tuple[Tensor, Any]] = {}
        inbox: dict[Message, Tensor] = {}
        inputs: dict[tuple[Action, int], Tensor] = {}
        outputs: dict[tuple[Action, int], Tensor] = {}
        sends: dict[str, list[tuple[Any, Tensor]]] = defaultdict(list)
        self._sends, self._work, self._waited = sends, work, 0.0
        reduces: dict[str, list[tuple[Any, Tensor, list[torch.nn.Parameter], int]]] = defaultdict(list)
        stat_sums: list[LossStats] = []
        op_seconds: dict[tuple[str, int, str], list[float]] = defaultdict(list)
        action_seconds: dict[tuple[Action, int], float] = {}
        compute = 0.0
        self._bytes: dict[tuple[Action, int], int] = {}
        self._live = self._peak = 0
        norms: dict[str, float] = {}
        for ins in self.stream:
            if ins.kind in (Kind.RECV, Kind.SEND):
                part, slot = self._takes_part(ins)
                if not part:  # another sub-stage of this merged stage sends / receives it
                    continue
            if ins.kind is Kind.RECV:
                assert ins.message is not None
                if ins.post:
                    buf = torch.empty(
                        self._message_shape(work, ins.message), dtype=self.dtype, device=self.device
                    )
                    peer = self._peer(ins.peer, ins.model, slot)
                    handle = distributed.irecv(buf, peer, group=self.p2p.get(ins.model))
                    pending_recv[ins.message] = (buf, handle)
                else:
                    buf, handle = pending_recv.pop(ins.message)
                    self._wait(handle, str(ins))
                    inbox[ins.message] = buf
            elif ins.kind is Kind.SEND:
                assert ins.message is not None
                tensor = inbox.pop(ins.message)
                peer = self._peer(ins.peer, ins.model, slot)
                handle = distributed.isend(tensor, peer, group=self.p2p.get(ins.model))
                sends[ins.model].append((handle, tensor))
            elif ins.kind in (Kind.F, Kind.B):
                assert ins.action is not None
                start, self._waited = time.perf_counter(), 0.0
                if ins.kind is Kind.F:
                    self._forward(ins, work, inbox, inputs, outputs, stat_sums)
                else:
                    self._backward(ins, inbox, inputs, outputs)
                took = time.perf_counter() - start - self._waited  # this sub-stage's compute alone
                compute += took
                sub = self._sub_stage(ins.model, ins.action.stage)
                op_seconds[(ins.model, sub, ins.kind.value)].append(took)
                if self.model_tp_rank[ins.model] == 0:  # one report per sub-stage: a merged op sums them
                    action_seconds[(ins.action, ins.group)] = took
            elif ins.kind is Kind.REDUCE_GRAD:
                sub = self._sub_stage(ins.model, ins.stage)
                params = self._params(ins.model, sub)
                flat = torch.cat(
                    [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
                )
                handle = distributed.all_reduce(
                    flat, group=self.grad_groups.get((ins.model, sub)), async_op=True
                )
                reduces[ins.model].append((handle, flat, params, len(ins.peers)))
            elif ins.kind is Kind.OPTIMIZER_STEP:
                for handle, _ in sends.pop(ins.model, []):
                    self._wait(handle, f"send of {ins.model}")
                for handle, flat, params, _ in reduces.pop(ins.model, []):
                    self._wait(handle, f"gradient reduction of {ins.model}")
                    offset = 0
                    for p in params:
                        n = p.numel()
                        p.grad = flat[offset : offset + n].view_as(p).clone()
                        offset += n
                if self.model_tp[ins.model] > 1:  # kv heads replicated over the tp group: gradients summed
                    from rlhfuse.runtime.tensor_parallel import sync_replicated_grads

                    for (m, _, _), module in sorted(self.stages.items()):
                        if m == ins.model:
                            sync_replicated_grads(module, self.model_tp_groups[m])
                norms[ins.model] = self._grad_norm(ins.model)
        if pending_recv:
            raise PipelineError(
                f"rank {self.rank}: receives posted but never waited: {list(pending_recv)[:4]}"
            )
        seconds = time.perf_counter() - t0
        stats = self._all_stats(stat_sums)
        if optimizer_step is not None:
            # every model's norm is known (and identical on all ranks) before any model steps: a non-finite
            # norm stops the step with no weight changed, on every rank alike
            for model in self.program.models or tuple(norms):
                optimizer_step(model, norms[model])
        return StepResult(
            stats, norms, seconds, compute, dict(op_seconds), action_seconds, dict(self._bytes), self._peak
        )

    def _forward(
        self,
        ins: Instr,
        work: StepWork,
        inbox: dict[Message, Tensor],
        inputs: dict[tuple[Action, int], Tensor],
        outputs: dict[tuple[Action, int], Tensor],
        stat_sums: list[LossStats],
    ) -> None:
        a = ins.action
        assert a is not None
        micro, weight = self._micro(work, a.model, ins.group, a.replica, a.microbatch)
        sub, j, k = self._sub_stage(a.model, a.stage), self.position[a.model], self.merge[a.model]
        stage = self.stages[(a.model, a.replica, sub)]
        if sub == 0:
            x = micro.input_ids_BT
        else:
            if j == 0:  # from the previous merged stage (received, or produced on this rank)
                assert ins.needs is not None
                x = inbox.pop(ins.needs)
            else:  # from the previous sub-stage of this merged stage
                x = self._sub_recv(work, a, ins.group, j - 1, False)
            x = x.requires_grad_(True)
            inputs[(a, ins.group)] = x
        spec = self.problem.model(a.model)
        last = a.stage == spec.stages - 1 and j == k - 1
        with self._saved_tensors(a, ins.group):  # the loss's saved tensors count too
            with self.autocast():
                out = stage(x, attention_mask_BT=micro.attention_mask_BT)
            if last:
                loss, stats = self.losses[a.model](out, micro)
        if last:
            if not torch.isfinite(loss):
                name = "loss/policy" if a.model == "actor" else f"loss/{a.model}"
                raise NonFiniteError(f"{name} is {float(loss.detach())}")
            # every rank of the model's tp group computes the same statistics: each counts 1 / model_tp
            stat_sums.append(scale_stats(stats, weight / self.model_tp[a.model]))
            outputs[(a, ins.group)] = loss * weight
        else:
            outputs[(a, ins.group)] = out
            if j < k - 1:  # the next sub-stage of this merged stage
                self._sub_send(out.detach(), a, j + 1)
            else:  # the next stage's input: sent (SEND follows) or consumed on this rank
                inbox[Message(a.model, ins.group, a.replica, a.stage, a.microbatch, False)] = out.detach()

    def _backward(
        self,
        ins: Instr,
        inbox: dict[Message, Tensor],
        inputs: dict[tuple[Action, int], Tensor],
        outputs: dict[tuple[Action, int], Tensor],
    ) -> None:
        a = ins.action
        assert a is not None
        f = (Action(a.model, a.replica, a.stage, Kind.F, a.microbatch), ins.group)
        sub, j, k = self._sub_stage(a.model, a.stage), self.position[a.model], self.merge[a.model]
        out = outputs.pop(f)
        if j < k - 1:  # from the next sub-stage of this merged stage
            torch.autograd.backward(out, self._sub_recv(self._work, a, ins.group, j + 1, True))
        elif ins.needs is None:  # last stage: out is the weighted loss
            out.backward()
        else:
            torch.autograd.backward(out, inbox.pop(ins.needs))
        self._live -= self._bytes.get(f, 0)
        if sub > 0:
            x = inputs.pop(f)
            grad = x.grad if x.grad is not None else torch.zeros_like(x)
            if j > 0:  # to the previous sub-stage of this merged stage
                self._sub_send(grad, a, j - 1)
            else:
                inbox[Message(a.model, ins.group, a.replica, a.stage, a.microbatch, True)] = grad

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

    def _grad_norm(self, model: str) -> float:
        """The whole model's gradient norm: every stage's squared norm, counted once over its copies."""
        spec = self.problem.model(model)
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        for (m, _, s), mod in self.stages.items():
            if m != model:
                continue
            copies = len(grad_peers(self.problem, self.program.dp, model, s // self.merge[m]))
            for p in mod.parameters():
                if p.grad is not None:
                    share = copies * self._tp_copies.get(id(p), 1)
                    sq += p.grad.detach().double().pow(2).sum() / share
        del spec
        distributed.all_reduce(sq)
        return math.sqrt(float(sq))

    def _all_stats(self, parts: Sequence[LossStats]) -> LossStats:
        """The mini-batch's loss statistics: this rank's weighted micro-batch statistics summed over all ranks."""
        vec = torch.tensor(
            sum_stats(parts) if parts else LossStats(), dtype=torch.float64, device=self.device
        )
        distributed.all_reduce(vec)  # each rank's statistics counted 1 / its model's tp (`_forward`)
        return LossStats(*vec.tolist())


class StepMeasurement(NamedTuple):
    """One executed step: this rank's result, the slowest rank's wall time and the step's bubble ratio
    (1 - total compute / (ranks x measured makespan))."""

    result: StepResult
    measured_s: float
    bubble_ratio: float


class PlanExecutor:
    """Runs training steps of `PipelinePlan`s on this rank's stages and measures them (collective: every rank
    runs its stream of the same plan).

    stages: this rank's (model, replica, stage) modules; groups: the layout's process groups; losses: the
    last-stage losses (`ppo_losses`); timeout_s: how long a wait may block; model_tp: each model's tp degree
    (`ParallelLayout.model_tp`; default: the groups' tp size).
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
    ) -> None:
        self.rank, self.world = rank, world
        self.stages, self.groups, self.losses = stages, groups, losses
        self.timeout_s, self.autocast = timeout_s, autocast
        self.model_tp = dict(model_tp or {})

    @property
    def device(self) -> torch.device:
        """The stages' device: where the step's data and every collective's tensors live."""
        return next(next(iter(self.stages.values())).parameters()).device

    def run(
        self, plan: PipelinePlan, work: StepWork, optimizer_step: Callable[[str, float], None]
    ) -> StepMeasurement:
        device = self.device
        if device.type != "cpu":
            work = StepWork([[m.to(device) for m in g] for g in work.micro], work.weight)
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
        )
        distributed.barrier(device)
        result = executor.run(work, optimizer_step=optimizer_step)
        timing = torch.tensor([result.seconds, result.compute_seconds], dtype=torch.float64, device=device)
        longest = timing[:1].clone()
        distributed.all_reduce(longest, op="max")
        distributed.all_reduce(timing)
        measured = float(longest)
        bubble = 1.0 - float(timing[1]) / (self.world * measured) if measured > 0 else 0.0
        return StepMeasurement(result, measured, bubble)

    def profile(self, result: StepResult, layout: ParallelLayout, microbatches: int) -> StageProfile:
        """Collective: each stage's mean forward / backward seconds over every rank's ops of `result`."""
        keys = [(m, s, k) for m in layout.trained for s in range(layout.stages(m)) for k in ("F", "B")]
        device = self.device
        sums = torch.tensor(
            [sum(result.op_seconds.get(key, [])) for key in keys], dtype=torch.float64, device=device
        )
        counts = torch.tensor(
            [len(result.op_seconds.get(key, [])) for key in keys], dtype=torch.float64, device=device
        )
        distributed.all_reduce(sums)
        distributed.all_reduce(counts)
        mean = {key: float(sums[i] / counts[i].clamp(min=1)) for i, key in enumerate(keys)}
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
