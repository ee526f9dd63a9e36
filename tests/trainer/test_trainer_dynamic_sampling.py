"""Dynamic sampling (`data.oversample`, `rlhfuse.trainer.rollout.DynamicSampling`): rounds over a scripted stage
(which groups are kept, what each round generates, the extra tokens, a prompt a candidate once, running out of
prompts), and end to end on `experiment=arithmetic` with 2 generation instances and migration (in one process and
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
from rlhfuse.trainer.rollout import DynamicSampling, DynamicSamplingError

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
