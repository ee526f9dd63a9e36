"""Plan search: Megatron-LM pruning, exhaustive choice, plan_for."""

import pytest

from rlhfuse.pipeline.colocation import Colocation
from rlhfuse.planner import (
    CostModel,
    PruneStats,
    RLHFModels,
    Workload,
    cluster,
    model,
    plan_for,
    train_layouts,
)
from rlhfuse.planner.memory import rank_memory
from rlhfuse.planner.plan_search import (
    fsdp_plan,
    search_fsdp,
    search_plan,
    search_training,
    tp_candidates,
)
from rlhfuse.planner.plan_simulator import (
    TrainLayout,
    fsdp_model_step_time,
    fused_problem,
    model_step_time,
    serial_training,
)
from rlhfuse.planner.specs import ModelSpec


def test_tp_stays_in_a_node_and_divides_heads():
    c8 = cluster("h100", 4, 8)
    stats = PruneStats()
    assert tp_candidates(model("13b"), c8, stats) == [1, 2, 4, 8]
    assert tp_candidates(model("33b"), c8, stats) == [1, 2, 4]  # 52 heads
    assert stats.removed["tp does not divide heads"] == 1
    assert tp_candidates(model("65b"), cluster("h100", 4, 4)) == [1, 2, 4]


def test_train_layouts_obey_every_guideline():
    cost = CostModel(cluster("h100", 32, 8))
    w = Workload()
    stats = PruneStats()
    layouts = train_layouts(cost, model("33b"), "value", w, 400.0, stats)
    assert layouts
    for lay in layouts:
        assert lay.tp <= 8 and 52 % lay.tp == 0
        assert 60 % lay.pp == 0
        assert lay.tp * lay.pp * lay.dp == 256
        assert w.mini_batch % (lay.dp * lay.micro_batch) == 0
        need = cost.train_state_bytes(model("33b"), "value", lay.tp, lay.pp)
        assert need <= cost.usable_memory()
    assert stats.removed["pp does not divide layers"] > 0
    assert stats.removed["memory"] > 0  # e.g. 33B at tp = pp = 1 needs 520 GB of training state
    assert stats.kept == len(layouts)


def test_more_memory_keeps_at_least_as_many_layouts():
    w = Workload()
    h100 = train_layouts(CostModel(cluster("h100", 4, 8)), model("65b"), "lm", w, 400.0)
    h200 = train_layouts(CostModel(cluster("h200", 4, 8)), model("65b"), "lm", w, 400.0)
    assert set(h100) <= set(h200) and len(h200) > len(h100)


def test_too_small_a_cluster_is_refused_with_the_reason():
    cost = CostModel(cluster("h100", 1, 8))
    with pytest.raises(ValueError, match="no training layout fits"):
        search_training(cost, RLHFModels(model("65b"), model("65b")), Workload(), 400.0, fused=False)


def test_serial_search_is_the_exhaustive_minimum():
    cost = CostModel(cluster("h100", 4, 8))
    models = RLHFModels(model("7b"), model("7b"))
    w = Workload(global_batch=128, mini_batch=32)
    seq = 400.0
    best = search_training(cost, models, w, seq, fused=False)[0]
    la = train_layouts(cost, models.actor, "lm", w, seq)
    lc = train_layouts(cost, models.critic, "value", w, seq)
    times = [
        model_step_time(cost, models.actor, "lm", a, 32, seq)
        + model_step_time(cost, models.critic, "value", c, 32, seq)
        for a in la
        for c in lc
        if cost.train_state_bytes(models.actor, "lm", a.tp, a.pp)
        + cost.train_state_bytes(models.critic, "value", c.tp, c.pp)
        < 0.5 * cost.usable_memory()
    ]
    assert best.per_minibatch <= min(times) * (1 + 1e-12)


def test_plan_for_returns_a_complete_plan():
    plan = plan_for("7b", "7b", nodes=2, workload=Workload(global_batch=64, mini_batch=16, max_len=256))
    assert plan.system == "RLHFuse"
    assert plan.breakdown.total > 0 and plan.throughput > 0
    assert plan.rt_fraction is not None and 0 < plan.rt_fraction < 1
    assert plan.train.mode in ("fused", "serial")
    assert plan.gen_tp * plan.gen_instances == 16
    d = plan.to_dict()
    assert d["training"]["actor"]["dp"] * d["training"]["actor"]["pp"] * d["training"]["actor"]["tp"] == 16


