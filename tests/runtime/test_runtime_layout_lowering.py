"""Parallel layout (placement, validation arithmetic, groups) and lowering (deadlock-freedom by simulation)."""

from __future__ import annotations

import pytest
from runtime_helpers import random_schedule

from rlhfuse.pipeline import (
    Action,
    Kind,
    Schedule,
    greedy,
    load_problems,
    serial_one_f_one_b,
    split_each_backward,
)
from rlhfuse.pipeline.schedule_command import default_table_path
from rlhfuse.pipeline.simulate import simulate
from rlhfuse.runtime.layout import ModelParallel, ParallelLayout
from rlhfuse.runtime.lower import (
    STREAM_MODELS,
    LoweringError,
    Message,
    Program,
    check_program,
    lower,
    lower_checked,
)

TABLE3 = default_table_path()  # the Table-3 settings shipped with the package


def test_fused_placement_paper_example() -> None:
    # 16-stage actor in order, two 8-stage critic replicas reversed over 7..0 and 15..8 (docs/paper.md §3)
    layout = ParallelLayout(ModelParallel(16), ModelParallel(8), dp=2, world_size=32, microbatches=16)
    assert layout.local_placement("actor") == [list(range(16))]
    assert layout.local_placement("critic") == [list(range(7, -1, -1)), list(range(15, 7, -1))]
    assert layout.rank("critic", 1, 1, 0) == 16 + 15
    assert layout.replicas("critic") == 2 and layout.microbatches_per_replica("critic") == 8
    # critic stage 0 lives on local ranks 7 and 15 of both fused groups: one gradient group of 4 ranks
    assert layout.grad_groups[("critic", 0)] == (7, 15, 23, 31)
    assert layout.grad_groups[("actor", 3)] == (3, 19)
    assert layout.data_parallel_groups[5] == (5, 21)
    assert layout.pipeline_groups[("critic", 1, 0)] == tuple(range(23, 15, -1))
    assert sorted(layout.stages_on(17)) == [("actor", 0, 1), ("critic", 0, 6)]
    problem = layout.problem()
    assert problem.ranks == 16 and [m.name for m in problem.models] == ["actor", "critic"]


def test_tensor_parallel_layout_spans_consecutive_ranks() -> None:
    """pp=2 x tp=2 x dp=2 on 8 ranks: each stage's tp group is consecutive ranks, the pipeline placement runs
    over tp groups (pipeline ranks), and each tp shard reduces its gradients with the same shard elsewhere."""
    layout = ParallelLayout(ModelParallel(2, 2), ModelParallel(1, 2), dp=2, world_size=8, microbatches=2)
    assert layout.tp == 2 and layout.pipeline_ranks == 4
    assert layout.tp_groups == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert [layout.rank("actor", 0, 0, s, t) for s in range(2) for t in range(2)] == [0, 1, 2, 3]
    assert layout.rank("actor", 1, 0, 1, 1) == 7
    assert sorted(layout.stages_on(3)) == sorted(layout.stages_on(2)) == [("actor", 0, 1), ("critic", 1, 0)]
    assert layout.held_stages(5) == {"actor": {0}, "critic": {0}}
    assert layout.tp_grad_groups[("actor", 1, 1)] == (3, 7)
    # the critic (pp=1) has 2 replicas per fused group: tp shard 0 on ranks 0, 2, 4, 6
    assert layout.tp_grad_groups[("critic", 0, 0)] == (0, 2, 4, 6)
    assert layout.grad_groups[("actor", 0)] == (0, 1, 4, 5)
    assert layout.data_parallel_groups == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert layout.pipeline_groups[("actor", 1, 0)] == (2, 3)  # pipeline ranks
    assert layout.group_of(5) == 1
    assert "tp=2" in layout.describe()


def test_critic_larger_takes_rank_order() -> None:
    layout = ParallelLayout(ModelParallel(1), ModelParallel(2), dp=1, world_size=2, microbatches=2)
    assert layout.larger == "critic"
    assert layout.local_placement("critic") == [[0, 1]]
    assert layout.local_placement("actor") == [[0], [1]]


