"""Dynamic sampling (`data.oversample`): `DynamicSampling`'s rounds over a scripted stage (which groups are kept, what
each round generates, the extra tokens, a prompt a candidate once, running out of prompts), `StreamedDynamicSampling`
inside an open rollout on a scripted clock (a dropped group replaced at once, what still decodes dropped once the
batch is full), and end to end on `experiment=arithmetic` with 2 generation instances and migration (in one process and
over 2): every trained batch holds exactly data.prompts_per_iteration groups whose rewards differ, read back from
the samples table; the DAPO recipe; a bit-identical resume."""

from __future__ import annotations

import importlib.util
import json
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from rlhfuse.core.stats import RolloutStats
from rlhfuse.core.types import Experience, PromptBatch, Rollout
from rlhfuse.trainer import build_trainer, compose_config, validate
from rlhfuse.trainer.rollout import DynamicSampling, DynamicSamplingError, StreamedDynamicSampling

N = 3  # samples per prompt


class ScriptedStage:
    """A rollout stage whose scores are scripted per prompt id: `varied` ids get scores 0, 1, 0, ..., the others
    all 1; sample i of prompt p has p + i response tokens (so every row's length says who it is)."""

    def __init__(self, varied: set[int], device: torch.device | str = "cpu") -> None:
        self.varied, self.device = varied, device
        self.calls: list[list[int]] = []

    def run(self, prompts, iteration, on_stage=None, sampling=None):
        ids = prompts.prompt_ids_B.tolist()
        self.calls.append(ids)
        rows = [(p, i) for p in ids for i in range(N)]
        width = max(p + i for p, i in rows)
        lengths_B = torch.tensor([p + i for p, i in rows])
        rollout = Rollout(
            prompt_ids_BP=prompts.input_ids_BP.repeat_interleave(N, dim=0),
            prompt_mask_BP=prompts.attention_mask_BP.repeat_interleave(N, dim=0),
            response_ids_BR=torch.ones(len(rows), width, dtype=torch.long),
            response_mask_BR=(torch.arange(width)[None, :] < lengths_B[:, None]).long(),
            prompt_index_B=torch.tensor([p for p, _ in rows]),
            sample_index_B=torch.tensor([i for _, i in rows]),
            finished_B=torch.ones(len(rows), dtype=torch.bool),
        )
        scores_B = torch.tensor([float(i % 2) if p in self.varied else 1.0 for p, i in rows])
        zeros = torch.zeros(len(rows), width)
        experience = Experience(rollout, zeros, zeros, zeros, scores_B).to(self.device)
        return experience, RolloutStats(1.0, 0.5, 2.0)


def _prompts(ids: list[int]) -> PromptBatch:
    lengths = [1 + p % 3 for p in ids]  # left-padded prompts of varied lengths
    width = max(lengths)
    mask = torch.tensor([[0] * (width - n) + [1] * n for n in lengths])
    return PromptBatch(mask * 7, mask, torch.tensor(ids))


class Loader:
    """The training data's next prompts, in a scripted order (repeats included); counts what was drawn."""

    def __init__(self, order: list[int]) -> None:
        self.order, self.drawn = order, []

    def __call__(self, count: int) -> PromptBatch:
        ids, self.order = self.order[:count], self.order[count:]
        self.drawn.append(ids)
        return _prompts(ids)


def _sampling(stage, loader, groups, oversample=1.0, limit=100):
    return DynamicSampling(stage, groups, oversample=oversample, draw=loader, limit=limit, pad_token_id=0)