def test_uneven_pipeline_stages_are_admitted_only_on_request():
    cost = CostModel(cluster("h100", 32, 8))
    w = Workload()
    strict = train_layouts(cost, model("33b"), "value", w, 400.0)
    uneven = train_layouts(cost, model("33b"), "value", w, 400.0, even_pp=False)
    assert {lay.pp for lay in strict} <= {1, 2, 4}  # 60 layers, tp x pp a power of two dividing 256
    assert 8 in {lay.pp for lay in uneven}  # the paper's 33B on 8 stages (7-8 layers each)
    assert set(strict) < set(uneven)


def test_uneven_stage_sets_the_pace():
    from rlhfuse.planner.cost import stage_fraction

    m = model("33b")
    assert stage_fraction(m, 4) == pytest.approx(1 / 4)
    assert stage_fraction(m, 8) == pytest.approx(8 / 60)  # ceil(60 / 8) = 8 layers on the busiest stage
    cost = CostModel(cluster("h100", 32, 8))
    f8, _ = cost.stage_times(m, "value", 4, 8, 8, 1, 512)
    f4, _ = cost.stage_times(m, "value", 4, 4, 16, 1, 512)
    assert f8 > f4 / 2  # 8 of 60 layers is more than half of 15


def test_pipeline_search_never_worsens_the_fused_training_and_is_the_same_every_time():
    import dataclasses

    from rlhfuse.planner.grid import GRID_SEARCH
    from rlhfuse.planner.plan_simulator import fused_training, searched_training

    cost = CostModel(cluster("h100", 4, 8))
    models = RLHFModels(model("7b"), model("7b"))
    w = Workload(global_batch=64, mini_batch=16)
    la = [lay for lay in train_layouts(cost, models.actor, "lm", w, 300.0) if lay.pp == 4 and lay.tp == 8]
    train = fused_training(cost, models, la[0], la[0], w, 300.0)
    search = dataclasses.replace(GRID_SEARCH, max_starts=20, max_iterations=5000)
    searched = searched_training(cost, models, train, w, 300.0, search)
    assert train.bound <= searched.per_minibatch <= train.per_minibatch
    assert "searched_makespan" in searched.detail and searched.detail["search_wall_capped"] == 0
    # a deterministic budget: the clock decides nothing, so a second search finds the same schedule
    again = searched_training(cost, models, train, w, 300.0, search)
    assert again.per_minibatch == searched.per_minibatch


def test_plan_for_takes_a_model_config_and_plans_tiny_models_on_this_cpu():
    from types import SimpleNamespace

    # shaped like rlhfuse.models.ModelConfig.tiny(), without importing torch
    tiny = SimpleNamespace(
        num_layers=2, hidden_size=64, num_heads=4, intermediate_size=128, vocab_size=128, num_kv_heads=2
    )
    w = Workload(global_batch=8, mini_batch=4, max_len=32)
    plan = plan_for(tiny, tiny, device="cpu", nodes=1, gpus_per_node=2, workload=w)
    assert plan.models.actor.layers == 2 and plan.models.actor.n_kv_heads == 2
    assert plan.breakdown.total > 0
    assert {lay.tp * lay.pp * lay.dp for lay in (plan.train.actor, plan.train.critic)} == {2}


