"""Iteration simulator: generation, migration, inference drain, lengths."""

import numpy as np
import pytest

from rlhfuse.planner import CostModel, LengthDistribution, RLHFModels, Workload, cluster, model, rt_sweep
from rlhfuse.planner.plan_simulator import (
    Samples,
    decode_finish_times,
    drain_time,
    gen_inf_fused,
    gen_inf_serial,
    generate_unmigrated,
    simulate_generation,
)

COST = CostModel(cluster("h100", 2))
MODELS = RLHFModels(model("7b"), model("7b"))


def test_decode_finish_times_hand_check():
    m = model("7b")
    ctx0 = np.array([10, 20])
    remaining = np.array([1, 3])
    finish, steps = decode_finish_times(COST, m, 8, ctx0, remaining, 5.0)
    # step 0: both alive, 11 + 21 KV entries; steps 1, 2: only the second, 22 then 23
    expected = 5.0 + np.cumsum(COST.decode_step_time(m, 8, np.array([2, 1, 1]), np.array([32, 22, 23])))
    assert np.allclose(steps, expected)
    assert np.allclose(finish, [expected[0], expected[2]])


def test_drain_time_hand_examples():
    a = np.zeros(2)
    w = np.array([2.0, 2.0])
    assert drain_time(a, w, 2, 0.0) == 2.0
    assert drain_time(a, w, 1, 0.0) == 4.0
    assert drain_time(a, w, 1, 5.0) == 9.0
    # a late arrival bounds the end however many servers there are
    assert drain_time(np.array([0.0, 10.0]), w, 100, 0.0) == 12.0


def _samples(n, length, prompt=16):
    return Samples(np.full(n, prompt, dtype=np.int64), np.full(n, length, dtype=np.int64))


def test_generation_grows_with_length_and_without_migration_ends_at_the_longest():
    short = simulate_generation(COST, MODELS.actor, _samples(32, 100), 8, max_context=512)
    long = simulate_generation(COST, MODELS.actor, _samples(32, 400), 8, max_context=512)
    assert long.end > 3 * short.end
    assert short.t_migrate is None and short.decision is None


def test_migration_keeps_every_sample_and_frees_instances():
    w = Workload(global_batch=64, mini_batch=16, max_len=512)
    s = w.sample()
    gen = simulate_generation(COST, MODELS.actor, s, 4, max_context=w.max_context, rt=8)
    base = generate_unmigrated(COST, MODELS.actor, s, 4)
    assert gen.decision is not None and gen.t_migrate is not None
    assert gen.decision.m < gen.instances
    assert sum(gen.decision.loads) == 8
    # samples that finished before the migration are untouched; the tail finishes after it
    early = base.finish <= gen.t_migrate
    assert np.array_equal(gen.finish[early], base.finish[early])
    assert np.all(gen.finish[~early] > gen.t_migrate)
    assert gen.mechanism in ("kv", "reprefill")


def test_fused_gen_inf_beats_serial_when_inference_overlaps_the_tail():
    w = Workload(global_batch=64, mini_batch=16, max_len=1024)
    s = w.sample()
    serial = gen_inf_serial(COST, MODELS, s, 4, 4, max_context=w.max_context, resident_bytes=0.0)
    sweep = rt_sweep(COST, MODELS, s, 4, max_context=w.max_context, resident_bytes=0.0)
    assert len(sweep) == 19 and sweep[0][0] == 0.05 and sweep[-1][0] == 0.95
    best = min(r.end for _, r in sweep)
    assert best < serial.end
    assert serial.inference_exposed > 0
    fused = gen_inf_fused(COST, MODELS, s, 4, 13, max_context=w.max_context, resident_bytes=0.0)
    assert fused.end >= fused.generation.end


def test_lengths_are_long_tailed_and_capped():
    rng = np.random.default_rng(0)
    d = LengthDistribution()
    x = d.sample(20000, 4096, rng)
    assert x.min() >= 1 and x.max() <= 4096
    assert np.percentile(x, 99.9) > 10 * np.median(x)  # RLHFuse Fig. 2: P99.9 > 10x median
    assert x.mean() == pytest.approx(214.5, rel=0.05)  # LMSYS-Chat-1M mean response
    fit = LengthDistribution.fit(x)
    assert fit.median == pytest.approx(d.median, rel=0.05) and fit.sigma == pytest.approx(d.sigma, rel=0.05)
    capped = d.sample(512, 256, np.random.default_rng(1))
    assert capped.max() == 256


def test_workload_validation_names_the_problem():
    with pytest.raises(ValueError, match="multiple of mini_batch"):
        Workload(global_batch=100, mini_batch=64).validate()


