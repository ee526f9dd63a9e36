"""`FusedPipelineStrategy`: the `Strategy` of `RLHFTrainer` over the distributed runtime.

Every rank holds full copies of the Actor and the Critic (same checkpoint, same seed) and trains only the
stages the layout places on it. One `train_step`: rank 0's mini-batch is broadcast, split over data-parallel
groups and micro-batches by token cost, and the rank's instruction stream runs it (compute, async p2p,
gradient reduction, one optimizer step per model).

`schedule="serial_1f1b"` runs both models with 1F1B one after the other on the same ranks (the baseline);
`schedule="fused"` profiles the first step under that baseline, then rank 0 searches the fused schedule with the
measured per-stage forward/backward times and broadcasts it (cached: the micro-batch count is fixed).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from rlhfuse.core.advantages import AlgorithmConfig
from rlhfuse.core.errors import NonFiniteError
from rlhfuse.core.optim import build_optimizer
from rlhfuse.core.stats import PipelineStats, TrainStats
from rlhfuse.core.types import TrainBatch
from rlhfuse.models import Transformer, split_stages
from rlhfuse.pipeline import SearchConfig, greedy, serial_one_f_one_b, simulate, solve
from rlhfuse.pipeline.ir import Schedule
from rlhfuse.pipeline.problem import Problem
from rlhfuse.runtime.balance import budget_microbatches, microbatch_imbalance, split_minibatch
from rlhfuse.runtime.checkpoint import layout_record, load_sharded, save_sharded
from rlhfuse.runtime.config import PipelineConfig
from rlhfuse.runtime.executor import PipelineExecutor, StepResult, StepWork, ppo_losses
from rlhfuse.runtime.layout import MODELS, ModelParallel, ParallelLayout, build_process_groups
from rlhfuse.runtime.lower import Program, lower_checked
from rlhfuse.runtime.partition import stages_for_rank

SCHEDULES = ("fused", "serial_1f1b")


class FusedPipelineStrategy:
    def __init__(
        self,
        actor: Transformer,
        critic: Transformer,
        config: PipelineConfig,
        algorithm: AlgorithmConfig,
        *,
        total_steps: int,
        mini_batch_size: int,
        micro_batch_size: int,
        micro_batch_tokens: int = 0,
        temperature: float = 1.0,
        schedule: str = "fused",
        timeout_s: float = 300.0,
        autocast: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
        log: Callable[[str], None] = print,
    ) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule={schedule!r} is not one of {list(SCHEDULES)}")
        if not dist.is_initialized():
            raise ValueError(
                f"pipeline={schedule} needs torch.distributed: launch with distributed.nproc_per_node=N "
                "(or torchrun), or use pipeline=plain"
            )
        self.models = {"actor": actor, "critic": critic}
        self.config, self.algorithm, self.schedule_name = config, algorithm, schedule
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        big = max(config.actor_pp, config.critic_pp)
        dp = max(self.world // big, 1)
        micro = config.microbatches or max(1, mini_batch_size // max(micro_batch_size, 1) // dp)
        self.layout = ParallelLayout(
            ModelParallel(config.actor_pp), ModelParallel(config.critic_pp), dp, self.world, micro
        )
        self.timeout_s = timeout_s
        self.log = log
        self.groups = build_process_groups(self.layout, timeout_s)
        self.stages = stages_for_rank(self.layout, self.rank, self.models)
        self.losses = ppo_losses(algorithm, temperature if temperature > 0 else 1.0)
        self.autocast = autocast
        # every stage of every model (the same split on all ranks), for weight gathering
        self.all_stages = {m: split_stages(self.models[m], self.layout.stages(m)) for m in MODELS}
        lrs = {"actor": config.optim.actor_lr, "critic": config.optim.critic_lr}
        self.optims: dict[str, torch.optim.Optimizer] = {}
        self.scheds: dict[str, torch.optim.lr_scheduler.LambdaLR] = {}
        for m in MODELS:
            self.optims[m], self.scheds[m] = build_optimizer(
                self._local_params(m), lrs[m], config.optim, total_steps
            )
        # micro-batches per group: the layout's, or per step from a token budget (each count planned once)
        self.micro_batch_tokens = micro_batch_tokens
        self.micro = micro
        self.problem: Problem = self.layout.problem()
        self.schedule: Schedule = serial_one_f_one_b(self.problem)
        self.program: Program = lower_checked(self.problem, self.schedule, dp=dp, prefetch=config.prefetch)
        self.profiled: Problem | None = None
        self.predicted_s = float("nan")
        self.predicted_serial_s = float("nan")
        # per-micro-batch F/B seconds per (model, stage) measured on the profiling step, and its micro-batch count
        self.base: dict[str, Any] | None = None
        self.plans: dict[int, tuple[Problem, Schedule, Program, Problem | None, float, float]] = {}
        self.steps = 0
        self.last_result: StepResult | None = None
        if self.rank == 0:
            log(f"rlhfuse: pipeline={schedule}: {self.layout.describe()}; {micro} micro-batches per group")

    # --- Strategy protocol ---------------------------------------------------------------------------------------
    def train_step(self, batch: TrainBatch) -> TrainStats:
        batch = self._broadcast_batch(batch)
        if self.micro_batch_tokens > 0:
            lengths = batch.attention_mask_BT.sum(dim=1).tolist()
            k = self.layout.replicas(self.layout.smaller)
            self._use(budget_microbatches(lengths, self.layout.dp, self.micro_batch_tokens, k))
        micro, weights, skew = split_minibatch(
            batch,
            self.layout.dp,
            self.micro,
            balance=self.config.balance,
            loss_reduction=self.algorithm.loss_reduction,
        )
        micro_skew = microbatch_imbalance(micro)
        device = next(iter(self.stages.values())).parameters().__next__().device
        if device.type != "cpu":
            micro = [[m.to(device) for m in g] for g in micro]
        for module in self.stages.values():
            module.train()
        executor = PipelineExecutor(
            self.rank,
            self.program,
            self.problem,
            self.stages,
            losses=self.losses,
            p2p_groups=self.groups.p2p,
            grad_groups=self.groups.grad,
            timeout_s=self.timeout_s,
            autocast=self.autocast,
        )
        dist.barrier()
        result = executor.run(StepWork(micro, weights), optimizer_step=self._optimizer_step)
        self.last_result = result
        timing = torch.tensor([result.seconds, result.compute_seconds], dtype=torch.float64)
        longest = timing[:1].clone()
        dist.all_reduce(longest, op=dist.ReduceOp.MAX)
        dist.all_reduce(timing)
        measured = float(longest)
        bubble = 1.0 - float(timing[1]) / (self.world * measured) if measured > 0 else 0.0
        predicted = self.predicted_s
        if self.profiled is None:
            self._plan(result)
            predicted = self.predicted_serial_s
        self.steps += 1
        return TrainStats(
            loss=result.stats,
            actor_grad_norm=result.grad_norm["actor"],
            critic_grad_norm=result.grad_norm["critic"],
            lr=float(self.scheds["actor"].get_last_lr()[0]),
            pipeline=PipelineStats(
                predicted_makespan_s=predicted,
                measured_makespan_s=measured,
                bubble_ratio=bubble,
                dp_imbalance=skew,
                microbatches=float(self.micro),
                microbatch_imbalance=micro_skew,
            ),
        )

    def actor_weights(self) -> Mapping[str, Tensor]:
        """The Actor's full weights on every rank (each stage broadcast from its first owner). The Critic is
        gathered too: a per-rank inferencer (fused generation) reads both full models."""
        self._gather_all()
        return self.models["actor"].state_dict()

    def state_dict(self) -> dict[str, Any]:
        self._gather_all()
        return {
            "actor": self.models["actor"].state_dict(),
            "critic": self.models["critic"].state_dict(),
            "rank": self.rank,
            "world_size": self.world,
            **{f"{m}_optim": self.optims[m].state_dict() for m in MODELS},
            **{f"{m}_sched": self.scheds[m].state_dict() for m in MODELS},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("world_size") != self.world or state.get("rank") != self.rank:
            raise ValueError(
                f"this pipeline state was saved by rank {state.get('rank')} of {state.get('world_size')}; "
                f"this is rank {self.rank} of {self.world}: resume with the same layout"
            )
        for m in MODELS:
            self.models[m].load_state_dict(state[m])
            self.optims[m].load_state_dict(state[f"{m}_optim"])
            self.scheds[m].load_state_dict(state[f"{m}_sched"])

    # --- sharded checkpoints (rlhfuse.runtime.checkpoint) -----------------------------------------------------
    def layout_record(self) -> dict[str, Any]:
        """The layout a shard depends on: world size, dp, micro-batches, each model's stages and layer ranges."""
        return layout_record(
            self.layout, {m: [stage.layer_range for stage in self.all_stages[m]] for m in MODELS}
        )

    def save_checkpoint(
        self, directory: str | Path, iteration: int, extra: Mapping[str, Any], *, keep: int = 0
    ) -> Path:
        """Collective: this rank's stages, optimizer and scheduler states, the planned schedule and `extra`."""
        weights = {
            f"{m}.r{r}.s{s}.{name}": tensor
            for (m, r, s), module in sorted(self.stages.items())
            for name, tensor in module.state_dict().items()
        }
        schedule: dict[str, Any] = {"steps": self.steps, "microbatches": self.micro}
        if self.base is not None:  # a resumed run keeps the planned schedule (same op order, same sums)
            schedule.update(
                base=json.dumps(self.base),
                schedule=self.schedule.to_json(),
                predicted_s=self.predicted_s,
                predicted_serial_s=self.predicted_serial_s,
            )
        state = {
            **{f"{m}_optim": self.optims[m].state_dict() for m in MODELS},
            **{f"{m}_sched": self.scheds[m].state_dict() for m in MODELS},
            "pipeline": schedule,
            **extra,
        }
        return save_sharded(
            directory, iteration, weights=weights, state=state, layout=self.layout_record(), keep=keep
        )

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        """Collective: check the manifest against this layout, restore this rank's shard; returns its state."""
        weights, state, _ = load_sharded(path, self.layout_record())
        for (m, r, s), module in self.stages.items():
            prefix = f"{m}.r{r}.s{s}."
            module.load_state_dict({k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)})
        for m in MODELS:
            self.optims[m].load_state_dict(state[f"{m}_optim"])
            self.scheds[m].load_state_dict(state[f"{m}_sched"])
        schedule = state["pipeline"]
        self.steps = int(schedule["steps"])
        self.plans = {}
        self.micro = int(schedule["microbatches"])
        self.problem = self._layout(self.micro).problem()
        self.schedule = serial_one_f_one_b(self.problem)
        self.profiled, self.base = None, None
        if "base" in schedule:
            self.base = json.loads(schedule["base"])
            self.profiled = self._profiled(self.micro)
            self.schedule = Schedule.from_json(schedule["schedule"])
            self.predicted_s = float(schedule["predicted_s"])
            self.predicted_serial_s = float(schedule["predicted_serial_s"])
        self.program = lower_checked(
            self.problem, self.schedule, dp=self.layout.dp, prefetch=self.config.prefetch
        )
        self._gather_all()
        return state

    # --- internals -----------------------------------------------------------------------------------------------
    def _local_params(self, model: str) -> list[torch.nn.Parameter]:
        seen: dict[int, torch.nn.Parameter] = {}
        for (m, _, _), module in sorted(self.stages.items()):
            if m == model:
                for p in module.parameters():
                    seen.setdefault(id(p), p)
        return list(seen.values())

    def _optimizer_step(self, model: str, norm: float) -> None:
        if not math.isfinite(norm):
            for optim in self.optims.values():
                optim.zero_grad(set_to_none=True)
            raise NonFiniteError(f"{model}/grad_norm is {norm}")
        params = self._local_params(model)
        if self.config.optim.grad_clip > 0:
            coef = min(1.0, self.config.optim.grad_clip / (norm + 1e-6))
            if coef < 1.0:
                for p in params:
                    if p.grad is not None:
                        p.grad.mul_(coef)
        self.optims[model].step()
        self.scheds[model].step()
        self.optims[model].zero_grad(set_to_none=True)

    def _broadcast_batch(self, batch: TrainBatch) -> TrainBatch:
        box: list[Any] = [batch if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        out = box[0]
        assert isinstance(out, TrainBatch)
        return out

    def _gather_all(self) -> None:
        for m in MODELS:
            self._gather(m)

    def _gather(self, model: str) -> None:
        for s, stage in enumerate(self.all_stages[model]):
            owner = self.layout.rank(model, 0, 0, s)
            params = list(stage.parameters())
            flat = torch.cat([p.detach().reshape(-1) for p in params])
            dist.broadcast(flat, src=owner)  # NCCL: the stage's device; gloo: CPU
            if self.rank != owner:
                offset = 0
                with torch.no_grad():
                    for p in params:
                        p.copy_(flat[offset : offset + p.numel()].view_as(p))
                        offset += p.numel()

    def replay_makespan(self) -> float:
        """Collective: the makespan the simulator gives the current schedule with the compute times of the last
        step's own ops (gathered from every rank of fused group 0). Measured / replayed - 1 is the share of
        communication, bookkeeping and waiting not explained by compute."""
        assert self.last_result is not None and self.profiled is not None
        gathered: list[Any] = [None] * self.world
        mine = {a: t for (a, g), t in self.last_result.action_seconds.items() if g == 0}
        dist.all_gather_object(gathered, mine)
        times: dict[Any, float] = {}
        for part in gathered:
            times.update(part or {})
        return simulate(self.profiled, self.schedule, durations=lambda a: times[a]).makespan

    def _layout(self, microbatches: int) -> ParallelLayout:
        return dataclasses.replace(self.layout, microbatches=microbatches)

    def _profiled(self, microbatches: int) -> Problem:
        """The problem with the profiled stage times, scaled to `microbatches` micro-batches of the same
        mini-batch (a micro-batch's time taken as proportional to its share)."""
        assert self.base is not None
        scale = self.base["microbatches"] / microbatches
        forward, backward = (
            {m: [t * scale if scale != 1 else t for t in self.base[kind][m]] for m in MODELS}
            for kind in ("forward", "backward")
        )
        return self._layout(microbatches).problem(forward=forward, backward=backward, name="profiled")

    def _use(self, microbatches: int) -> None:
        """Collective (same count on every rank): switch to the plan for `microbatches` micro-batches per
        group, planned from the profiled stage times the first time it is needed (cached)."""
        if microbatches == self.micro:
            return
        if self.profiled is not None:  # a plan from the profile (not the serial stand-in before profiling)
            self.plans[self.micro] = (
                self.problem,
                self.schedule,
                self.program,
                self.profiled,
                self.predicted_s,
                self.predicted_serial_s,
            )
        self.micro = microbatches
        if microbatches in self.plans:
            (self.problem, self.schedule, self.program, self.profiled, self.predicted_s,
             self.predicted_serial_s) = self.plans[microbatches]  # fmt: skip
            return
        self.problem = self._layout(microbatches).problem()
        self.schedule = serial_one_f_one_b(self.problem)
        self.profiled = None
        if self.base is not None:
            self._schedule_from_profile()
        else:  # not profiled yet: this step runs serial 1F1B and profiles
            self.program = lower_checked(
                self.problem, self.schedule, dp=self.layout.dp, prefetch=self.config.prefetch
            )

    def _plan(self, result: StepResult) -> None:
        """After the first (serial 1F1B) step: per-stage durations measured on every rank -> problem ->
        schedule (rank 0 searches, everyone receives the same) -> lowered, checked program."""
        keys = [(m, s, k) for m in MODELS for s in range(self.layout.stages(m)) for k in ("F", "B")]
        sums = torch.zeros(len(keys), dtype=torch.float64)
        counts = torch.zeros(len(keys), dtype=torch.float64)
        for i, key in enumerate(keys):
            times = result.op_seconds.get(key, [])
            sums[i], counts[i] = sum(times), len(times)
        dist.all_reduce(sums)
        dist.all_reduce(counts)
        mean = {key: float(sums[i] / counts[i].clamp(min=1)) for i, key in enumerate(keys)}
        floor = 1e-6
        self.base = {
            "microbatches": self.micro,
            "forward": {
                m: [max(mean[(m, s, "F")], floor) for s in range(self.layout.stages(m))] for m in MODELS
            },
            "backward": {
                m: [max(mean[(m, s, "B")], floor) for s in range(self.layout.stages(m))] for m in MODELS
            },
        }
        self._schedule_from_profile()

    def _schedule_from_profile(self) -> None:
        """Collective: the schedule for the current micro-batch count from the profiled stage times."""
        self.profiled = self._profiled(self.micro)
        self.predicted_serial_s = simulate(self.profiled, serial_one_f_one_b(self.profiled)).makespan
        if self.schedule_name == "serial_1f1b":
            self.predicted_s = self.predicted_serial_s
            self.program = lower_checked(
                self.problem, self.schedule, dp=self.layout.dp, prefetch=self.config.prefetch
            )
            return
        box: list[Any] = [None]
        if self.rank == 0:
            if self.config.search_budget_s > 0:
                solution = solve(self.profiled, SearchConfig(time_budget=self.config.search_budget_s))
                box[0] = solution.schedule.to_json()
            else:
                box[0] = greedy(self.profiled).to_json()
        dist.broadcast_object_list(box, src=0)
        self.schedule = Schedule.from_json(box[0])
        self.program = lower_checked(
            self.problem, self.schedule, dp=self.layout.dp, prefetch=self.config.prefetch
        )
        self.predicted_s = simulate(self.profiled, self.schedule).makespan
        if self.rank == 0:
            self.log(
                f"rlhfuse: fused schedule from measured stage times ({self.micro} micro-batches): predicted "
                f"{self.predicted_s * 1e3:.1f} ms vs serial 1F1B {self.predicted_serial_s * 1e3:.1f} ms per "
                f"mini-batch ({self.predicted_serial_s / self.predicted_s:.2f}x)"
            )