def test_rounds_refill_exactly_the_dropped_groups_and_keep_candidate_order():
    stage, loader = ScriptedStage(varied={12, 14, 15, 17, 19}), Loader([15, 16, 17, 18, 19, 20])
    experience, stats = _sampling(stage, loader, groups=4).run(_prompts([11, 12, 13, 14]), iteration=1)
    # round 1: the iteration's own 11-14 (12, 14 kept); round 2: the 2 missing, 15-16 (15 kept); round 3: 17
    assert stage.calls == [[11, 12, 13, 14], [15, 16], [17]] and loader.drawn == [[15, 16], [17]]
    assert experience.rollout.prompt_index_B.tolist() == [p for p in (12, 14, 15, 17) for _ in range(N)]
    assert experience.rollout.sample_index_B.tolist() == list(range(N)) * 4
    # dropped: 11, 13, 16, each with p + 0 + p + 1 + p + 2 tokens
    assert stats.sampling is not None
    assert stats.sampling.metrics() == {
        "rollout/groups_sampled": 7.0,
        "rollout/groups_dropped": 3.0,
        "rollout/extra_tokens": float(sum(3 * p + 3 for p in (11, 13, 16))),
        "rollout/sampling_rounds": 3.0,
    }
    assert (stats.generation_s, stats.inference_s, stats.generation_inference_s) == (3.0, 1.5, 6.0)
    # the kept rows are whole: each keeps its own response length
    assert experience.rollout.response_lengths_B.tolist() == [
        p + i for p in (12, 14, 15, 17) for i in range(N)
    ]


def test_the_rounds_keep_to_the_experience_device():
    """On the stand-in device (a CPU tensor mixed into its work raises, as on a GPU): the CPU's groups."""
    from rlhfuse.testing.standin import standin_device

    device = standin_device()
    stage = ScriptedStage(varied={12, 14, 15, 17, 19}, device=device)
    loader = Loader([15, 16, 17, 18, 19, 20])
    experience, stats = _sampling(stage, loader, groups=4).run(_prompts([11, 12, 13, 14]), iteration=1)
    assert experience.scores_B.device == device
    assert experience.rollout.prompt_index_B.cpu().tolist() == [p for p in (12, 14, 15, 17) for _ in range(N)]
    assert stats.sampling is not None and stats.sampling.groups_dropped == 3


def test_oversampling_generates_more_per_round_and_counts_the_surplus():
    # 2 groups asked for, factor 1.5: ceil(3) candidates, the iteration's 1, 2 and one drawn (3); all three vary,
    # the first two are trained, 3's tokens are extra; no group dropped
    stage, loader = ScriptedStage(varied={1, 2, 3, 4}), Loader([3, 4, 5])
    experience, stats = _sampling(stage, loader, groups=2, oversample=1.5).run(_prompts([1, 2]), iteration=1)
    assert stage.calls == [[1, 2, 3]] and experience.rollout.prompt_index_B.unique().tolist() == [1, 2]
    assert stats.sampling is not None
    assert (stats.sampling.groups_sampled, stats.sampling.groups_dropped, stats.sampling.rounds) == (3, 0, 1)
    assert stats.sampling.extra_tokens == 3 * 3 + 3


def test_a_prompt_is_a_candidate_once_and_the_dataset_bounds_the_draws():
    # the data repeats 1 (drawn again past an epoch's end): skipped; once the dataset's 5 prompts have all been
    # candidates, one group whose rewards differ is still missing
    stage, loader = ScriptedStage(varied={2}), Loader([3, 1, 4, 5, 6])
    with pytest.raises(DynamicSamplingError, match=r"found 1 of data\.prompts_per_iteration=2 groups") as err:
        _sampling(stage, loader, groups=2, limit=5).run(_prompts([1, 2]), iteration=5)
    message = str(err.value)
    assert "iteration 5" in message and "tried 5 of the dataset's 5 prompts" in message
    assert "data.oversample=0" in message
    assert stage.calls == [[1, 2], [3], [4], [5]] and loader.drawn == [[3], [1], [4], [5]]


def test_evaluation_passes_through():
    stage, loader = ScriptedStage(varied=set()), Loader([])
    held_out = object()  # an evaluation's own sampling: all its prompts, no filter, no statistics
    experience, stats = _sampling(stage, loader, groups=1).run(_prompts([4, 5]), 1, None, held_out)
    assert stage.calls == [[4, 5]] and len(experience) == 2 * N and stats.sampling is None


