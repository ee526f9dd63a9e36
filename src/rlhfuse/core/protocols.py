"""The plug points of `RLHFTrainer`: small Protocols, implemented by composition (a variant is a new class).

Single-process implementations ship in this package (`SamplingGenerator`, `ModelInferencer`, `PlainStrategy`);
the fused variants of the paper (a multi-instance generator with sample migration, a fused Actor+Critic
pipeline strategy) implement the same Protocols.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # annotations only: a `Callback` subclass (the command line's) needs no torch
    import torch
    from torch import Tensor

    from rlhfuse.core.sampling import Sampling
    from rlhfuse.core.stats import GenerationStats, RolloutStats, TrainStats
    from rlhfuse.core.types import Experience, FrozenInference, PromptBatch, Rollout, TrainBatch


@runtime_checkable
class Generator(Protocol):
    """Generation stage: samples responses with its own copy of the Actor weights."""

    def generate(
        self, prompts: PromptBatch, *, iteration: int, sampling: Sampling | None = None
    ) -> Iterator[Rollout]:
        """Yield the rollout in one or more chunks of finished samples (a streaming generator lets inference
        start on early-finished samples; the trainer concatenates the chunks). `sampling`: this call's settings
        in place of the generator's own (held-out evaluation)."""
        ...

    def load_weights(self, named_tensors: Mapping[str, Tensor]) -> None:
        """Weight sync: replace the generator's Actor weights by the trained ones (all of them, or the part that
        changed: a LoRA Actor's merged projections)."""
        ...

    def load_weight_buckets(self, buckets: Iterable[Mapping[str, Tensor]]) -> None:
        """The weight sync streamed (`Strategy.actor_weight_buckets`): load each bucket as it comes, ask for the
        next only once done with it (its memory may then be freed), and consume every bucket (the stream's
        collectives run as it is read). The effect is `load_weights` of their union."""
        ...

    def generation_stats(self) -> GenerationStats | None:
        """What the last `generate` measured (migration, decode batch sizes, tokens/s); None for a generator
        that measures nothing beyond the stage's own timings. With one instance per rank, every rank calls it."""
        ...

    def actor_copies(self) -> Sequence[torch.nn.Module]:
        """The Actor copies this process generates with, kept in sync by `load_weights` (counted in
        `memory/param_bytes`; exported when the trained Actor is sharded). Empty where the weights live outside
        this process's modules (vLLM's engine)."""
        ...

    def close(self) -> None:
        """Release what outlives the generator's modules (vLLM's engine processes) before the process group is
        torn down; `rlhfuse-train` calls it after `fit()`. Nothing to do for in-process generators."""
        ...


@runtime_checkable
class FusingGenerator(Generator, Protocol):
    """A generator that fuses inference into generation (inter-stage fusion across processes: the long tail
    migrates and freed instances start inference while it finishes)."""

    def fused_rollout(
        self,
        prompts: PromptBatch,
        *,
        iteration: int,
        inferencer: Inferencer,
        sampling: Sampling | None = None,
    ) -> tuple[Experience, RolloutStats]: ...


class OpenBatch(Protocol):
    """One rollout whose batch stays open (`OpeningGenerator.open_rollout`): prompts join while it decodes, and
    each prompt group leaves as soon as its last sample has finished."""

    @property
    def groups_open(self) -> int:
        """Prompt groups added whose samples have not all finished."""
        ...

    def add(self, prompts: PromptBatch) -> None:
        """Start decoding `prompts`' samples beside those already decoding (groups numbered on, in order)."""
        ...

    def finished(self) -> tuple[list[int], Rollout] | None:
        """Decode until at least one prompt group is complete: (their numbers, their samples, a group's rows
        together); None when nothing is decoding."""
        ...

    def step(self) -> tuple[list[int], Rollout] | None:
        """One decode step: the prompt groups it completed, as `finished` gives them (None: none)."""
        ...

    def close(self) -> int:
        """Drop whatever still decodes: the tokens it had generated."""
        ...


@runtime_checkable
class OpeningGenerator(Generator, Protocol):
    """A generator whose rollout can stay open while it decodes (dynamic sampling inside the rollout:
    `rlhfuse.trainer.rollout.StreamedDynamicSampling`)."""

    def open_rollout(
        self, *, iteration: int, capacity: int, prompt_width: int, sampling: Sampling | None = None
    ) -> OpenBatch:
        """An empty open rollout sized for `capacity` samples at once, prompts up to `prompt_width` tokens;
        `sampling`: the call's own (as `generate` takes it), else the run's."""
        ...