def test_layout_errors_show_the_arithmetic() -> None:
    with pytest.raises(ValueError) as err:
        ParallelLayout(ModelParallel(6), ModelParallel(3), dp=1, world_size=4, microbatches=3)
    msg = str(err.value)
    assert "actor.pp * tp * dp = 6 * 1 * 1 = 6 != world size 4" in msg
    assert "microbatches=3 must be a multiple of the 2 critic replicas" in msg
    with pytest.raises(ValueError, match=r"critic.pp=3 must divide actor.pp=4"):
        ParallelLayout(ModelParallel(4), ModelParallel(3), dp=1, world_size=4)
    # unequal tp: the critic's 2 stages of tp=1 merge onto one tp=2 group, so it has 2 replicas
    with pytest.raises(
        ValueError, match=r"multiple of the 2 critic replicas \(actor.pp / critic merged stages"
    ):
        ParallelLayout(ModelParallel(2, tp=2), ModelParallel(2), dp=1, world_size=4)
    with pytest.raises(ValueError, match=r"actor.pp \* tp \* dp = 2 \* 2 \* 1 = 4 != world size 2"):
        ParallelLayout(ModelParallel(2, tp=2), ModelParallel(2, tp=2), dp=1, world_size=2)
    with pytest.raises(ValueError, match=r"set dp=2"):
        ParallelLayout(ModelParallel(2), ModelParallel(2), dp=1, world_size=4)


def _layout_problem(actor: int, critic: int, mbs: int) -> object:
    return ParallelLayout(ModelParallel(actor), ModelParallel(critic), 1, max(actor, critic), mbs).problem()


def test_lowered_stream_shape() -> None:
    problem = _layout_problem(2, 2, 2)
    program = lower_checked(problem, greedy(problem), dp=1, prefetch=1)
    rank0 = [str(i) for i in program.streams[0]]
    # rank 0: actor stage 0 sends activations to rank 1; critic stage 1 (reversed) receives them from rank 1
    assert rank0[-2:] == ["OPTIMIZER_STEP actor", "OPTIMIZER_STEP critic"]
    sends = [i for i in program.streams[0] if i.kind is Kind.SEND]
    assert {(i.model, i.message.grad, i.peer) for i in sends} == {("actor", False, 1), ("critic", True, 1)}
    # each receive is posted before it is waited for, and waited right before its consumer
    for stream in program.streams:
        posted: set[Message] = set()
        for j, ins in enumerate(stream):
            if ins.kind is Kind.RECV and ins.post:
                posted.add(ins.message)
            elif ins.kind is Kind.RECV:
                assert ins.message in posted
                assert stream[j + 1].kind in (Kind.F, Kind.B) and stream[j + 1].needs == ins.message
    counts = program.counts()
    assert counts["F"] == counts["B"] == 2 * 2 * 2 and counts["SEND"] == counts["RECV"] == counts["RECV_POST"]


@pytest.mark.parametrize(
    "actor,critic,mbs", [(2, 2, 4), (4, 2, 4), (4, 4, 3), (4, 1, 4), (1, 2, 2), (8, 4, 6)]
)
def test_many_random_schedules_lower_without_deadlock(actor: int, critic: int, mbs: int) -> None:
    problem = _layout_problem(actor, critic, mbs)
    for seed in range(12):
        schedule = random_schedule(problem, seed, split_backward=seed % 2 == 1)  # odd seeds: F/I/W
        simulate(problem, schedule)  # valid for the planner
        for prefetch in (0, 1, 3):
            lower_checked(problem, schedule, dp=2, prefetch=prefetch)


def test_out_of_order_consumer_posts_in_sender_order() -> None:
    # stage 1 consumes micro-batch 1 before 0: the receives must still be posted 0 then 1 (in-order channel)
    problem = ParallelLayout(ModelParallel(2), ModelParallel(1), 1, 2, 2).problem()
    a = "actor"
    F = lambda s, m: Action(a, 0, s, Kind.F, m)  # noqa: E731
    B = lambda s, m: Action(a, 0, s, Kind.B, m)  # noqa: E731
    c = [Action("critic", r, 0, k, 0) for r in (0, 1) for k in (Kind.F, Kind.B)]
    schedule = Schedule(
        ((F(0, 0), F(0, 1), B(0, 1), B(0, 0), c[0], c[1]), (F(1, 1), F(1, 0), B(1, 1), B(1, 0), c[2], c[3]))
    )
    simulate(problem, schedule)
    program = lower_checked(problem, schedule, prefetch=0)
    posts = [i.message.microbatch for i in program.streams[1] if i.kind is Kind.RECV and i.post]
    assert posts == [0, 1]