class ScriptedOpenBatch:
    """An open rollout on a scripted clock: prompt p's N samples take `1 + p % 5` steps from when it is added, and
    sample i has p + i tokens once finished (a dropped-while-decoding group has had its steps' worth)."""

    def __init__(self) -> None:
        self.clock = 0
        self.added: list[tuple[int, int]] = []  # (prompt id, step it was added at)
        self.open: dict[int, tuple[int, int]] = {}  # group number -> (prompt id, step it finishes at)

    @property
    def groups_open(self) -> int:
        return len(self.open)

    def add(self, prompts: PromptBatch) -> None:
        for p in prompts.prompt_ids_B.tolist():
            self.open[len(self.added)] = (p, self.clock + 1 + p % 5)
            self.added.append((p, self.clock))

    def finished(self):
        if not self.open:
            return None
        self.clock = min(end for _, end in self.open.values())
        groups = sorted(g for g, (_, end) in self.open.items() if end == self.clock)
        ids = [self.open.pop(g)[0] for g in groups]
        experience, _ = ScriptedStage(varied=set()).run(_prompts(ids), 0)
        return groups, experience.rollout

    def close(self) -> int:
        dropped = sum(self.clock - self.added[g][1] for g in self.open) * N
        self.open.clear()
        return dropped


class ScriptedOpening:
    """An `OpeningGenerator` over `ScriptedOpenBatch`es (the last one kept to read its clock)."""

    def open_rollout(self, *, iteration: int, capacity: int, prompt_width: int) -> ScriptedOpenBatch:
        self.batch, self.capacity = ScriptedOpenBatch(), capacity
        return self.batch

    def generation_stats(self) -> None:
        return None


class InferOnly:
    """The scripted stage's scores as an inferencer of rollouts (`varied` prompt ids score 0, 1, 0, ...), with no
    reward stage of its own (as a user's wrapper): asked `infer` for the scores. Records the prompt ids of each
    call."""

    def __init__(self, varied: set[int]) -> None:
        self.varied, self.inferred, self.scored = varied, [], []

    def _scores(self, rollout: Rollout) -> torch.Tensor:
        rows = zip(rollout.prompt_index_B.tolist(), rollout.sample_index_B.tolist(), strict=True)
        return torch.tensor([float(i % 2) if p in self.varied else 1.0 for p, i in rows])

    def infer(self, rollout: Rollout) -> Experience:
        self.inferred.append(rollout.prompt_index_B.tolist()[::N])
        zeros = torch.zeros(rollout.response_ids_BR.shape)
        return Experience(rollout, zeros, zeros, zeros, self._scores(rollout))


class ScoresFirst(InferOnly):
    """The same with a reward stage of its own (`Scorer`): groups are scored alone, and only kept ones inferred."""

    def score(self, rollout: Rollout) -> torch.Tensor:
        self.scored.append(rollout.prompt_index_B.tolist()[::N])
        return self._scores(rollout)


def _streamed(varied, loader, groups, oversample=1.0, limit=100, inferencer=ScoresFirst):
    generator = ScriptedOpening()
    sampling = StreamedDynamicSampling(
        ScriptedStage(varied), generator, inferencer(varied), groups, samples_per_prompt=N,
        oversample=oversample, draw=loader, limit=limit, prompt_width=3, pad_token_id=0,
    )  # fmt: skip
    return sampling, generator


def test_streamed_a_dropped_group_is_replaced_at_once_and_the_batch_keeps_candidate_order():
    # 2 groups asked for. Prompt 10 (1 step) scores alike: dropped at step 1, where 11 (2 steps) joins at once;
    # 11 varies and finishes at step 3, before 14 (5 steps), so the batch is 14 then 11, in candidate order, at
    # step 5. Rounds would wait for 14 before starting 11: step 5 + 2.
    loader = Loader([11, 12, 13])
    sampling, generator = _streamed({11, 14}, loader, groups=2)
    experience, stats = sampling.run(_prompts([10, 14]), iteration=1)
    assert generator.batch.added == [(10, 0), (14, 0), (11, 1)] and loader.drawn == [[11]]
    assert generator.batch.clock == 5 and generator.capacity == 2 * N
    assert experience.rollout.prompt_index_B.tolist() == [p for p in (14, 11) for _ in range(N)]
    assert experience.rollout.sample_index_B.tolist() == list(range(N)) * 2
    assert stats.sampling is not None
    assert stats.sampling.metrics() == {
        "rollout/groups_sampled": 3.0,
        "rollout/groups_dropped": 1.0,
        "rollout/extra_tokens": float(3 * 10 + 3),
        "rollout/sampling_rounds": 1.0,
    }
    # each group scored as it finished; one inference, of the kept groups only
    assert sampling.inferencer.scored == [[10], [11], [14]] and sampling.inferencer.inferred == [[14, 11]]