def test_swap_is_hidden_when_prefetched_and_paid_per_pass_when_not():
    from rlhfuse.planner.plan_simulator import inference_tps, swap_exposed

    tps = inference_tps(MODELS, 8)
    swap, ready = swap_exposed(COST, MODELS, tps, 0.0, 10.0)
    assert ready == 10.0 and swap > 0  # prefetched from t=0, done long before generation ends
    swap2, ready2 = swap_exposed(COST, MODELS, tps, 9.99, 10.0)
    assert ready2 == pytest.approx(9.99 + swap2)
    swap3, ready3 = swap_exposed(COST, MODELS, tps, None, 10.0, passes=2)
    assert swap3 == 2 * swap and ready3 == pytest.approx(10.0 + 2 * swap)
    # the Critic resharded from its training layout over the network instead of copied from host memory
    swap4, _ = swap_exposed(COST, MODELS, tps, None, 0.0, critic_train=(8, 1))
    assert swap4 < swap


def test_prefetch_starts_later_with_less_free_memory():
    from rlhfuse.planner.plan_simulator import inference_tps, prefetch_start

    w = Workload(global_batch=64, mini_batch=16, max_len=512)
    s = w.sample()
    base = generate_unmigrated(COST, MODELS.actor, s, 4)
    tps = inference_tps(MODELS, 4)
    starts = [
        prefetch_start(COST, MODELS, tps, 4, base, range(4), resident_bytes=r, max_context=w.max_context)
        for r in (0.0, 40e9, 55e9, 70e9)
    ]
    assert starts[0] == 0.0  # everything fits from the start
    assert starts[-1] is None  # never fits beside the training state
    known = [x for x in starts if x is not None]
    assert known == sorted(known)
    freed = prefetch_start(
        COST, MODELS, tps, 4, base, range(4), resident_bytes=55e9, max_context=w.max_context, freed_at=0.01
    )
    assert freed is not None and freed <= 0.01


def test_without_a_tail_migration_has_nothing_to_move_and_fusion_gains_nothing():
    s = _samples(64, 300, prompt=100)  # every response the same length: all finish together
    serial = gen_inf_serial(COST, MODELS, s, 4, 4, max_context=512, resident_bytes=0.0)
    for rt in (5, 30, 63):
        fused = gen_inf_fused(COST, MODELS, s, 4, rt, max_context=512, resident_bytes=0.0)
        assert fused.generation.decision is not None and fused.generation.decision.m == 0
        assert fused.end == pytest.approx(serial.end)
    with pytest.raises(ValueError, match="rt=64"):
        gen_inf_fused(COST, MODELS, s, 4, 64, max_context=512, resident_bytes=0.0)


def test_speculative_tail_pays_in_small_batches_and_never_costs():
    """The speculative tail in the simulator: sum_{i<=k} a^i tokens per verify step, a verify step priced as the
    decode step of batch x (k + 1) positions, used only where it beats a plain step (the small tail batches)."""
    from rlhfuse.planner.plan_simulator import ModeledCosts, Speculation, gen_inf

    assert Speculation(0.5, 3).tokens_per_step == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert Speculation(1.0, 4).tokens_per_step == 5 and Speculation(0.0, 4).tokens_per_step == 1
    with pytest.raises(ValueError, match=r"acceptance=1\.5"):
        Speculation(1.5).validate()
    plain = ModeledCosts(COST, MODELS.actor, 4, 512)
    spec = ModeledCosts(COST, MODELS.actor, 4, 512, speculation=Speculation(0.6, 4))
    alive, ctx = np.array([1.0, 4.0, 4096.0]), np.array([300.0, 1200.0, 1.2e6])
    per_token_plain, per_token_spec = plain.step_time(alive, ctx), spec.step_time(alive, ctx)
    assert np.all(per_token_spec <= per_token_plain)
    assert per_token_spec[0] < 0.7 * per_token_plain[0]  # one sample: the step costs what one position costs
    assert per_token_spec[2] == per_token_plain[2]  # a compute-bound batch: verifying does not pay
    # a whole batch: fused Gen+Inf faster with the speculative tail, and with acceptance 0 exactly as without
    s = Workload(global_batch=64, mini_batch=16, max_len=1024).sample()
    models = dict(models=MODELS, group=4)
    base = gen_inf(ModeledCosts(COST, MODELS.actor, 4, 1124, **models), s, 13)
    faster = gen_inf(ModeledCosts(COST, MODELS.actor, 4, 1124, **models, speculation=Speculation(0.6)), s, 13)
    same = gen_inf(ModeledCosts(COST, MODELS.actor, 4, 1124, **models, speculation=Speculation(0.0)), s, 13)
    assert faster.end < base.end and faster.generation.end < base.generation.end
    assert same.end == pytest.approx(base.end)