def test_runtime_plans_only_layouts_rlhfuse_runtime_runs():
    """LLaMA-7B x 2 on 8 H100s: `runtime=True` (plan=auto's) keeps one tp for both models and nested pipelines,
    any generation tp (the runtime reshards to it: the unconstrained best generates at tp 8 beside tp-1
    training), and counts what it pruned."""
    w = Workload(global_batch=128, mini_batch=64, max_len=48)
    free = plan_for("7b", "7b", device="h100", nodes=1, gpus_per_node=8, workload=w, max_tp=8)
    assert free.gen_tp not in (1, free.train.actor.tp)
    stats = PruneStats()
    cost = CostModel(cluster("h100", 1, 8, max_tp=8), precision="bf16-mixed", offload_frozen=False)
    models = RLHFModels(model("7b"), model("7b"))
    plan = search_plan(cost, models, w, fused=True, stats=stats, runtime=True)
    a, c = plan.train.actor, plan.train.critic
    assert Colocation(a.pp, a.tp, c.pp, c.tp).problem(a.microbatches(w.mini_batch)) is None
    # fp32 weights, resident Ref / Reward and a generation copy: 7B is split in training and generation
    assert a.tp * a.pp > 1 and plan.gen_tp > 1
    assert stats.removed["runtime: the smaller-tp model's pp is not a multiple of max tp / its tp"] > 0
    assert not any("tp differ" in reason for reason in stats.removed)


# a 30-layer Actor (stages: 1, 2, 3, 5, ...) and a Critic whose 2 kv heads keep its tp <= 2
MERGED_ACTOR = ModelSpec("a30", layers=30, hidden=6144, heads=48, ffn=16576, kv_heads=8)
MERGED_CRITIC = ModelSpec("c24", layers=24, hidden=4096, heads=32, ffn=11008, kv_heads=2)


def test_runtime_search_evaluates_merged_layouts_and_costs_them_as_the_runtime_runs_them():
    """`runtime=True` admits unequal tp where `rlhfuse.runtime` merges the smaller-tp model's stages, and costs
    such a pair over merged stages (each m x a sub-stage's time), its memory per rank from its sub-stage; the
    paper grid's default (`merged=False`) keeps the lockstep sub-replicas."""
    cost = CostModel(cluster("h100", 1, 8, max_tp=8), precision="bf16-mixed", offload_frozen=False)
    models = RLHFModels(MERGED_ACTOR, MERGED_CRITIC)
    w = Workload(global_batch=128, mini_batch=64, max_len=256)
    stats = PruneStats()
    results = search_training(cost, models, w, 300.0, fused=True, stats=stats, runtime=True)
    merged = [r for r in results if r.actor.tp != r.critic.tp]
    assert merged and all(r.merged for r in results)
    plan = search_plan(cost, models, w, fused=True, runtime=True)
    assert plan.train.actor.tp != plan.train.critic.tp
    assert "consecutive stages merged per tp=4 group" in dict(plan.layout_rows())["training schedule"]
    for r in results:
        lay = Colocation(r.actor.pp, r.actor.tp, r.critic.pp, r.critic.tp)
        assert lay.problem(r.actor.microbatches(w.mini_batch)) is None
    a, c = TrainLayout(tp=4, pp=2, dp=1, micro_batch=8), TrainLayout(tp=2, pp=4, dp=1, micro_batch=8)
    f, b = cost.stage_times(MERGED_CRITIC, "value", 2, 4, 1, 8, 300.0)
    ranks, (pa, pc) = fused_problem(cost, models, a, c, w, 300.0, merged=True)
    # critic: 4 stages at tp 2 -> 2 merged stages on tp-4 groups, 2 sub-stages each, in the actor's 2 ranks
    assert ranks == 2 and (pa.stages, pc.stages, pc.replicas) == (2, 2, 1)
    assert (pc.forward, pc.backward) == (2 * f, 2 * b) and pc.placement == ((1, 0),)
    paper_ranks, (_, lockstep) = fused_problem(cost, models, a, c, w, 300.0)
    assert paper_ranks == 4 and (lockstep.stages, lockstep.forward) == (4, f)
    # memory: the runtime's ranks (each its critic sub-stage beside its actor stage's tp shard)
    built = rank_memory(
        MERGED_ACTOR, MERGED_CRITIC, actor_pp=2, critic_pp=4, actor_tp=4, critic_tp=2, gen_tp=1,
        precision="bf16-mixed", reward=MERGED_CRITIC,
    )  # fmt: skip
    assert cost.rank_memory(MERGED_ACTOR, MERGED_CRITIC, (4, 2), (2, 4), gen_tp=1, merged=True) == built
    # serial 1F1B of the merged critic: 2 stages of 2 x a sub-stage's time
    serial = serial_training(cost, models, a, c, w, 300.0, merged=True)
    assert serial.detail["critic"] == model_step_time(cost, MERGED_CRITIC, "value", c, 64, 300.0, merge=2)
    assert serial.detail["critic"] > serial_training(cost, models, a, c, w, 300.0).detail["critic"]