def test_streamed_asks_an_inferencer_without_a_reward_stage_for_the_scores():
    sampling, _ = _streamed({11, 14}, Loader([11, 12, 13]), groups=2, inferencer=InferOnly)
    experience, _ = sampling.run(_prompts([10, 14]), iteration=1)
    assert experience.rollout.prompt_index_B.tolist() == [p for p in (14, 11) for _ in range(N)]
    assert sampling.inferencer.inferred == [[10], [11], [14], [14, 11]]


def test_streamed_drops_what_still_decodes_once_the_batch_is_full():
    # factor 2: 2 x 1 groups decode; 5 (1 step) varies and fills the batch at step 1, while 4 (5 steps) has run
    # 1 of them: its N samples' 1 step each are extra, and it counts as sampled, not dropped
    sampling, generator = _streamed({4, 5}, Loader([5, 6]), groups=1, oversample=2.0)
    experience, stats = sampling.run(_prompts([4]), iteration=1)
    assert experience.rollout.prompt_index_B.tolist() == [5] * N and generator.batch.clock == 1
    assert stats.sampling is not None
    assert (stats.sampling.groups_sampled, stats.sampling.groups_dropped) == (2.0, 0.0)
    assert stats.sampling.extra_tokens == 1 * N


def test_streamed_runs_out_of_prompts_with_the_same_error_as_the_rounds():
    sampling, _ = _streamed({2}, Loader([3, 1, 4, 5, 6]), groups=2, limit=5)
    with pytest.raises(DynamicSamplingError, match=r"tried 5 of the dataset's 5 prompts and found 1 of"):
        sampling.run(_prompts([1, 2]), iteration=5)


def test_streamed_evaluation_runs_the_serial_stage():
    sampling, generator = _streamed(set(), Loader([]), groups=1)
    experience, stats = sampling.run(_prompts([4, 5]), 1, None, object())
    assert len(experience) == 2 * N and stats.sampling is None and not hasattr(generator, "batch")


def test_oversample_configuration():
    validate(compose_config(["experiment=arithmetic", "data.oversample=2.5"]))
    with pytest.raises(ValueError) as err:
        validate(compose_config(["data.oversample=0.5", "algorithm=reinforce_pp", "data.samples_per_prompt=1",
                                 "data.mini_batch_size=32"]))  # fmt: skip
    message = str(err.value)
    assert "data.oversample=0.5 must be 0 (off) or a factor >= 1" in message
    assert "set data.samples_per_prompt >= 2 or data.oversample=0" in message
    with pytest.raises(
        ValueError
    ) as err:  # vLLM's level-2 sleep would leave the second round without weights
        validate(compose_config(["experiment=arithmetic", "generator=vllm", "data.oversample=1"]))
    assert "generator.vllm_sleep_level=2 discards the engines' weights after each" in str(err.value)
    with pytest.raises(
        ValueError, match=r"algorithm\.overlong_buffer=9\.0 tokens exceeds generator\.max_new_tokens=8"
    ):
        validate(compose_config(["experiment=arithmetic", "algorithm=dapo", "algorithm.overlong_buffer=9"]))


