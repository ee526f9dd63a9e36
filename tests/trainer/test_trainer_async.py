"""Asynchronous RL with bounded staleness (`async.max_staleness`, `rlhfuse.trainer.asynchronous`): the gates make
iteration i's samples come from version max(0, i-1-k) exactly, so the machinery at staleness 0 equals the
synchronous run bit for bit, a staleness-1 run trains no token older than one version and repeats itself bit for
bit whatever the threads' timing, a resume of a run stopped with batches generated ahead equals the uninterrupted
run, and a failing background generation ends the run in one line."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import pytest
import torch

from rlhfuse.data.feed import PromptFeed
from rlhfuse.data.prompts import Prompt, PromptLoader
from rlhfuse.trainer import (
    AlgorithmConfig,
    AsyncConfig,
    AsyncRollout,
    Callback,
    CheckpointConfig,
    DataConfig,
    EngineGeneration,
    FixedMigration,
    LoggerConfig,
    ModelsConfig,
    RLHFTrainer,
    Rollout,
    SamplingConfig,
    SamplingGeneration,
    WarmStartConfig,
    compose_config,
)
from rlhfuse.trainer.asynchronous import AsyncGenerationError
from rlhfuse.trainer.validate import cross_component_problems

ITERATIONS = 4


def _model(cache: Path) -> ModelsConfig:
    warm = WarmStartConfig(
        sft_examples=256, sft_steps=10, rm_pairs=256, rm_steps=10, batch_size=16, cache_dir=str(cache)
    )
    return ModelsConfig(
        hidden_size=32, intermediate_size=64, num_layers=1, num_heads=1, num_kv_heads=1, warmstart=warm
    )


class Versions(Callback):
    """Keeps each iteration's response-token versions (their ages at training: trained version - token's)."""

    def __init__(self) -> None:
        self.ages: dict[int, torch.Tensor] = {}

    def on_rollout_end(self, trainer: Any, experience: Any, metrics: dict[str, float]) -> None:
        rollout = experience.rollout
        it = trainer.iteration + 1
        if rollout.versions_BR is not None:
            self.ages[it] = (it - 1) - rollout.versions_BR[rollout.response_mask_BR.bool()]


class StopAt(Callback):
    def __init__(self, iteration: int) -> None:
        self.iteration = iteration

    def on_iteration_end(self, trainer: Any, iteration: int, metrics: dict[str, float]) -> None:
        if iteration >= self.iteration:
            trainer.should_stop = True


SMALL = DataConfig(
    num_prompts=16, prompts_per_iteration=2, samples_per_prompt=2, mini_batch_size=4, micro_batch_size=2
)
# a batch whose tail migrates: 16 samples, Rt = 12 of them
WIDE = DataConfig(
    num_prompts=16, prompts_per_iteration=4, samples_per_prompt=4, mini_batch_size=16, micro_batch_size=4
)

GENERATORS = {
    "sampling": lambda: SamplingGeneration(sampling=SamplingConfig(max_new_tokens=12)),
    "engine": lambda: EngineGeneration(sampling=SamplingConfig(max_new_tokens=12)),
    # two instances in this process, the tail migrating between them (a migrated sample keeps its versions)
    "engine_migrating": lambda: EngineGeneration(
        # frequent word tokens as stop tokens: long-tailed lengths (the tiny model rarely emits EOS)
        sampling=SamplingConfig(max_new_tokens=24, stop_token_ids=[10, 20, 30, 40, 50]),
        instances=2,
        in_process=True,
        migration=FixedMigration(threshold=0.75),
    ),
}


def _trainer(
    run_dir: Path,
    *,
    staleness: int,
    callbacks: list[Callback] = (),
    partial: bool = False,
    generator: str = "sampling",
    generation_ranks: int = 0,
    frozen_inference: Literal["training_ranks", "generation_ranks"] = "training_ranks",
    **kwargs: Any,
) -> RLHFTrainer:
    return RLHFTrainer(
        generator=GENERATORS[generator](),
        algorithm=AlgorithmConfig(off_policy_correction="none"),
        asynchronous=AsyncConfig(
            max_staleness=staleness, partial_rollout=partial, generation_ranks=generation_ranks,
            frozen_inference=frozen_inference,
        ),
        data=kwargs.pop("data", SMALL),
        logging=LoggerConfig(backends=["jsonl"], progress=False, print_every=0),
        iterations=ITERATIONS,
        callbacks=list(callbacks),
        run_dir=run_dir,
        log=lambda _: None,
        **kwargs,
    )  # fmt: skip


def _actor(trainer: RLHFTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.strategy.actor_weights().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_machinery_at_staleness_0_equals_the_synchronous_run_bit_for_bit(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    serial = _trainer(tmp_path / "serial", staleness=0)
    serial.fit(_model(cache))
    gated = _trainer(tmp_path / "gated", staleness=0).setup(_model(cache))
    # the asynchronous stage with a bound of 0 (the configuration builds the serial stage for 0)
    stage = AsyncRollout(
        gated.generator, gated.inferencer, gated.feed, max_staleness=0, last_iteration=ITERATIONS,
        pad_token_id=gated.pad_token_id,
    )  # fmt: skip
    gated.rollout_stage, gated.generator = stage, stage.generator
    history = gated.fit()
    assert [row["async/staleness_max"] for row in history] == [0.0] * ITERATIONS
    assert _same(_actor(serial), _actor(gated))
    assert [r["reward/mean"] for r in serial.history] == [r["reward/mean"] for r in history]


def test_staleness_1_trains_no_token_older_than_one_version_and_repeats_bit_for_bit(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    runs = []
    for name in ("a", "b"):
        versions = Versions()
        trainer = _trainer(tmp_path / name, staleness=1, callbacks=[versions])
        history = trainer.fit(_model(cache))
        runs.append((trainer, versions, history))
    (a, versions, history), (b, _, _) = runs
    assert _same(_actor(a), _actor(b))  # the gates, not the threads' timing, decide every sample's version
    # iteration 1 from version 0 (nothing older exists), every later one exactly one version behind
    assert [int(versions.ages[i].max()) for i in range(1, ITERATIONS + 1)] == [0, 1, 1, 1]
    assert all(int(versions.ages[i].min()) == (0 if i == 1 else 1) for i in versions.ages)
    assert [row["async/staleness_1"] for row in history] == [0.0, 1.0, 1.0, 1.0]
    assert all(row["async/wait_s"] >= 0 for row in history)
    # not the synchronous run: iteration 2 trained on samples of version 0
    sync = _trainer(tmp_path / "sync", staleness=0)
    sync.fit(_model(cache))
    assert not _same(_actor(a), _actor(sync))


def test_a_resume_with_batches_generated_ahead_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    straight = _trainer(tmp_path / "straight", staleness=1)
    straight.fit(_model(cache))
    run = tmp_path / "stopped"
    first = _trainer(run, staleness=1, callbacks=[StopAt(2)], checkpoint=CheckpointConfig(every=10))
    first.fit(_model(cache))
    assert first.iteration == 2
    state = torch.load(run / "checkpoints" / "iter_00000002" / "state.pt", weights_only=False)
    ready = state["trainer"]["rollout"]["ready"]
    assert list(ready) == ["3"] and ready["3"]["version"] == 1  # batch 3, generated by version 1 ahead
    resumed = _trainer(run, staleness=1, resume="auto", checkpoint=CheckpointConfig(every=10))
    history = resumed.fit(_model(cache))
    assert [row["iteration"] for row in history] == [3, 4]
    assert _same(_actor(straight), _actor(resumed))


@pytest.mark.parametrize("generator", list(GENERATORS))
def test_a_partial_rollout_continues_its_samples_under_the_next_version(
    tmp_path: Path, generator: str
) -> None:
    """A sync while a batch is being generated: its samples go on under the new weights from the next decode step,
    their KV cache kept, and their later tokens record the new version. The sync happens at the third step (events,
    not timing); the weights loaded are the same, so the tokens equal an uninterrupted generation's."""
    data = WIDE if generator == "engine_migrating" else SMALL
    trainer = _trainer(tmp_path / "run", staleness=1, partial=True, generator=generator, data=data)
    trainer.setup(_model(tmp_path / "cache"))
    stage = trainer.rollout_stage
    assert isinstance(stage, AsyncRollout) and stage.partial_rollout
    prompts = trainer.feed.batch(1)
    expected = Rollout.cat(list(stage.inner.generate(prompts, iteration=1)), trainer.pad_token_id)
    mid, go = threading.Event(), threading.Event()
    steps = 0
    gate = stage.step

    @contextlib.contextmanager
    def step() -> Iterator[int]:
        nonlocal steps
        steps += 1
        if steps == 3:  # the worker, between two decode steps of batch 1
            mid.set()
            go.wait()
        with gate() as version:
            yield version

    stage.step = step  # type: ignore[method-assign]

    def sync() -> None:
        mid.wait()
        trainer.sync_weights()  # does not wait for batch 1: loads between its steps
        go.set()

    syncing = threading.Thread(target=sync)
    syncing.start()
    experience, stats = stage.run(prompts, 1)
    syncing.join()
    if generator == "engine_migrating":
        assert stats.generation is not None and stats.generation.samples_moved > 0
    rollout = experience.rollout
    assert torch.equal(rollout.response_ids_BR, expected.response_ids_BR)
    assert rollout.versions_BR is not None
    mask_BR = rollout.response_mask_BR.bool()
    rows = [set(rollout.versions_BR[b][mask_BR[b]].tolist()) for b in range(len(rollout))]
    assert any(row == {0, 1} for row in rows)  # continued samples carry two versions
    assert all(row <= {0, 1} for row in rows)
    assert torch.all(rollout.versions_BR[:, 1:] >= rollout.versions_BR[:, :-1] * mask_BR[:, 1:])  # in order


