"""Inference over the pipeline layout: forward-only programs are proven deadlock-free, and the distributed
Actor/Ref log-probs, Critic values and Reward scores equal the single-process inferencer's (gloo, float64)."""

from __future__ import annotations

import pytest
import torch
from runtime_helpers import run_distributed

from rlhfuse.core.inference import InferencerConfig
from rlhfuse.core.types import Rollout
from rlhfuse.data.synthetic import build_tokenizer
from rlhfuse.models import ModelConfig, Transformer
from rlhfuse.pipeline.ir import Kind, Schedule
from rlhfuse.runtime.layout import ModelParallel, ParallelLayout
from rlhfuse.runtime.lower import LoweringError, check_program, lower
from rlhfuse.testing.data import random_rollout
from rlhfuse.trainer.strategies.pipelines.inference import (
    PipelineInferencer,
    assign_rows,
    forward_program,
    forward_schedule,
    inference_problem,
    split_rows,
    trim_responses,
)
from rlhfuse.trainer.strategies.plain.inference import ModelInferencer

MODELS = ("actor", "ref", "critic", "reward")


def _layout(actor_pp: int, critic_pp: int, dp: int, microbatches: int) -> ParallelLayout:
    world = max(actor_pp, critic_pp) * dp
    return ParallelLayout(ModelParallel(actor_pp), ModelParallel(critic_pp), dp, world, microbatches)


@pytest.mark.parametrize(
    ("actor_pp", "critic_pp", "dp", "microbatches"),
    [(2, 2, 1, 4), (2, 1, 1, 4), (1, 2, 2, 2), (1, 1, 2, 1), (4, 2, 1, 6), (16, 8, 4, 16)],
)
def test_forward_programs_are_deadlock_free(
    actor_pp: int, critic_pp: int, dp: int, microbatches: int
) -> None:
    layout = _layout(actor_pp, critic_pp, dp, microbatches)
    for prefetch in (0, 2):
        problem, program = forward_program(
            layout, microbatches, MODELS, prefetch=prefetch
        )  # runs check_program
        kinds = {i.kind for s in program.streams for i in s}
        assert kinds <= {Kind.F, Kind.SEND, Kind.RECV}
        forwards = [i.action for s in program.streams for i in s if i.kind is Kind.F]
        expected = sum(m.stages * m.replicas * m.microbatches for m in problem.models) * dp
        assert (
            len(forwards)
            == expected
            == len(
                set(
                    zip(
                        forwards,
                        [i.group for s in program.streams for i in s if i.kind is Kind.F],
                        strict=True,
                    )
                )
            )
        )


def test_forward_schedule_runs_both_directions_at_once() -> None:
    layout = _layout(2, 2, 1, 2)
    labels = forward_schedule(inference_problem(layout, 2, MODELS)).labels()
    # the Actor enters at rank 0 while the Critic (reversed) enters at rank 1: no rank idles at the start
    assert labels[0][0] == "actor.0:F0" and labels[1][0] == "critic.0:F0"
    assert sorted(labels[0]) == sorted(labels[1]) == sorted(f"{m}.0:F{i}" for m in MODELS for i in range(2))


def test_check_program_rejects_a_forward_only_deadlock() -> None:
    layout = _layout(2, 2, 1, 1)
    problem = inference_problem(layout, 1, ("actor", "critic"))
    good = forward_schedule(problem)
    # each rank first runs the stage that waits for the other rank: both wait forever
    bad = Schedule.from_lists([tuple(reversed(good.ranks[0])), tuple(reversed(good.ranks[1]))])
    check_program(lower(problem, good, optimizer_steps=False))
    with pytest.raises(LoweringError, match="deadlock"):
        check_program(lower(problem, bad, prefetch=0, optimizer_steps=False))


def test_split_rows_repeats_rows_only_when_there_are_too_few() -> None:
    assert [p.tolist() for p in split_rows(5, 2)] == [[0, 1, 2], [3, 4]]
    assert [p.tolist() for p in split_rows(2, 4)] == [[0], [1], [2], [3]]  # 2, 3 stand for rows 0, 1


def test_assign_rows_mixes_lengths_over_groups_and_replicas() -> None:
    lengths = torch.tensor([7, 1, 5, 3, 8, 2, 6, 4, 9, 10, 12, 11, 0, 13, 14, 15])
    rows = assign_rows(lengths, dp=2, microbatches=4, replicas=2)
    kept = sorted(int(r) for group in rows for idx, keep in group for r in idx[keep])
    assert kept == list(range(16))  # every row exactly once
    for group in rows:
        spans = [lengths[idx].tolist() for idx, _ in group]
        assert all(max(s) - min(s) <= 3 for s in spans)  # similar lengths inside a micro-batch
        replica_tokens = [sum(sum(s) for s in spans[:2]), sum(sum(s) for s in spans[2:])]
        assert max(replica_tokens) / min(replica_tokens) < 1.4  # both replicas get short and long rows
    group_tokens = [sum(int(lengths[idx].sum()) for idx, _ in group) for group in rows]
    assert max(group_tokens) / min(group_tokens) < 1.2
    (few,) = assign_rows(torch.tensor([3, 1]), dp=1, microbatches=4, replicas=1)
    assert sorted(int(r) for idx, keep in few for r in idx[keep]) == [0, 1]
    assert sum(int((~keep).sum()) for _, keep in few) == 2  # the repeated rows are not kept