@runtime_checkable
class Inferencer(Protocol):
    """Inference stage: Actor/Ref log-probs, reward scores and Critic values for generated samples."""

    def infer(self, rollout: Rollout) -> Experience: ...

    def prefetch(self) -> None:
        """The generation tail starts: frozen models kept in host memory start moving onto the device (the copy
        overlaps with decoding); nothing for an inferencer whose models stay where they are."""
        ...

    def release(self) -> None:
        """After the rollout's last inference: frozen models back to host memory (or nothing)."""
        ...


@runtime_checkable
class SplitInferencer(Inferencer, Protocol):
    """An inferencer whose frozen models (Ref, Reward) can run apart from its live ones (Actor, Critic): the split
    placement's generation rank runs `infer_frozen` on each batch it generates (async.frozen_inference=
    generation_ranks) and the training rank `infer_live` with what it sent. `infer_live(r, infer_frozen(r))` is
    `infer(r)`, bit for bit."""

    def infer_frozen(self, rollout: Rollout) -> FrozenInference:
        """The Ref log-probs and the scores of `rollout`; the Actor and the Critic do not run."""
        ...

    def infer_live(self, rollout: Rollout, frozen: FrozenInference) -> Experience:
        """`rollout`'s Experience: the Actor's log-probs and the Critic's values computed here, `frozen` the rest."""
        ...


StageHook = Callable[[str], None]
"""Told the name of each sub-stage as it starts ("generation", "inference"), e.g. to show progress."""


@runtime_checkable
class Scorer(Protocol):
    """An inferencer that can run its reward stage alone (`rlhfuse.trainer.strategies.plain.ModelInferencer`):
    dynamic sampling inside the rollout decides on each prompt group from its scores and infers (Actor, Ref,
    Critic) only the groups it keeps. An inferencer without it is asked `infer` for the scores."""

    def score(self, rollout: Rollout) -> Tensor:
        """float32 [B]: each sample's sequence score, as `infer` gives it (`Experience.scores_B`)."""
        ...


@runtime_checkable
class RolloutStage(Protocol):
    """Step 1 of an iteration: generation + inference, from prompts to the Experience that training consumes.
    Chosen once when the trainer is built: `SerialRollout` (generate, then infer each streamed chunk),
    `FusedRollout` (generation fused with inference across instances), `AsyncRollout` (generation ahead of
    training, `rlhfuse.trainer.asynchronous`)."""

    def run(
        self,
        prompts: PromptBatch,
        iteration: int,
        on_stage: StageHook | None = None,
        sampling: Sampling | None = None,
    ) -> tuple[Experience, RolloutStats]:
        """`sampling`: the generator's settings for this rollout only (held-out evaluation)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint after the trained iteration keeps of the stage: the work it holds beyond that
        iteration (an asynchronous stage's batches generated ahead); empty for a stage that holds none."""
        ...

    def restore(self, state: Mapping[str, Any], iteration: int) -> None:
        """A resume from the checkpoint of iteration `iteration` (after its weight sync): `state_dict()`'s state,
        empty from a checkpoint written without one."""
        ...


@runtime_checkable
class Checkpointer(Protocol):
    """Writes and reads a strategy's checkpoints. Every rank calls both, the same way for every strategy: the
    single-process format is written by rank 0 alone (`rlhfuse.core.checkpoint.PlainCheckpointer`), the
    pipeline strategies' sharded one by every rank (`rlhfuse.trainer.strategies.pipelines.checkpoint.ShardedCheckpointer`)."""

    def save(
        self,
        directory: str | Path,
        iteration: int,
        extra: Mapping[str, Any],
        *,
        keep: int = 0,
        run: str | None = None,
    ) -> Path | None:
        """Save the strategy's state plus `extra` (the trainer's state) as `directory/iter_<iteration>`, its
        meta.json naming `run` (the writing run's id), keeping the `keep` most recent checkpoints of that run
        (0 = all); returns the folder (None on a rank that wrote nothing)."""
        ...

    def load(self, path: str | Path) -> dict[str, Any]:
        """Restore the strategy from the checkpoint folder `path`; returns the saved state, `extra` included."""
        ...