def test_a_partial_asynchronous_run_trains_no_token_older_than_the_bound(tmp_path: Path) -> None:
    versions = Versions()
    history = _trainer(tmp_path / "run", staleness=1, partial=True, callbacks=[versions]).fit(
        _model(tmp_path / "cache")
    )
    assert len(history) == ITERATIONS
    assert all(0 <= int(versions.ages[i].min()) and int(versions.ages[i].max()) <= 1 for i in versions.ages)


class Wrapped:
    """A generator over the given one (weights, statistics, copies delegated), generating through `generate`
    only (no `generate_partial`: the stage sees no decode steps)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def generate(self, prompts: Any, *, iteration: int, sampling: Any = None) -> Iterator[Any]:
        yield from self.inner.generate(prompts, iteration=iteration, sampling=sampling)

    def load_weights(self, named_tensors: Any) -> None:
        self.inner.load_weights(named_tensors)

    def load_weight_buckets(self, buckets: Any) -> None:
        self.inner.load_weight_buckets(buckets)

    def generation_stats(self) -> Any:
        return self.inner.generation_stats()

    def actor_copies(self) -> Any:
        return self.inner.actor_copies()

    def close(self) -> None:
        self.inner.close()


class FailingGenerator(Wrapped):
    """Raises on iteration `at`."""

    def __init__(self, inner: Any, at: int) -> None:
        super().__init__(inner)
        self.at = at

    def generate(self, prompts: Any, *, iteration: int, sampling: Any = None) -> Iterator[Any]:
        if iteration == self.at:
            raise OSError("device lost")
        yield from super().generate(prompts, iteration=iteration, sampling=sampling)


def test_a_failing_background_generation_ends_the_run_in_one_line(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path / "run", staleness=1).setup(_model(tmp_path / "cache"))
    stage = trainer.rollout_stage
    assert isinstance(stage, AsyncRollout)
    stage.inner = FailingGenerator(stage.inner, at=3)
    with pytest.raises(AsyncGenerationError, match=r"^asynchronous generation of iteration 3's batch failed: "
                       r"OSError: device lost$"):  # fmt: skip
        trainer.fit()
    assert trainer.iteration in (1, 2)  # the failure surfaces at the sync or the rollout that waits for it


class StallingGenerator(Wrapped):
    """On iteration `at`, waits until `release` is set."""

    def __init__(self, inner: Any, at: int) -> None:
        super().__init__(inner)
        self.at, self.release = at, threading.Event()

    def generate(self, prompts: Any, *, iteration: int, sampling: Any = None) -> Iterator[Any]:
        if iteration == self.at:
            self.release.wait()
        yield from super().generate(prompts, iteration=iteration, sampling=sampling)


def test_a_stalled_background_generation_ends_the_run_in_one_line(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path / "run", staleness=1).setup(_model(tmp_path / "cache"))
    stage = trainer.rollout_stage
    assert isinstance(stage, AsyncRollout) and stage.stall_timeout_s == 300  # distributed.timeout_s
    stalling = StallingGenerator(stage.inner, at=2)
    stage.inner, stage.stall_timeout_s = stalling, 0.5
    try:
        with pytest.raises(AsyncGenerationError, match=r"^asynchronous generation of iteration 2's batch made no "
                           r"progress for \d+ s \(distributed.timeout_s=0.5\): the generator stalled"):  # fmt: skip
            trainer.fit()
    finally:
        stalling.release.set()
        stage.close()


def test_async_runs_are_checked_before_anything_is_built() -> None:
    assert "async.max_staleness=-1 must be >= 0" in " ".join(
        compose_config(["async.max_staleness=-1"]).problems()
    )
    two = compose_config(["async.max_staleness=1", "generator=engine", "generator.instances=2"])
    assert any("async.max_staleness=1 runs generation ahead in a background thread of one process" in p
               for p in cross_component_problems(two))  # fmt: skip
    dynamic = compose_config(["async.max_staleness=1", "data.oversample=2"])
    assert any(
        "set data.oversample=0 or async.max_staleness=0" in p for p in cross_component_problems(dynamic)
    )
    assert "set async.max_staleness >= 1" in " ".join(
        compose_config(["async.partial_rollout=true"]).problems()
    )
    engine = compose_config(["async.max_staleness=1", "async.partial_rollout=true", "generator=engine"])
    assert not cross_component_problems(engine)


def test_the_off_policy_correction_is_on_by_default_once_samples_can_be_off_policy() -> None:
    from rlhfuse.trainer.run_config import resolve_components

    lines: list[str] = []
    ahead = resolve_components(compose_config(["async.max_staleness=2"]), log=lines.append)
    assert ahead.algorithm.off_policy_correction == "tis"
    assert any("algorithm.off_policy_correction=auto -> tis" in line for line in lines)
    assert resolve_components(compose_config([]), log=lines.append).algorithm.off_policy_correction == "none"
    chosen = compose_config(["async.max_staleness=2", "algorithm.off_policy_correction=none"])
    assert resolve_components(chosen, log=lines.append).algorithm.off_policy_correction == "none"


def test_the_feed_draws_each_iteration_once_in_order_and_records_the_position_after_it() -> None:
    prompts = [Prompt(id=i, text=str(i), token_ids=(5 + i,)) for i in range(6)]
    loader = PromptLoader(prompts, 2, seed=0)
    feed = PromptFeed(loader, pad_token_id=0)
    third = feed.batch(3)  # drawn ahead: 1 and 2 first
    assert feed.drawn() == 3 and loader.state_dict() == {"epoch": 0, "offset": 6}
    assert feed.batch(3) is third
    assert feed.position(1) == {"epoch": 0, "offset": 2}  # a checkpoint after 1 redraws 2 and 3 on resume
    feed.release(1)
    with pytest.raises(KeyError, match="released"):
        feed.batch(1)
    again = PromptLoader(prompts, 2, seed=0)
    again.load_state_dict(feed.position(1))
    resumed = PromptFeed(again, pad_token_id=0)
    resumed.start_at(1)
    assert torch.equal(resumed.batch(3).prompt_ids_B, third.prompt_ids_B)
