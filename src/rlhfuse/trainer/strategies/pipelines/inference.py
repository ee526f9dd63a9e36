"""Inference on the training layout: the rollout's Actor and Ref log-probs, Critic values and Reward scores as
one forward-only pipeline over the ranks and stages the layout gives the Actor (Actor, Ref) and the Critic
(Critic, Reward). A critic-free algorithm infers no Critic; its Actor-only layout's critic slot (the Actor's
stages reversed over the same ranks) places the Reward model when one is used.

Planning is pure: `inference_problem` (the four models as a `Problem`: Ref placed like the Actor, Reward like
the Critic, so both directions of the fused placement run at once), `forward_schedule` (a list schedule of every
forward, no backward), then `lower(..., optimizer_steps=False)` and `check_program`, which proves the streams
free of deadlock and message mismatch exactly as for training. Execution: `ForwardExecutor` runs one rank's
stream under `torch.no_grad` (async point-to-point, one process group per model), and `PipelineInferencer` (the
trainer's `Inferencer` under pipeline=fused / serial_1f1b) splits a rollout over data-parallel groups and
micro-batches, runs the stream and sums every last stage's rows over the world, so that every rank holds the
whole `Experience` (as the trainer expects: each rank computes advantages; rank 0's batch is trained).

Legend: B batch rows, P prompt tokens, R response tokens, T = P + R, V vocabulary.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from rlhfuse import distributed
from rlhfuse.core.balance import assign_rows
from rlhfuse.core.balance import split_rows as split_rows  # re-exported: tests and callers import it here
from rlhfuse.core.inference import (
    InferencerConfig,
    final_scores,
    logprobs_from_output,
    scores_from_output,
    values_from_output,
)
from rlhfuse.core.rewards import RewardSet
from rlhfuse.core.types import Experience, ModelRole, Rollout
from rlhfuse.data.tokenizer import Tokenizer
from rlhfuse.models import Transformer, split_stages
from rlhfuse.models.lora import without_adapters
from rlhfuse.pipeline.ir import Action, Kind, Schedule
from rlhfuse.pipeline.problem import Problem, make_problem
from rlhfuse.runtime.layout import ParallelLayout, RankGeometry, warm_up_pairs
from rlhfuse.runtime.lower import Message, Program, lower_checked
from rlhfuse.runtime.streams import PipelineError, StreamComm

# inference model -> the training model whose layout (stages, replicas, placement) it uses
PLACED_AS: dict[str, ModelRole] = {  # results are keyed by ModelRole (a str enum: "actor" finds it)
    ModelRole.ACTOR: ModelRole.ACTOR,
    ModelRole.REF: ModelRole.ACTOR,
    ModelRole.CRITIC: ModelRole.CRITIC,
    ModelRole.REWARD: ModelRole.CRITIC,
}
StageKey = tuple[str, int, int]  # (model, replica, stage)
Head = Callable[[Tensor, Rollout], Tensor]  # last stage's output, micro-batch -> result rows


def inference_problem(layout: ParallelLayout, microbatches: int, models: Sequence[str]) -> Problem:
    """One fused group's forward-only problem: each model of `models` on the stages and placement of the
    training model it is placed as, `microbatches` micro-batches for the larger model (M / K per replica of the
    smaller). Backward durations are unused (a forward-only schedule has no B)."""
    k = layout.replicas(layout.smaller)
    if microbatches < 1 or microbatches % k:
        raise ValueError(f"microbatches={microbatches} must be a positive multiple of the {k} replicas")
    entries = [
        {
            "name": m,
            "stages": layout.merged_stages(PLACED_AS[m]),  # a merged stage runs its sub-stages in turn
            "microbatches": microbatches // layout.replicas(PLACED_AS[m]),
            "forward": 1.0,
            "backward": 1.0,
            "placement": layout.local_placement(PLACED_AS[m]),
        }
        for m in models
    ]
    return make_problem(entries, ranks=layout.group_size, name="inference")


def forward_schedule(problem: Problem, duration: Callable[[Action], float] | None = None) -> Schedule:
    """Every forward of every model, micro-batch and stage, placed by list scheduling: repeatedly the op that
    can start earliest (its rank free, its input produced), ties to the lower micro-batch then the model order.

    Each op is chosen only after the op producing its input, so the choice order is a topological order and
    every rank's list a subsequence of it: the schedule is valid (and `check_program` proves its lowering).
    Both directions run at once where the placement is fused (Actor and Ref forward over the ranks, Critic and
    Reward backward over them). O(ops^2): fine for the few hundred ops of one rollout chunk.
    """
    duration = duration or (lambda a: 1.0)
    order = {m.name: i for i, m in enumerate(problem.models)}
    where = {
        (m.name, r, s): row[s]
        for m in problem.models
        for r, row in enumerate(m.placement)
        for s in range(m.stages)
    }
    stages = {m.name: m.stages for m in problem.models}
    ready = {
        Action(m.name, r, 0, Kind.F, mb): 0.0
        for m in problem.models
        for r in range(m.replicas)
        for mb in range(m.microbatches)
    }
    free = [0.0] * problem.ranks
    lists: list[list[Action]] = [[] for _ in range(problem.ranks)]
    while ready:

        def start(a: Action) -> float:
            return max(free[where[(a.model, a.replica, a.stage)]], ready[a])

        a = min(ready, key=lambda a: (start(a), a.microbatch, order[a.model], a.replica, a.stage))
        rank = where[(a.model, a.replica, a.stage)]
        end = start(a) + duration(a)
        del ready[a]
        free[rank] = end
        lists[rank].append(a)
        if a.stage + 1 < stages[a.model]:
            ready[Action(a.model, a.replica, a.stage + 1, Kind.F, a.microbatch)] = end
    return Schedule.from_lists(lists)


def forward_program(
    layout: ParallelLayout, microbatches: int, models: Sequence[str], *, prefetch: int = 1
) -> tuple[Problem, Program]:
    """The checked forward-only program of `layout` (all data-parallel groups): no deadlock, no mismatch."""
    problem = inference_problem(layout, microbatches, models)
    schedule = forward_schedule(problem)
    return problem, lower_checked(problem, schedule, dp=layout.dp, prefetch=prefetch, optimizer_steps=False)


class ForwardExecutor:
    """Runs one rank's forward-only stream: stage 0 embeds the micro-batch's tokens, later stages take the
    received activation, last stages apply their model's `head` (log-probs, values, scores).

    tp: the pipeline ranks' width (the larger tp degree); model_tp: each model's own tp (default: tp). A model
    with model_tp < tp runs merged stages (`ParallelLayout.merge`): this rank runs sub-stage `position` of each,
    receiving from the previous sub-stage's ranks and sending to the next one's (same tp position); `stages` are
    then keyed by the sub-stage (module) index, and the problem's stages are the merged stages. The arithmetic is
    `RankGeometry`'s and the messages `StreamComm`'s, shared with the training executor."""

    def __init__(
        self,
        rank: int,
        program: Program,
        problem: Problem,
        stages: Mapping[StageKey, nn.Module],
        heads: Mapping[str, Head],
        *,
        p2p_groups: Mapping[Any, Any] | None = None,
        timeout_s: float = 300.0,
        autocast: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
        tp: int = 1,
        model_tp: Mapping[str, int] | None = None,
    ) -> None:
        self.rank, self.program, self.problem = rank, program, problem
        # tensor parallelism: every rank of a tp group runs its group's stream on its shards and exchanges
        # activations with its peer (same tp position) in the neighbouring stage's group
        self.tp = tp
        self.geometry = RankGeometry(
            rank, tp, {m.name: (model_tp or {}).get(m.name, tp) for m in problem.models}
        )
        self.stream = program.streams[self.geometry.pipeline_rank]
        self.stages, self.heads = dict(stages), dict(heads)
        self.p2p = dict(p2p_groups or {})
        self.timeout_s, self.autocast = timeout_s, autocast
        first = next(next(iter(self.stages.values())).parameters())
        self.dtype, self.device = first.dtype, first.device
        self.width = {m: _hidden_size(mod) for (m, _, _), mod in self.stages.items()}

    def _index(self, model: str, replica: int, mb: int) -> int:
        return replica * self.problem.model(model).microbatches + mb

    @torch.no_grad()
    def run(self, micro: Sequence[Sequence[Rollout]]) -> dict[tuple[str, int, int], Tensor]:
        """micro[g][i]: micro-batch i of data-parallel group g. Returns (model, g, i) -> head output for every
        last stage on this rank."""

        def shape_of(m: Message) -> tuple[int, ...]:
            rows = micro[m.group][self._index(m.model, m.replica, m.microbatch)]
            return (len(rows), rows.input_ids_BT.shape[1], self.width[m.model])

        comm = StreamComm(
            self.geometry, self.p2p, shape_of, dtype=self.dtype, device=self.device, timeout_s=self.timeout_s
        )
        results: dict[tuple[str, int, int], Tensor] = {}
        geo = self.geometry
        for ins in self.stream:
            if ins.kind in (Kind.RECV, Kind.SEND):
                comm.run(ins)
            elif ins.kind is Kind.F:
                a = ins.action
                assert a is not None
                i = self._index(a.model, a.replica, a.microbatch)
                rows = micro[ins.group][i]
                j, k = geo.position(a.model), geo.merge(a.model)
                sub = geo.sub_stage(a.model, a.stage)
                produced = Message(a.model, ins.group, a.replica, a.stage, a.microbatch, False)
                if sub == 0:
                    x = rows.input_ids_BT
                elif j == 0:  # from the previous merged stage
                    assert ins.needs is not None
                    x = comm.take(ins.needs)
                else:  # from the previous sub-stage of this merged stage
                    x = comm.receive_sub(produced, j - 1, f"{ins} (sub-stage {sub} input)")
                with self.autocast():
                    out = self.stages[(a.model, a.replica, sub)](x, attention_mask_BT=rows.attention_mask_BT)
                if a.stage == self.problem.model(a.model).stages - 1 and j == k - 1:
                    results[(a.model, ins.group, i)] = self.heads[a.model](out, rows)
                elif j < k - 1:  # the next sub-stage of this merged stage
                    comm.send_sub(produced, out.to(self.dtype), j + 1)
                else:
                    comm.put(produced, out.to(self.dtype))
            else:
                raise PipelineError(f"rank {self.rank}: {ins} in a forward-only stream")
        comm.wait_sends()
        comm.check_drained()
        return results


def _hidden_size(stage: nn.Module) -> int:
    config: Any = stage.config  # a `Stage` carries its model's config
    return int(config.hidden_size)


def trim_responses(rollout: Rollout) -> Rollout:
    """The rollout without its trailing all-padding response columns (responses are right-padded; earlier
    positions do not attend to later ones, so every kept output is unchanged)."""
    used = rollout.response_mask_BR.any(dim=0).nonzero()
    return rollout.responses_cut(int(used.max()) + 1 if len(used) else 1)


class PipelineInferencer:
    """The `Inferencer` of the pipeline strategies: Actor/Ref/Critic/Reward forwards over the training layout.

    Collective: every rank calls `infer` with the same chunks in the same order (the trainer does); rank 0's
    rollout is broadcast so every rank works on identical rows. Result rows of each micro-batch are computed on
    its model's last stage and summed over the world (zeros elsewhere), so every rank returns the same
    `Experience`. `config.micro_batch_size` rows per micro-batch (0 = the layout's micro-batch count per
    data-parallel group), rounded up to a multiple of the smaller model's replicas.
    """

    def __init__(
        self,
        config: InferencerConfig,
        layout: ParallelLayout,
        models: Mapping[str, Transformer],
        *,
        rewards: RewardSet | None,
        tokenizer: Tokenizer,
        temperature: float,
        timeout_s: float = 300.0,
        prefetch: int = 1,
        autocast: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
        log: Callable[[str], None] = print,
        rows: Sequence[Mapping[str, Any]] = (),
        groups: distributed.WorldGroups | None = None,
    ) -> None:
        if not distributed.is_initialized():
            raise ValueError(
                "PipelineInferencer needs torch.distributed: launch with distributed.nproc_per_node=N and "
                "pipeline=fused or serial_1f1b, or use pipeline=plain (whole-model inference in one process)"
            )
        self.config, self.layout = config, layout
        self.models = dict(models)
        self.names = tuple(m for m in PLACED_AS if m in self.models)
        self.rewards, self.tokenizer = rewards, tokenizer
        self.rows = rows  # the dataset rows' fields by prompt id, for the reward function's records
        self.temperature = temperature if temperature > 0 else 1.0
        # receives posted this many compute ops before their consumer (pipeline.prefetch)
        self.timeout_s, self.recv_prefetch, self.autocast = timeout_s, prefetch, autocast
        self.rank = distributed.rank()
        # collective, same order on every rank: one point-to-point group per inference model and rank pair (its messages
        # never match another model's, nor the training's)
        owner = groups if groups is not None else distributed.WorldGroups.current()
        self.p2p = {
            (m, "act", lo, hi): owner.group(("inference", "p2p", m, "act", lo, hi), (lo, hi))
            for m in self.names
            for lo, hi in layout.p2p_pairs(PLACED_AS[m])
        }
        warm_up_pairs({key: (g, [key[2:]]) for key, g in self.p2p.items()}, layout.device)
        self.stages: dict[StageKey, nn.Module] = {}
        for m in self.names:
            split = split_stages(self.models[m], layout.stages(PLACED_AS[m]))
            for model, replica, stage in layout.stages_on(self.rank):
                if model == PLACED_AS[m]:
                    # a LoRA Actor is its own Reference: the Ref runs its stages with the adapters off
                    module = without_adapters(split[stage]) if m == ModelRole.REF else split[stage]
                    self.stages[(m, replica, stage)] = module
        logprobs: Head = lambda out, rows: logprobs_from_output(out, rows, self.temperature)  # noqa: E731
        if (
            layout.model_tp(ModelRole.ACTOR) > 1
        ):  # tensor-parallel shards: the LM heads give vocabulary slices
            logprobs = self._vocab_parallel_logprobs
        self.heads: dict[str, Head] = {
            ModelRole.ACTOR: logprobs,
            ModelRole.REF: logprobs,
            ModelRole.CRITIC: values_from_output,
            ModelRole.REWARD: scores_from_output,
        }
        self.programs: dict[int, tuple[Problem, Program]] = {}
        if self.rank == 0:
            log(
                "rlhfuse: inference over the pipeline layout: "
                + "; ".join(f"{m} on {layout.local_placement(PLACED_AS[m])}" for m in self.names)
            )

    def _vocab_parallel_logprobs(self, logits_BTV: Tensor, rollout: Rollout) -> Tensor:
        """`logprobs_from_output` from this rank's slice of the logits (`vocab_parallel_logprobs`: the full
        logits are never gathered; the shard's vocabulary and tp group are the Actor's and the Ref's alike)."""
        from rlhfuse.runtime.tensor_parallel import vocab_parallel_logprobs

        model: Any = self.models[ModelRole.ACTOR]
        prompt_len = rollout.prompt_ids_BP.shape[1]
        logits_BRV = logits_BTV[:, prompt_len - 1 : -1].float()
        return vocab_parallel_logprobs(
            logits_BRV, rollout.response_ids_BR, model.vocab_shard, model.tp_group, self.temperature
        )

    def microbatches(self, rows: int) -> int:
        k = self.layout.replicas(self.layout.smaller)
        size = self.config.micro_batch_size
        m = math.ceil(math.ceil(rows / self.layout.dp) / size) if size > 0 else self.layout.microbatches
        return max(k, math.ceil(m / k) * k)

    def program(self, microbatches: int) -> tuple[Problem, Program]:
        if microbatches not in self.programs:
            self.programs[microbatches] = forward_program(
                self.layout, microbatches, self.names, prefetch=self.recv_prefetch
            )
        return self.programs[microbatches]

    def prefetch(self) -> None:
        """The stages stay on their ranks' devices: nothing to bring in."""

    def release(self) -> None:
        """Nothing to send back to host memory."""

    def infer(self, rollout: Rollout) -> Experience:
        device = next(iter(self.stages.values())).parameters().__next__().device
        # rank 0's rows on every rank, as one tensor message on the stages' device (NCCL carries it)
        local = rollout = distributed.broadcast_dataclass(rollout, Rollout, 0, device)
        n, r = len(local), local.response_ids_BR.shape[1]
        dp = self.layout.dp
        m = self.microbatches(n)
        problem, program = self.program(m)
        rows = assign_rows(local.response_lengths_B, dp, m, self.layout.replicas(self.layout.smaller))
        micro = [[trim_responses(local.select(idx.to(device))) for idx, _ in group] for group in rows]
        modules = {m_: self.models[m_] for m_ in self.names}
        training = {k: mod.training for k, mod in modules.items()}
        for mod in modules.values():
            mod.eval()
        try:
            executor = ForwardExecutor(
                self.rank,
                program,
                problem,
                self.stages,
                self.heads,
                p2p_groups=self.p2p,
                timeout_s=self.timeout_s,
                autocast=self.autocast,
                tp=self.layout.tp,
                model_tp={m_: self.layout.model_tp(PLACED_AS[m_]) for m_ in self.names},
            )
            results = executor.run(micro)
            # each tp group's rows once: its first rank's (a merged model: its last sub-stage's tp group)
            results = {
                key: value
                for key, value in results.items()
                if self.layout.tp_rank(self.rank, PLACED_AS[key[0]]) == 0
            }
        finally:
            for k, mod in modules.items():
                mod.train(training[k])
        # every result row is computed on exactly one rank: a sum over the world delivers it to all
        widths: dict[str, int] = {
            ModelRole.ACTOR: r,
            ModelRole.REF: r,
            ModelRole.CRITIC: r,
            ModelRole.REWARD: 1,
        }
        out = {name: torch.zeros(n, widths[name], dtype=torch.float32, device=device) for name in self.names}
        for (name, g, i), value in results.items():
            idx, keep = rows[g][i]
            v = value.reshape(len(idx), -1)[
                keep.to(value.device)
            ].float()  # [b, own response width] or [b, 1]
            out[name][idx[keep].to(device), : v.shape[1]] = v
        flat = torch.cat([out[name].reshape(-1) for name in self.names])
        distributed.all_reduce(flat)
        offset = 0
        for name in self.names:
            size = out[name].numel()
            out[name] = flat[offset : offset + size].view_as(out[name])
            offset += size
        rm_scores_B = out[ModelRole.REWARD][:, 0] if ModelRole.REWARD in out else None
        scores = final_scores(self.config, local, rm_scores_B, self.rewards, self.tokenizer, self.rows)
        mask_BR = local.response_mask_BR.float()
        return Experience(
            rollout=rollout,
            logprobs_BR=out[ModelRole.ACTOR] * mask_BR,  # on the device: rewards and GAE run there
            ref_logprobs_BR=out[ModelRole.REF] * mask_BR,
            values_BR=(  # no Critic (a critic-free algorithm): zeros, as the single-process inferencer
                out[ModelRole.CRITIC] * mask_BR if ModelRole.CRITIC in out else torch.zeros_like(mask_BR)
            ),
            scores_B=scores.total_B.to(device),
            rule_scores_BK=scores.rules_BK.to(device),
        )