def test_trim_responses_drops_only_trailing_padding() -> None:
    rollout = _rollout(4, seed=1, response=7)
    rollout.response_mask_BR[:, 5:] = 0
    trimmed = trim_responses(rollout)
    assert trimmed.response_ids_BR.shape[1] == int(rollout.response_lengths_B.max()) <= 5
    assert torch.equal(trimmed.response_lengths_B, rollout.response_lengths_B)
    assert trim_responses(trimmed) is trimmed


def _rollout(n: int, seed: int, vocab: int = 128, prompt: int = 5, response: int = 7) -> Rollout:
    return random_rollout(n, vocab=vocab, prompt=prompt, response=response, seed=seed)


def _models(layers: int = 2) -> dict[str, Transformer]:
    torch.manual_seed(3)
    cfg = ModelConfig.tiny(num_layers=layers)
    heads = {"actor": "lm", "ref": "lm", "critic": "value", "reward": "value"}
    return {name: Transformer(cfg, head=head).double() for name, head in heads.items()}


def _inference_worker(rank: int, world: int) -> None:
    models = _models()
    tokenizer = build_tokenizer()
    for actor_pp, critic_pp, dp, mbs, size, rows in [
        (2, 2, 1, 4, 0, 13),
        (2, 2, 1, 4, 3, 13),
        (2, 1, 1, 2, 0, 9),  # two critic (and reward) replicas, one per rank
        (1, 2, 1, 2, 0, 9),  # the Critic is the larger model
        (1, 1, 2, 2, 0, 11),  # data parallelism only
        (2, 2, 1, 4, 0, 3),  # fewer rows than micro-batches
    ]:
        config = InferencerConfig(micro_batch_size=size, truncated_score=-5.0)
        layout = _layout(actor_pp, critic_pp, dp, mbs)
        rollout = _rollout(rows, seed=rows + size)
        oracle = ModelInferencer(
            config, actor=models["actor"], ref=models["ref"], critic=models["critic"],
            reward_model=models["reward"], rewards=None, tokenizer=tokenizer, temperature=0.7,
        ).infer(rollout)  # fmt: skip
        pipe = PipelineInferencer(
            config, layout, models, rewards=None, tokenizer=tokenizer, temperature=0.7, timeout_s=60
        )
        got = pipe.infer(rollout)
        where = (
            f"rank {rank} actor.pp={actor_pp} critic.pp={critic_pp} dp={dp} M={mbs} size={size} rows={rows}"
        )
        assert torch.equal(got.rollout.response_ids_BR, rollout.response_ids_BR), where
        for name in ("logprobs_BR", "ref_logprobs_BR", "values_BR", "scores_B"):
            a, b = getattr(got, name), getattr(oracle, name)
            assert a.shape == b.shape and a.dtype == b.dtype, where
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=f"{where}: {name}")
            assert bool(a.abs().sum() > 0), f"{where}: {name} is all zero"
        assert not torch.equal(got.logprobs_BR, got.ref_logprobs_BR), where


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_pipeline_inference_equals_single_process() -> None:
    run_distributed(_inference_worker, 2, timeout=220)


def _four_rank_inference_worker(rank: int, world: int) -> None:
    models = _models(layers=4)
    tokenizer = build_tokenizer()
    for actor_pp, critic_pp, dp, mbs in [(2, 1, 2, 2), (4, 2, 1, 4), (1, 2, 2, 2)]:
        config = InferencerConfig(truncated_score=None)
        rollout = _rollout(10, seed=actor_pp * 10 + critic_pp)
        oracle = ModelInferencer(
            config, actor=models["actor"], ref=models["ref"], critic=models["critic"],
            reward_model=models["reward"], rewards=None, tokenizer=tokenizer, temperature=1.0,
        ).infer(rollout)  # fmt: skip
        layout = _layout(actor_pp, critic_pp, dp, mbs)
        got = PipelineInferencer(
            config, layout, models, rewards=None, tokenizer=tokenizer, temperature=1.0, timeout_s=60,
            log=lambda _: None,
        ).infer(rollout)  # fmt: skip
        where = f"rank {rank} actor.pp={actor_pp} critic.pp={critic_pp} dp={dp}"
        for name in ("logprobs_BR", "ref_logprobs_BR", "values_BR", "scores_B"):
            torch.testing.assert_close(
                getattr(got, name), getattr(oracle, name), rtol=1e-6, atol=1e-6, msg=where
            )


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_pipeline_inference_four_ranks_replicas_and_data_parallel() -> None:
    """Critic/Reward replicas x data parallelism, a 4-stage Actor with two reversed 2-stage Critic replicas."""
    run_distributed(_four_rank_inference_worker, 4, timeout=220)


def test_the_reward_stage_alone_scores_as_the_whole_inference() -> None:
    """`ModelInferencer.score` (what dynamic sampling decides on) equals `infer`'s scores: the reward model's, the
    truncated ones replaced; the Actor, Ref and Critic do not run."""
    models = _models()
    calls: list[str] = []
    for name in ("actor", "ref", "critic"):
        models[name].register_forward_pre_hook(lambda *_, name=name: calls.append(name))
    inferencer = ModelInferencer(
        InferencerConfig(truncated_score=-5.0), actor=models["actor"], ref=models["ref"],
        critic=models["critic"], reward_model=models["reward"], rewards=None, tokenizer=build_tokenizer(),
        temperature=0.7,
    )  # fmt: skip
    rollout = _rollout(6, seed=4)
    scores_B = inferencer.score(rollout)
    assert calls == []
    assert torch.equal(scores_B, inferencer.infer(rollout).scores_B) and calls
    assert bool((scores_B == -5.0).any()) == bool((~rollout.finished_B).any())