def test_check_program_finds_deadlock_and_mismatch() -> None:
    problem = _layout_problem(2, 2, 2)
    program = lower(problem, serial_one_f_one_b(problem))
    check_program(program)
    # swap two sends on one channel: the receiver's k-th post no longer matches
    s0 = list(program.streams[0])
    idx = [j for j, i in enumerate(s0) if i.kind is Kind.SEND and i.model == "actor"]
    s0[idx[0]], s0[idx[1]] = s0[idx[1]], s0[idx[0]]
    with pytest.raises(LoweringError, match="mismatch on channel rank 0 -> rank 1"):
        check_program(Program((tuple(s0), program.streams[1]), 2, 1))
    # a blocking wait placed before the send it needs on the other rank, on both ranks: deadlock
    wait1 = next(i for i in program.streams[1] if i.kind is Kind.RECV and not i.post and i.model == "actor")
    post1 = next(
        i for i in program.streams[1] if i.kind is Kind.RECV and i.post and i.message == wait1.message
    )
    bad1 = (post1, wait1, *[i for i in program.streams[1] if i not in (post1, wait1)])
    s0 = list(program.streams[0])
    w0 = next(j for j, i in enumerate(s0) if i.kind is Kind.RECV and not i.post)
    p0 = next(j for j, i in enumerate(s0) if i.kind is Kind.RECV and i.post and i.message == s0[w0].message)
    bad0 = (s0[p0], s0[w0], *[i for j, i in enumerate(s0) if j not in (p0, w0)])
    # rank 0 waits for rank 1's first message before sending anything; rank 1 waits for rank 0's first one
    with pytest.raises(LoweringError, match="deadlock"):
        check_program(Program((bad0, bad1), 2, 1))


def test_backward_before_its_forward_is_rejected() -> None:
    problem = _layout_problem(2, 2, 1)
    program = lower(problem, greedy(problem))
    s1 = list(program.streams[1])
    b = next(j for j, i in enumerate(s1) if i.kind is Kind.B and i.model == "actor")
    s1.insert(0, s1.pop(b))
    with pytest.raises(LoweringError, match="before"):
        check_program(Program((program.streams[0], tuple(s1)), 2, 1))


def test_split_backward_lowers_i_like_b_and_w_locally() -> None:
    """F/I/W: I receives the gradient from the next stage and sends its input gradient upstream as B does; W
    exchanges nothing; REDUCE_GRAD follows a stage's last W; a W before its I is rejected."""
    layout = ParallelLayout(
        ModelParallel(2), ModelParallel(1), 2, 4, 2
    )  # dp 2: reduced critic and actor stages
    problem = layout.problem()
    plain = lower_checked(problem, greedy(problem), dp=2)
    split = lower_checked(problem, greedy(problem, split_backward=True), dp=2)
    assert split.counts()["I"] == split.counts()["W"] == plain.counts()["B"]
    for kind in ("SEND", "RECV", "RECV_POST", "REDUCE_GRAD"):
        assert split.counts()[kind] == plain.counts()[kind], kind
    for stream in split.streams:
        for j, ins in enumerate(stream):
            if ins.kind is Kind.W:
                assert ins.needs is None
            if ins.kind is Kind.REDUCE_GRAD:
                last = max(
                    k for k, i in enumerate(stream[:j]) if i.kind is Kind.W and i.action.stage == ins.stage
                    and i.model == ins.model
                )  # fmt: skip
                assert (
                    not any(
                        i.kind is Kind.W and i.model == ins.model and i.action.stage == ins.stage
                        for i in stream[j:]
                    )
                    and last < j
                )
    s0 = list(split.streams[0])
    w = next(j for j, i in enumerate(s0) if i.kind is Kind.W)
    s0.insert(0, s0.pop(w))
    with pytest.raises(LoweringError, match="before its I"):
        check_program(Program((tuple(s0), *split.streams[1:]), split.group_size, split.dp))


def test_table3_dry_run_64_ranks() -> None:
    problems = load_problems(TABLE3)
    big = [p for p in problems if p.ranks == 16]
    for problem in (big[0], big[-1]):
        program = lower_checked(problem, greedy(problem), dp=4)
        assert len(program.streams) == 64
        assert sum(1 for s in program.streams for i in s if i.kind is Kind.OPTIMIZER_STEP) == 128