# ---- pipeline=fsdp -------------------------------------------------------------------------------------------
# Qwen2.5-3B's shape with its tied embedding / LM head (the runtime refuses pp > 1 and tp > 1 for it), Qwen2.5-0.5B's
# untied, and the trainer's default job's iteration: 128 samples, mini-batch 64, 48 new tokens, prompts <= 64
TIED_3B = ModelSpec(
    "q3b", 36, 2048, 16, 11008, vocab=151936, kv_heads=2, head_size=128, qkv_bias=True, tied=True
)
SMALL = ModelSpec("q05b", 24, 896, 14, 4864, vocab=151936, kv_heads=2, head_size=64, qkv_bias=True)
JOB = Workload(global_batch=128, mini_batch=64, max_len=48, prompt_cap=64)


def _runtime_cost(device: str) -> CostModel:
    """8 devices of one node as the trainer's plan=auto prices them: bf16-mixed, the Ref and Reward resident."""
    return CostModel(cluster(device, 1, 8, 8), precision="bf16-mixed", offload_frozen=False)


def test_fsdp_step_prices_the_gathers_and_the_last_reduce_scatter():
    """One rank alone communicates nothing: its micro-batches' forwards and backwards and 1/1 of the optimizer
    step. Over 8 ranks each forward all-gathers the model (and each backward again unless reshard_after_forward is
    off), the last backward reduce-scatters it; communication hidden under compute where shorter."""
    m, mb, seq = model("7b"), 64, 300.0
    alone = CostModel(cluster("h100", 1, 1))
    lay = TrainLayout(1, 1, 1, 4)
    f, b = alone.stage_times(m, "lm", 1, 1, 1, 4, seq)
    assert fsdp_model_step_time(alone, m, "lm", lay, mb, seq) == pytest.approx(
        16 * (f + b) + alone.optimizer_step_time(m, "lm", 1, 1)
    )
    cost = CostModel(cluster("h100", 1, 8))
    for micro in (1, 8):
        lay = TrainLayout(1, 1, 8, micro)
        f, b = cost.stage_times(m, "lm", 1, 1, 8, micro, seq)
        g = cost.fsdp_gather_time(m, "lm", 8, 2)
        r = cost.fsdp_gather_time(m, "lm", 8, 2)  # bf16-true: gradients reduced in bf16
        n = mb // (8 * micro)
        want = (
            n * max(f, g) + (n - 1) * max(b, g) + max(b, g + r) + cost.optimizer_step_time(m, "lm", 1, 1) / 8
        )
        assert fsdp_model_step_time(cost, m, "lm", lay, mb, seq) == pytest.approx(want)
        kept = fsdp_model_step_time(cost, m, "lm", lay, mb, seq, reshard_after_forward=False)
        if micro == 1:  # one-sample micro-batches of a 7B model: each pass's gather outlasts its compute
            assert g > b > f and kept < fsdp_model_step_time(cost, m, "lm", lay, mb, seq)
        else:  # eight-sample ones hide it: keeping the layers gathered saves nothing
            assert b > f > g and kept == fsdp_model_step_time(cost, m, "lm", lay, mb, seq)