def _groups(run_dir: Path) -> dict[int, dict[int, list[tuple[int, float]]]]:
    """iteration -> prompt id -> [(sample index, score)] of the trained samples (samples.jsonl)."""
    out: dict[int, dict[int, list[tuple[int, float]]]] = defaultdict(lambda: defaultdict(list))
    for line in (run_dir / "samples.jsonl").read_text().splitlines():
        row = json.loads(line)
        out[row["iteration"]][row["prompt_id"]].append((row["sample_index"], row["score"]))
    return out


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("warmstart-cache"))


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "instances",
    [
        pytest.param(["generator.in_process=true"], id="in-process"),
        pytest.param([], id="two-processes", marks=pytest.mark.distributed),
    ],
)
def test_every_trained_batch_holds_the_groups_asked_for_with_two_instances_and_migration(
    cache_dir, tmp_path, instances, train_cli
):
    """2 engine instances with migration (a hot temperature gives a long tail to move), DAPO with dynamic
    sampling: each iteration trains exactly 8 prompts x 4 samples, no group's samples all scored alike."""
    groups, n = 8, 4
    run_dir = tmp_path / "run"
    rows = train_cli(
        run_dir,
        "experiment=arithmetic",
        "algorithm=dapo",
        "iterations=3",
        f"data.prompts_per_iteration={groups}",
        f"data.samples_per_prompt={n}",
        "data.oversample=1.5",
        "generator=engine",
        "generator.instances=2",
        *instances,
        "generator.temperature=2.0",
        "migration=fixed",
        "migration.threshold=0.3",
        "logger=quiet",
        "logger.log_samples_every=1",
        "logger.log_samples_count=0",
        "distributed.timeout_s=60",
        f"model.warmstart.cache_dir={cache_dir}",
        timeout=200,
    )
    trained = _groups(run_dir)
    assert sorted(trained) == [1, 2, 3] and len(rows) == 3
    for iteration, by_prompt in trained.items():
        assert len(by_prompt) == groups, iteration
        for prompt, samples in by_prompt.items():
            assert sorted(i for i, _ in samples) == list(range(n)), (iteration, prompt)
            assert len({score for _, score in samples}) > 1, (iteration, prompt, samples)
    for row in rows:
        assert row["reward/zero_std_groups"] == 0.0
        # the groups generated but not trained: the dropped ones and the varied ones beyond the batch
        untrained = row["rollout/groups_sampled"] - groups
        assert row["rollout/groups_dropped"] <= untrained
        assert untrained * n <= row["rollout/extra_tokens"] <= untrained * n * 8  # 1 .. max_new_tokens each
    assert any(row["rollout/groups_dropped"] > 0 for row in rows)
    if instances:  # instances stepped in turn: the migration is deterministic
        assert rows[0]["migration/samples_moved"] > 0


def test_dapo_recipe_runs_from_a_script(cache_dir, tmp_path, capsys):
    recipe = Path(__file__).resolve().parents[2] / "recipes" / "dapo_arithmetic.py"
    spec = importlib.util.spec_from_file_location("recipe_dapo_arithmetic", recipe)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    history = module.main(
        [
            "iterations=2",
            "eval.every=1",
            f"model.warmstart.cache_dir={cache_dir}",
            f"run_dir={tmp_path / 'run'}",
        ]
    )
    assert len(history) == 2 and all(row["reward/zero_std_groups"] == 0.0 for row in history)
    assert all("rollout/extra_tokens" in row and "policy/clip_fraction_high" in row for row in history)
    out = capsys.readouterr().out
    assert "held-out accuracy" in out and "dynamic sampling dropped" in out


@pytest.mark.slow
def test_resume_with_dynamic_sampling_is_bit_identical(cache_dir, tmp_path, crash_after):
    """The extra prompts a round takes move the loader on; its position is in the checkpoint, so an interrupted
    run resumes into the same groups and metrics."""
    common = [
        "experiment=arithmetic",
        "algorithm=dapo",
        "data.oversample=1",
        "iterations=4",
        "checkpoint.every=2",
        "data.num_prompts=64",  # an epoch ends within the run: the extra prompts cross it
        f"model.warmstart.cache_dir={cache_dir}",
        "logger=quiet",
    ]

    def run(run_dir, *extra):
        return build_trainer(compose_config([*common, *extra]), run_dir=run_dir, log=lambda _: None)

    straight = run(tmp_path / "a")
    history = straight.fit()
    assert straight.prompts.epoch >= 1 and all(r["rollout/groups_dropped"] > 0 for r in history)
    interrupted = run(tmp_path / "b")
    interrupted.callbacks.append(crash_after(at=3))
    with pytest.raises(KeyboardInterrupt):
        interrupted.fit()
    resumed = run(tmp_path / "b", "resume=auto")
    skip = ("time/", "throughput/")
    assert [{k: v for k, v in r.items() if not k.startswith(skip)} for r in resumed.fit()] == [
        {k: v for k, v in r.items() if not k.startswith(skip)} for r in history[2:]
    ]