@pytest.mark.parametrize(
    "actor,critic,mbs,schedule",
    [(2, 2, 2, "1f1b"), (2, 2, 2, "greedy"), (4, 4, 4, "greedy"), (4, 2, 4, "greedy"), (2, 1, 2, "1f1b"),
     (8, 8, 8, "greedy"), (2, 0, 2, "greedy")],
)  # fmt: skip
def test_one_group_per_model_deadlocks_under_nccl_order(
    actor: int, critic: int, mbs: int, schedule: str
) -> None:
    """NCCL runs a (group, rank pair)'s ops in issue order, both directions on one stream: with one group per model
    (the old grouping) rank 0 posts [recv dgrad0, send act1] and rank 1 [recv act1, send dgrad0] on that stream
    and both wait forever. One group per model and direction (`p2p_group_key`) runs the same program."""
    from rlhfuse.runtime.layout import actor_only_layout

    layout = (
        actor_only_layout(ModelParallel(actor), 1, actor, mbs)
        if critic == 0
        else ParallelLayout(ModelParallel(actor), ModelParallel(critic), 1, max(actor, critic), mbs)
    )
    problem = layout.problem()
    program = lower(problem, greedy(problem) if schedule == "greedy" else serial_one_f_one_b(problem))
    check_program(program)  # one group per model and direction: no deadlock
    with pytest.raises(LoweringError, match=r"deadlock(.|\n)*WAIT RECV .*stream of group"):
        check_program(program, group_of=lambda message, lo, hi: message.model)


def _world_group_per_model_and_direction(message: Message, lo: int, hi: int) -> tuple[str, bool]:
    """The grouping before per-pair groups: one world-sized group per model and direction."""
    return (message.model, message.grad)


@pytest.mark.parametrize("prefetch", [0, 1])
@pytest.mark.parametrize("pp", [2, 4, 8])
@pytest.mark.parametrize("program_kind", ["fused", "serial_1f1b", "inference"])
def test_every_plan_runs_under_both_nccl_stream_models(program_kind: str, pp: int, prefetch: int) -> None:
    """NCCL runs a group's point-to-point ops on one stream per (group, rank pair), or per (group, rank) when the
    communicator is made eagerly: every program the runtime lowers (the fused search's, serial 1F1B, forward-only
    inference; pp 2, 4, 8; prefetch 0 and 1) runs under both with the runtime's groups (one per model, direction
    and rank pair), which make the two models the same."""
    from rlhfuse.trainer.strategies.pipelines.inference import forward_schedule, inference_problem

    layout = ParallelLayout(ModelParallel(pp), ModelParallel(pp), 1, pp, 2 * pp)
    if program_kind == "inference":
        problem = inference_problem(layout, 2 * pp, ("actor", "ref", "critic", "reward"))
        program = lower(problem, forward_schedule(problem), prefetch=prefetch, optimizer_steps=False)
    else:
        problem = layout.problem()
        schedule = greedy(problem) if program_kind == "fused" else serial_one_f_one_b(problem)
        program = lower(problem, schedule, prefetch=prefetch)
        if program_kind == "fused":  # and the split-backward (F/I/W) twins of both
            split = (greedy(problem, split_backward=True), split_each_backward(serial_one_f_one_b(problem)))
            for twin in split:
                for model in STREAM_MODELS:
                    check_program(lower(problem, twin, prefetch=prefetch), streams_per=model)
    for model in STREAM_MODELS:
        check_program(program, streams_per=model)


@pytest.mark.parametrize(("actor", "critic"), [(4, 4), (8, 4)])
def test_world_groups_per_model_deadlock_under_one_stream_per_group_and_rank(actor: int, critic: int) -> None:
    """The grouping before per-pair groups (one world-sized group per model and direction) runs the fused
    programs under the pair model but forms wait cycles when all of a rank's ops on a group share one stream
    (PyTorch #132900): what the per-pair groups fix."""
    layout = ParallelLayout(ModelParallel(actor), ModelParallel(critic), 1, actor, 8)
    problem = layout.problem()
    program = lower(problem, greedy(problem), prefetch=0)
    check_program(program, group_of=_world_group_per_model_and_direction, streams_per="pair")
    with pytest.raises(LoweringError, match="deadlock"):
        check_program(program, group_of=_world_group_per_model_and_direction, streams_per="rank")
    check_program(program, streams_per="rank")  # the runtime's groups


def test_check_program_models_one_fifo_per_group_and_pair() -> None:
    """Two messages of one direction on one stream arrive in the sender's order; a receiver posting them the
    other way round is a mismatch, even though each message has its own matching send (gloo's tags would match
    them; NCCL's order does not)."""
    problem = _layout_problem(2, 1, 2)
    program = lower(problem, greedy(problem), prefetch=3)
    s1 = list(program.streams[1])
    posts = [j for j, i in enumerate(s1) if i.kind is Kind.RECV and i.post and i.model == "actor"]
    s1[posts[0]], s1[posts[1]] = s1[posts[1]], s1[posts[0]]
    with pytest.raises(LoweringError, match="mismatch on channel rank 0 -> rank 1"):
        check_program(Program((program.streams[0], tuple(s1)), 2, 1))