def test_search_plan_chooses_fsdp_where_no_pipeline_layout_fits():
    """A tied 3B Actor and Critic on 8 H100s: the runtime runs them only at pp = tp = 1, whole replicas whose
    training state (16 bytes per parameter, twice) does not fit; sharded over the 8 they do, so fsdp=True plans
    pipeline=fsdp and without it there is no plan, with the reasons counted."""
    cost, models = _runtime_cost("h100"), RLHFModels(TIED_3B, TIED_3B)
    stats = PruneStats()
    with pytest.raises(ValueError, match="no training layout") as err:
        search_plan(cost, models, JOB, fused=True, even_pp=False, runtime=True, stats=stats)
    assert "runtime: tied embeddings need pp=1" in str(err.value)
    assert stats.removed["runtime: a tied Actor needs tp=1"] > 0
    plan = search_plan(cost, models, JOB, fused=True, even_pp=False, runtime=True, fsdp=True)
    assert plan.train.mode == "fsdp" and plan.gen_tp == 1 and plan.rt_fraction is None
    assert (plan.train.actor.dp, plan.train.actor.pp, plan.train.actor.tp) == (8, 1, 1)
    rows = dict(plan.layout_rows())
    assert "fsdp over 8 ranks" in rows["training schedule"] and rows["generation (Actor)"] == "dp=8 pp=1 tp=1"
    assert plan.to_dict()["training"]["schedule"] == "fsdp"
    # the whole replica's trained state alone exceeds the device; the busiest fsdp rank's peak fits
    assert cost.train_state_bytes(TIED_3B, "lm", 1, 1) * 2 > cost.usable_memory()
    memory = cost.fsdp_rank_memory(
        TIED_3B, TIED_3B, 8, reshard_after_forward=plan.train.reshard_after_forward
    )
    assert memory.resident < cost.usable_memory() / 2
    assert plan.breakdown.others > 0  # the weight sync gathers the Actor on every device


def test_search_plan_chooses_fsdp_where_it_is_predicted_faster_and_keeps_a_pipeline_where_not():
    """Qwen2.5-0.5B's shape on 8 A100s: pipelines fit (pp = 8 fused), but sharded data parallelism trains without
    bubbles and is predicted faster over the iteration, so it is chosen. A 7B model on 8 H100s: fsdp fits but its
    gathers over every forward and its rollout (whole-model generation, inference after it) are slower than the
    pipeline's tensor- and pipeline-parallel plan, which is kept."""
    for device, shape, want in (("a100", SMALL, "fsdp"), ("h100", model("7b"), "pipeline")):
        cost, models = _runtime_cost(device), RLHFModels(shape, shape)
        samples = JOB.sample()
        pipeline = search_plan(cost, models, JOB, fused=True, even_pp=False, runtime=True, samples=samples)
        assert pipeline.train.mode in ("fused", "serial")
        stats = PruneStats()
        sharded = [
            fsdp_plan(cost, models, JOB, samples, t, fused=True, stats=stats, cache={})
            for t in search_fsdp(cost, models, JOB, float(samples.seq.mean()), stats)
        ]
        fastest = min((p for p in sharded if p is not None), key=lambda p: p.breakdown.total)
        both = search_plan(
            cost, models, JOB, fused=True, even_pp=False, runtime=True, samples=samples, fsdp=True
        )
        if want == "fsdp":
            assert fastest.breakdown.total < pipeline.breakdown.total
            assert fastest.breakdown.training < pipeline.breakdown.training  # no pipeline bubbles
            assert both == fastest
        else:
            assert fastest.breakdown.total > pipeline.breakdown.total
            assert both == pipeline


def test_fsdp_plans_are_pruned_by_the_rollout_memory_and_the_mini_batch_split():
    """A 7B model's 512 samples at 1024 tokens each reserve more KV cache than an H100 holds beside its shards
    and generation copy; a mini-batch of 12 splits over 8 ranks into no micro-batch size."""
    cost, models = _runtime_cost("h100"), RLHFModels(model("7b"), model("7b"))
    w = Workload(global_batch=512, mini_batch=64, max_len=1024)
    samples = w.sample()
    stats = PruneStats()
    trains = search_fsdp(cost, models, w, float(samples.seq.mean()), stats)
    assert (
        stats.removed["fsdp: memory"] > 0
    )  # b = 8: activations; b = 1: the unsharded gradients of 8 micro-batches
    assert all(
        fsdp_plan(cost, models, w, samples, t, fused=True, stats=stats, cache={}) is None for t in trains
    )
    assert stats.removed["fsdp: KV cache does not fit"] == len(trains)
    stats = PruneStats()
    assert search_fsdp(cost, models, Workload(global_batch=48, mini_batch=12), 300.0, stats) == []
    assert stats.removed["fsdp: mini-batch does not split into devices x micro-batch"] == 4