@runtime_checkable
class Strategy(Protocol):
    """Training stage: owns the Actor and the Critic, their optimizers and LR schedules, and their update step."""

    def train_step(self, batch: TrainBatch) -> TrainStats:
        """One optimizer step of the Actor and the Critic on one mini-batch; returns its statistics."""
        ...

    def actor_weights(self) -> Mapping[str, Tensor]:
        """The Actor's current weights, all at once (`actor_weight_buckets` joined)."""
        ...

    def actor_weight_buckets(self) -> Iterator[Mapping[str, Tensor]]:
        """The weight sync to the generator: `actor_weights()`'s tensors in buckets of whole tensors of at most
        pipeline.weight_sync_bucket_mb (a larger one alone), each produced (gathered, resharded or merged) when
        it is asked for. Collective where the strategy's layout is: every rank consumes every bucket, in order.
        `weight_sync_bytes` and `weight_sync_extra_bytes` are final once the last one is consumed."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: model weights, optimizer and scheduler states."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict()`; the configured peak learning rates replace the checkpoint's
        (`rlhfuse.core.optim.set_peak_lr`: a resume may change them)."""
        ...

    def optimizers_in_use(self) -> Sequence[torch.optim.Optimizer]:
        """The optimizers this rank steps (a pipeline: those of its own stages), for `memory/optimizer_bytes`."""
        ...

    weight_sync_bytes: float
    """The most bytes any rank received in the last `actor_weights()` (0: nothing moved, e.g. one process)."""

    weight_sync_extra_bytes: float
    """The most bytes one bucket of the last sync allocated on this rank (received buffers, gathered or merged
    tensors; 0: the Actor's own tensors handed on as they are), held until the generator has loaded it."""

    @property
    def checkpointer(self) -> Checkpointer:
        """How this strategy's checkpoints are written and read."""
        ...


class Callback:
    """The hooks `RLHFTrainer` calls, in this order over a run, on every callback it holds (a subclass
    overrides the ones it needs; the others do nothing). `trainer` is the `RLHFTrainer`."""

    def on_fit_start(self, trainer: Any) -> None:
        """Before the first iteration (after a resume restored the state)."""

    def on_stage_start(self, trainer: Any, stage: str) -> None:
        """A stage of the iteration begins (generation, inference, training, ...)."""

    def on_rollout_end(self, trainer: Any, experience: Experience, metrics: dict[str, float]) -> None:
        """After inference; a callback may add evaluation metrics to `metrics` (they are logged)."""

    def on_metrics(self, trainer: Any, metrics: dict[str, float]) -> None:
        """The iteration's metrics before they are logged: the last additions (every rank calls it)."""

    def on_iteration_end(self, trainer: Any, iteration: int, metrics: Mapping[str, float]) -> None:
        """After the iteration's metrics are logged and its checkpoint, if any, is written."""

    def on_fit_end(self, trainer: Any) -> None:
        """After the last iteration of a successful fit."""

    def on_exception(self, trainer: Any, error: BaseException) -> None:
        """When fit stops with an error (the error is re-raised afterwards)."""


class FabricLike(Protocol):
    """This process's place in the run and its precision, as the trainer and the strategies ask them: Lightning
    Fabric's shape (`lightning.fabric.Fabric` has it; runs of several processes use one, launched), which
    `rlhfuse.runtime.local.LocalFabric` also has for a run of one process without importing Lightning."""

    @property
    def device(self) -> torch.device: ...

    @property
    def global_rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def is_global_zero(self) -> bool: ...

    def autocast(self) -> AbstractContextManager[Any]:
        """The forward passes' precision context (autocast under a mixed precision, nothing under 32-true)."""
        ...

    def backward(self, tensor: Tensor, *args: Any, **kwargs: Any) -> None: ...

    def seed_everything(
        self, seed: int | None = None, workers: bool = False, verbose: bool = True
    ) -> int: ...


@runtime_checkable
class Logger(Protocol):
    """Metrics sink. Lightning Fabric's loggers (CSVLogger, TensorBoardLogger) and Lightning's WandbLogger
    already have this shape."""

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None: ...

    def log_hyperparams(self, params: Any) -> None: ...

    def finalize(self, status: str) -> None: ...
