"""`RLHFTrainer`: the RL loop of RLHF, one iteration at a time, in the paper's order.

1. rollout    = generation (Actor samples responses) + inference (Actor/Ref log-probs, reward, values),
                serial or fused (`RolloutStage`, chosen when the trainer is built)
2. advantages = the algorithm's (`algorithm.name`): PPO's score + per-token KL penalty then GAE, or a
                critic-free baseline (GRPO, RLOO, REINFORCE++)
3. training   = Actor (and, with a Critic, Critic) updates over shuffled mini-batches, for ppo_epochs passes
4. weight sync of the trained Actor to the generator
5. callbacks, logging, checkpoint
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from rlhfuse.agents.agent_config import AgentConfig
from rlhfuse.algorithms.off_policy import OFF_POLICY_CORRECTIONS
from rlhfuse.core.advantages import AlgorithmConfig, compute_train_batch
from rlhfuse.core.checkpoint import (
    CheckpointConfig,
    RunIdentity,
    begin_run,
    clean_stale,
    end_run,
    prune_run,
    read_runs,
    rng_state,
    set_rng_state,
)
from rlhfuse.core.errors import CheckpointError, NonFiniteError
from rlhfuse.core.protocols import Callback, FabricLike, Generator, Inferencer, Logger, RolloutStage, Strategy
from rlhfuse.core.rewards import NonFiniteRewardError
from rlhfuse.core.stats import TrainStats, episode_metrics, mean_stats, sampler_mismatch, staleness
from rlhfuse.core.types import Experience, TrainBatch
from rlhfuse.data.data_config import DataConfig
from rlhfuse.data.feed import PromptFeed
from rlhfuse.data.prompts import PromptLoader
from rlhfuse.runtime.launch import launched_rank_zero
from rlhfuse.runtime.local import LocalFabric
from rlhfuse.trainer.async_config import AsyncConfig
from rlhfuse.trainer.evaluation import EvalConfig
from rlhfuse.trainer.logging import LoggerConfig, rewind_loggers
from rlhfuse.trainer.models import ModelsConfig
from rlhfuse.trainer.parts import GeneratorPart, InferencerPart, Parts, StrategyPart
from rlhfuse.trainer.resume import check_resume_config, config_hash, config_record
from rlhfuse.trainer.run_config import RLHFConfig

if TYPE_CHECKING:
    from rlhfuse.trainer.split import GenerationService

log = logging.getLogger(__name__)


ModelChoice = ModelsConfig | str | Path
"""What `fit` and `setup` take as the models: their settings (`ModelsConfig`: checkpoint folders, LoRA, the
embedded model's size), or the Actor's Hugging Face checkpoint folder alone (a reward model then comes from
`ModelsConfig.reward_path` of the base configuration, or the score from reward functions)."""


def _quiet(message: str) -> None:
    """The log of a rank other than 0."""


def check_callbacks(callbacks: Sequence[object]) -> None:
    """Every callback subclasses `Callback` (the trainer calls its hooks by name in the code), else a TypeError
    naming the ones that do not."""
    strays = [type(c).__name__ for c in callbacks if not isinstance(c, Callback)]
    if strays:
        raise TypeError(
            f"callbacks {strays} do not subclass rlhfuse.core.protocols.Callback: derive them from it and override "
            "the hooks they need (on_fit_start, on_stage_start, on_rollout_end, on_metrics, on_iteration_end, "
            "on_fit_end, on_exception)"
        )


@dataclass
class Assembled:
    """What `RLHFTrainer.setup` builds from the configured parts (`rlhfuse.trainer.build.assemble`): the validated
    configuration, the run's components, its prompts, folder, callbacks and loggers, and the configuration record
    run.json keeps."""

    config: RLHFConfig
    generator: Generator
    inferencer: Inferencer
    strategy: Strategy
    rollout: RolloutStage
    prompts: PromptLoader
    pad_token_id: int
    run_dir: Path
    callbacks: list[Callback] = field(default_factory=list)
    loggers: list[Logger] = field(default_factory=list)
    fabric: FabricLike | None = None
    record: Mapping[str, Any] | None = None
    feed: PromptFeed | None = None
    """Each iteration's prompts from `prompts` (the one the rollout stage reads too when it draws ahead); None: a
    feed of `prompts` of the trainer's own."""
    serving: GenerationService | None = None
    """On the split placement's generation rank (`async.generation_ranks`): what `fit` runs instead of the
    iterations, generating what the training rank asks."""


class RLHFTrainer:
    """The RLHF run, composed of objects: a training strategy, a generator, an inferencer, the algorithm, the
    callbacks and loggers, and the run's limits; `fit` takes the models and the data and runs it.

    Every part is optional: what is omitted is what `rlhfuse-train` would choose (its packaged configuration,
    `config`'s where given, and the rules that follow from the layout). The parts write their settings into one
    configuration that is validated as a whole before anything is built, so a run made here and the same run made
    by `rlhfuse-train` build the same objects and write the same metrics, progress, checkpoints and export::

        trainer = RLHFTrainer(
            strategy=FusedPipelineStrategy(actor_pp=2, critic_pp=2),
            generator=EngineGeneration(instances=2, migration=FixedMigration(threshold=0.25)),
            algorithm=AlgorithmConfig(name="grpo"),
            callbacks=[StopAt(10)],
            iterations=20,
            run_dir="runs/fused",
        )
        history = trainer.fit(train_dataset=my_prompts)
    """

    def __init__(
        self,
        *,
        strategy: StrategyPart | None = None,
        generator: GeneratorPart | None = None,
        inferencer: InferencerPart | None = None,
        algorithm: AlgorithmConfig | None = None,
        callbacks: Sequence[Callback] = (),
        loggers: Sequence[Logger] | None = None,
        iterations: int | None = None,
        data: DataConfig | None = None,
        checkpoint: CheckpointConfig | None = None,
        evaluation: EvalConfig | None = None,
        asynchronous: AsyncConfig | None = None,
        agent: AgentConfig | None = None,
        logging: LoggerConfig | None = None,
        seed: int | None = None,
        exact: bool | None = None,
        device: str | None = None,
        resume: str | None = None,
        run_dir: str | Path | None = None,
        config: RLHFConfig | None = None,
        log: Callable[[str], None] = print,
    ) -> None:
        check_callbacks(callbacks)  # before anything is built
        self.parts = Parts(strategy, generator, inferencer)
        self.base = config
        # the run's own settings, each replacing its section of the configuration where given
        sections = dict(
            algorithm=algorithm,
            iterations=iterations,
            data=data,
            checkpoint=checkpoint,
            eval=evaluation,
            asynchronous=asynchronous,
            agent=agent,
            logger=logging,
            seed=seed,
            exact=exact,
            device=device,
            resume=resume,
        )
        self.sections: dict[str, Any] = {key: value for key, value in sections.items() if value is not None}
        self.user_callbacks = list(callbacks)
        self.user_loggers = None if loggers is None else list(loggers)
        self.given_run_dir = run_dir
        # the start-up lines and the run's own lines: rank 0's (the other ranks of a launched job stay quiet)
        self.log = log if launched_rank_zero() else _quiet
        self.iteration = 0
        self.should_stop = False
        """Set by a callback (any hook): the run ends after the current iteration, checkpointed and exported as at
        its normal end."""
        self.stopped_by: str | None = None
        # this rank's extra memory during the last weight sync (`sync_weights`), for `MemoryMetrics`
        self.sync_extra_bytes = 0.0
        self.history: list[dict[str, float]] = []
        self.run: RunIdentity | None = None  # set by resume(); names the run in each checkpoint's meta.json
        self.ready = False
        self.serving: GenerationService | None = None

    @classmethod
    def from_config(
        cls,
        config: RLHFConfig,
        *,
        callbacks: Sequence[Callback] = (),
        run_dir: str | Path | None = None,
        log: Callable[[str], None] = print,
    ) -> RLHFTrainer:
        """The trainer `config` describes: its parts made from its sections (`Parts.from_config`), the objects a
        Python script would pass."""
        parts = Parts.from_config(config)
        return cls(
            strategy=parts.strategy,
            generator=parts.generator,
            inferencer=parts.inferencer,
            callbacks=callbacks,
            run_dir=run_dir,
            config=config,
            log=log,
        )

    @classmethod
    def assembled(cls, built: Assembled) -> RLHFTrainer:
        """A trainer over components built elsewhere (a test's own), ready to `fit`."""
        trainer = cls(config=built.config)
        trainer.attach(built)
        return trainer

    def configured(self, model: ModelChoice | None = None) -> RLHFConfig:
        """The one configuration of this run: the base (`config`, else the packaged defaults `rlhfuse-train`
        starts from) with every part's settings, the algorithm, the limits and the models written in (`model`: the
        models' settings, or the Actor's Hugging Face checkpoint folder, read with the base's other model keys)."""
        config = self.base if self.base is not None else RLHFConfig()  # = the packaged defaults (tested)
        config = self.parts.configure(dataclasses.replace(config, **self.sections))
        if isinstance(model, str | Path):
            model = dataclasses.replace(config.model, name="hf", sft_path=str(model))
        return config if model is None else dataclasses.replace(config, model=model)

    def setup(
        self,
        model: ModelChoice | None = None,
        *,
        train_dataset: Any = None,
        eval_dataset: Any = None,
    ) -> RLHFTrainer:
        """Check the whole run (one error listing every problem), then build it: the run folder, the data, the
        process group, the models, the components from the parts, the callbacks. `fit` calls it when needed."""
        if self.ready:
            raise RuntimeError(
                "RLHFTrainer.setup: this trainer is set up already; make a new one for another run"
            )
        # the composition of the build phases (it imports this module)
        from rlhfuse.trainer.build import assemble

        built = assemble(
            self.configured(model),
            self.parts,
            run_dir=self.given_run_dir,
            callbacks=self.user_callbacks,
            loggers=self.user_loggers,
            log=self.log,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
        )
        self.attach(built)
        return self

    def attach(self, built: Assembled) -> None:
        self.config = built.config
        # the resolved configuration run.json records and a resume is checked against (as validated, before the
        # tokenizer's stop ids were added)
        self.record = dict(built.record) if built.record is not None else config_record(built.config)
        self.generator, self.inferencer, self.strategy = built.generator, built.inferencer, built.strategy
        self.rollout_stage = built.rollout
        self.prompts = built.prompts
        self.feed = built.feed or PromptFeed(built.prompts, built.pad_token_id)
        self.pad_token_id = built.pad_token_id
        self.run_dir = Path(built.run_dir)
        self.callbacks = list(built.callbacks)
        self.loggers = list(built.loggers)
        self.fabric = built.fabric or LocalFabric()
        self.serving = built.serving
        self.ready = True

    # ---------------------------------------------------------------- hooks: the one dispatch
    def call(self, hook: str, *args: Any) -> None:
        """Call `hook` on every callback in order; the first that sets `should_stop` is named when the run ends."""
        for callback in self.callbacks:
            getattr(callback, hook)(self, *args)
            if self.should_stop and self.stopped_by is None:
                self.stopped_by = type(callback).__name__

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for logger in self.loggers:
            logger.log_metrics(metrics, step=step)

    def record_metrics(self, metrics: dict[str, float], step: int) -> None:
        """A row of the run's history, logged (an iteration's, or one a callback adds: eval.before_training)."""
        self.history.append(metrics)
        self.log_metrics(metrics, step=step)

    def finalize(self, status: str) -> None:
        for logger in self.loggers:
            logger.finalize(status)

    # ---------------------------------------------------------------- the loop
    def fit(
        self,
        model: ModelChoice | None = None,
        *,
        train_dataset: Any = None,
        eval_dataset: Any = None,
    ) -> list[dict[str, float]]:
        """Run the iterations (set up first if `setup` was not called: `model`, the datasets as `setup` takes
        them); the history of this run's metrics."""
        if not self.ready:
            self.setup(model, train_dataset=train_dataset, eval_dataset=eval_dataset)
        elif model is not None or train_dataset is not None or eval_dataset is not None:
            raise ValueError(
                "RLHFTrainer.fit: the trainer is set up already (build_trainer or setup() took the models and "
                "data); call fit() with no arguments"
            )
        if self.serving is not None:  # a generation rank of the split placement: no iteration of its own
            self.serving.serve()
            return self.history
        self.resume()
        self.call("on_fit_start")
        try:
            while self.iteration < self.config.iterations and not self.should_stop:
                self.run_iteration()
            if self.iteration < self.config.iterations:  # a callback stopped the run
                self.stop_early()
        except BaseException as err:
            self.call("on_exception", err)
            self.finalize("failed")
            self.end_run("failed", f"{type(err).__name__}: {err}")
            raise
        self.call("on_fit_end")
        self.finalize("success")
        self.end_run("completed")
        return self.history

    def stop_early(self) -> None:
        """A callback asked the run to stop: the line naming it, and the checkpoint a normal end would write
        (when checkpoints are on and this iteration's was not written already)."""
        self.log(
            f"rlhfuse: stopped after iteration {self.iteration} of {self.config.iterations} by callback "
            f"{self.stopped_by} (trainer.should_stop)"
        )
        if self.config.checkpoint.every > 0 and not self.checkpoint_due(self.iteration):
            self.save_checkpoint()

    def checkpoint_due(self, iteration: int) -> bool:
        """Whether `iteration` ends with a checkpoint: every `checkpoint.every`-th, and the last one."""
        every = self.config.checkpoint.every
        return every > 0 and (iteration % every == 0 or iteration == self.config.iterations)

    def end_run(self, status: Literal["completed", "failed"], reason: str | None = None) -> None:
        """run.json records how this attempt ended (rank 0; nothing when the run never started)."""
        if self.run is not None and self._rank0:
            end_run(self.run_dir, self.run.id, status, reason)

    def run_iteration(self) -> dict[str, float]:
        it = self.iteration + 1
        start = time.perf_counter()
        prompts = self.feed.batch(it)
        # 1. rollout: generation + inference (chunks of finished samples are inferred as they arrive)
        try:
            experience, rollout_stats = self.rollout_stage.run(prompts, it, self._on_stage)
        except NonFiniteRewardError as err:
            raise NonFiniteError(
                f"iteration {it}: reward/mean is {err.value}: {err}; stopped before training, no checkpoint "
                "written for this iteration"
            ) from None
        self.inferencer.release()  # frozen models back to host memory until the next rollout (or nothing)
        metrics: dict[str, float] = {}
        self.call("on_rollout_end", experience, metrics)
        # 2. rewards, KL penalty and the algorithm's advantages (GAE, or a group / batch baseline)
        batch, stats = compute_train_batch(
            experience, self.config.algorithm, max_new_tokens=self.config.generator.sampling.max_new_tokens
        )
        self._check_finite(it, stats)
        # 3. Actor (and Critic) updates over mini-batches x PPO epochs
        self._on_stage("training")
        t0 = time.perf_counter()
        train_stats = self.train(batch, it)
        training_s = time.perf_counter() - t0
        # 4. weight sync to the generator
        sync_s = self.sync_weights()
        # 5. callbacks, logging, checkpoint
        timings = {**rollout_stats.metrics(), "time/training": training_s, "time/weight_sync": sync_s}
        timings["time/iteration"] = time.perf_counter() - start
        metrics = {
            "iteration": it,
            **stats,
            **train_stats.metrics(),
            **self._loss_term_metrics(train_stats),
            **self._rollout_metrics(experience, timings),
            **staleness(experience, it - 1, self.config.asynchronous.max_staleness),
            # the most bytes any rank received for the sync (0: the copies were already in sync)
            "weight_sync/bytes_per_rank": self.strategy.weight_sync_bytes,
            **metrics,
        }
        self.call("on_metrics", metrics)  # last additions before logging (every rank calls it)
        self.iteration = it
        self.record_metrics(metrics, step=it)
        if self.checkpoint_due(it):
            self.save_checkpoint()
        self.feed.release(it)
        self.call("on_iteration_end", it, metrics)
        return metrics

    def sync_weights(self) -> float:
        """The trained Actor's weights into the generator, streamed in buckets (pipeline.weight_sync_bucket_mb);
        its seconds. `sync_extra_bytes`: the memory the sync took beside the resident models on this rank, the
        largest bucket of received, gathered or merged tensors (and on a GPU the allocator's peak over the whole
        sync, the generator's loading included, if more)."""
        device = self.fabric.device
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        start = time.perf_counter()
        buckets = self.strategy.actor_weight_buckets()
        self.generator.load_weight_buckets(buckets)
        if next(buckets, None) is not None:  # every rank reads every bucket: the stream's collectives run
            raise RuntimeError(f"{type(self.generator).__name__}.load_weight_buckets left buckets unread")
        seconds = time.perf_counter() - start
        self.sync_extra_bytes = self.strategy.weight_sync_extra_bytes
        if cuda:
            self.sync_extra_bytes = max(self.sync_extra_bytes, torch.cuda.max_memory_allocated(device) - base)
        return seconds

    def _on_stage(self, stage: str) -> None:
        self.call("on_stage_start", stage)

    def train(self, batch: TrainBatch, iteration: int) -> TrainStats:
        size = self.config.data.mini_batch_size
        # the attention mask copied to the host once an iteration: the steps split and lay out their
        # mini-batches from it, each reading the device once (its statistics)
        batch = batch.with_host_mask()
        steps: list[TrainStats] = []
        for epoch in range(self.config.algorithm.ppo_epochs):
            # Shuffle seeded by (seed, iteration, epoch): no RNG state to carry across a resume.
            rng = torch.Generator().manual_seed((self.config.seed * 1_000_003 + iteration) * 101 + epoch)
            order = torch.randperm(len(batch), generator=rng)
            for start in range(0, len(batch), size):
                try:
                    stats = self.strategy.train_step(batch.select(order[start : start + size]))
                except NonFiniteError as err:
                    raise NonFiniteError(
                        f"iteration {iteration}, PPO epoch {epoch + 1}: {err}; stopped before the optimizer step "
                        "(no checkpoint written for this iteration). Lower pipeline.actor_lr/critic_lr, "
                        "check the reward scale, or resume from the last checkpoint"
                    ) from None
                steps.append(stats)
        return mean_stats(steps)

    # ---------------------------------------------------------------- metrics
    def _loss_term_metrics(self, stats: TrainStats) -> dict[str, float]:
        """The optional loss terms before their coefficients, when the run has them: loss/kl (the KL as a loss
        term), loss/router_aux (a mixture-of-experts Actor's load-balancing loss); and the clip fraction by side
        when the clip range has its own high side (algorithm.clip_eps_high); the off-policy correction's weight
        and share of corrected tokens when one is on."""
        terms = {}
        if self.config.algorithm.kl_loss_coef > 0:
            terms["loss/kl"] = stats.loss.kl_loss
        if self.config.algorithm.clip_eps_high is not None:
            terms["policy/clip_fraction_low"] = stats.loss.clip_fraction_low
            terms["policy/clip_fraction_high"] = stats.loss.clip_fraction_high
        if self.config.pipeline.optim.router_aux_loss_coef > 0:
            terms["loss/router_aux"] = stats.loss.router_aux_loss
        if OFF_POLICY_CORRECTIONS[self.config.algorithm.off_policy_correction].corrects:
            terms["off_policy/is_weight_mean"] = stats.loss.is_weight_mean
            terms["off_policy/corrected_fraction"] = stats.loss.corrected_fraction
        return terms

    def _rollout_metrics(self, experience: Experience, timings: dict[str, float]) -> dict[str, float]:
        rollout = experience.rollout
        lengths_B = rollout.response_lengths_B.float()
        tokens = int(rollout.attention_mask_BT.sum())
        seconds = max(timings["time/iteration"], 1e-9)
        return {
            "response_length/mean": float(lengths_B.mean()),
            "response_length/p50": float(torch.quantile(lengths_B, 0.5)),
            "response_length/p99": float(torch.quantile(lengths_B, 0.99)),
            "response_length/max": float(lengths_B.max()),
            "response_length/clipped_fraction": float((~rollout.finished_B).float().mean()),
            **sampler_mismatch(experience),
            **episode_metrics(rollout),
            **timings,
            "throughput/samples_per_s": len(rollout) / seconds,
            "throughput/tokens_per_s": tokens / seconds,
        }

    @staticmethod
    def _check_finite(iteration: int, stats: dict[str, float]) -> None:
        for key, value in stats.items():
            if not torch.isfinite(torch.tensor(value)):
                raise NonFiniteError(
                    f"iteration {iteration}: {key} is {value} (non-finite reward, log-prob or value); stopped "
                    "before training, no checkpoint written for this iteration"
                )

    # ---------------------------------------------------------------- checkpoints
    @property
    def checkpoint_dir(self) -> Path:
        return self.run_dir / self.config.checkpoint.dir

    def trainer_state(self) -> dict[str, Any]:
        return {
            "iteration": self.iteration,
            "loader": self.feed.position(self.iteration),
            "rng": rng_state(),
            "rollout": self.rollout_stage.state_dict(),
        }

    def state_dict(self) -> dict[str, Any]:
        return {**self.strategy.state_dict(), "trainer": self.trainer_state()}

    def save_checkpoint(self) -> Path | None:
        """Every rank calls this; the strategy's checkpointer decides who writes what (the pipeline strategies:
        one shard per rank; otherwise the ranks hold the same state and rank 0 writes it, None elsewhere).
        Rank 0 then removes this run's checkpoints older than the newest `checkpoint.keep`."""
        extra = {"trainer": self.trainer_state()}
        run = self.run.id if self.run is not None else None
        path = self.strategy.checkpointer.save(self.checkpoint_dir, self.iteration, extra, run=run)
        if self._rank0:
            prune_run(self.checkpoint_dir, run, self.config.checkpoint.keep)
        return path

    @property
    def _rank0(self) -> bool:
        return self.fabric.global_rank == 0

    def resume(self) -> None:
        """Apply `config.resume`: never | auto (the run recorded in run_dir, if any: `resume_path`) | a
        checkpoint folder, after checking it against the recorded configuration (`check_resume_config`:
        refused when a key that may not change did, or `iterations` is not above the checkpoint's); then
        record the run and this attempt's configuration (rank 0), remove what interrupted saves left, and cut
        metrics.jsonl back to the iteration this attempt starts from. The strategy's `load_state_dict` applies
        the configured learning rates over the checkpoint's."""
        check = check_resume_config(self.config, self.run_dir, self.checkpoint_dir, self.record)
        if self._rank0:
            stale = clean_stale(self.checkpoint_dir)
            if stale:
                log.warning(
                    "rlhfuse: removed %s left by an interrupted save in %s",
                    ", ".join(stale),
                    self.checkpoint_dir,
                )
        path = check.path
        if path is not None:
            state = self.strategy.checkpointer.load(path)
            if "trainer" not in state:
                raise CheckpointError(
                    f"{path} holds no 'trainer' entry (iteration, data position, RNG states) in its state file: "
                    "it was not written by rlhfuse-train; pass a folder written by checkpoint.every=N"
                )
            trainer_state = state["trainer"]
            self.prompts.load_state_dict(trainer_state["loader"])
            set_rng_state(trainer_state["rng"])
            self.iteration = int(trainer_state["iteration"])
            self.sync_weights()
            self.rollout_stage.restore(trainer_state.get("rollout", {}), self.iteration)
        self.feed.start_at(self.iteration)
        if self._rank0:
            digest = config_hash(self.config)
            previous = read_runs(self.run_dir)
            auto = self.config.resume == "auto"
            self.run = begin_run(self.run_dir, digest, path, self.iteration, auto=auto, config=self.record)
            warning = check.warning()
            if warning is not None:
                log.warning("%s", warning)
            elif not check.recorded and previous and previous[0].id == self.run.id:
                if previous[0].config_hash != digest:  # a run recorded before run.json held its configuration
                    log.warning(
                        "rlhfuse: resuming run %s with a changed configuration (hash %s, recorded %s)",
                        self.run.id,
                        digest,
                        previous[0].config_hash,
                    )
        rewind_loggers(self.loggers, self.iteration)
