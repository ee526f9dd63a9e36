"""Rt auto-tuning: the Gen+Inf simulator against hand-computed timelines, the cost fit, and AutoThreshold picking
the sweep's minimum (or off when no Rt pays)."""

import pytest

from rlhfuse.generation import AutoThreshold, BatchObservation, CostProfile, EngineStats, rt_sweep, simulate
from rlhfuse.planner import LengthDistribution

FLAT = CostProfile(step_base_s=1.0, step_per_sample_s=0.0, prefill_s_per_token=0.0, inference_s_per_token=1.0)


def test_serial_and_fused_timelines_by_hand():
    # instance 0 holds lengths [2, 8], instance 1 [2, 2]; 1 s per decode step, 1 s of inference per token
    lengths = [2, 2, 8, 2]
    serial = simulate(lengths, 0, 2, 0, FLAT, bs_max=4, slots=4)
    # inference as a fluid queue over 2 servers (8 + 14 / 2), but the length-8 sample alone takes 8 s on one
    assert serial.generation_s == 8 and serial.gen_inf_s == 8 + 8
    # Rt = 1: at t = 2 one sample (length 8, on instance 0) remains; instance 0 keeps it (m = 1, nothing moves),
    # instance 1 infers 2+2+2 tokens from t = 2 (done at 8), then the tail's 8 tokens from t = 8
    fused = simulate(lengths, 0, 2, 1, FLAT, bs_max=4, slots=4)
    assert (fused.generation_s, fused.gen_inf_s, fused.moved, fused.destinations) == (8, 16, 0, 1)


def test_moved_samples_pay_their_reprefill_and_the_step_cost_grows_with_batch():
    profile = CostProfile(
        step_base_s=1.0, step_per_sample_s=0.5, prefill_s_per_token=0.1, inference_s_per_token=0.0
    )
    # instance 0: [1, 6], instance 1: [1, 6]; steps cost 1 + 0.5 b
    lengths = [1, 1, 6, 6]
    serial = simulate(lengths, 2, 2, 0, profile, bs_max=4, slots=4)
    # prefill 2 tokens x 2 samples x 0.1 = 0.4; step 1 with b=2 (2.0), steps 2..6 with b=1 (1.5 each)
    assert serial.generation_s == pytest.approx(0.4 + 2.0 + 5 * 1.5)
    fused = simulate(lengths, 2, 2, 2, profile, bs_max=4, slots=4)
    # at t = 2.4 two samples remain, one per instance, each with 5 steps left; m = 1: instance 0 keeps its own
    # and takes instance 1's (re-prefill of prompt 2 + 1 generated token = 0.3 s), then 5 steps with b = 2
    assert fused.moved == 1 and fused.destinations == 1
    assert fused.generation_s == pytest.approx(2.4 + 0.3 + 5 * 2.0)


def test_cost_profile_fit_recovers_a_linear_step_cost():
    stats = EngineStats(batch_sizes=[1, 2, 4, 8], step_seconds=[0.03, 0.04, 0.06, 0.10], prefill_tokens=100,
                        prefill_seconds=0.5)  # fmt: skip
    profile = CostProfile.fit([stats])
    assert profile.step_base_s == pytest.approx(0.02) and profile.step_per_sample_s == pytest.approx(0.01)
    assert profile.prefill_s_per_token == pytest.approx(
        0.005
    ) and profile.inference_s_per_token == pytest.approx(0.02)
    assert CostProfile.fit([EngineStats(batch_sizes=[3, 3], step_seconds=[1, 1], prefill_tokens=1)]) is None


def test_sweep_covers_5_to_95_percent_and_auto_picks_its_minimum():
    profile = CostProfile(step_base_s=0.01, step_per_sample_s=0.0, prefill_s_per_token=1e-5,
                          inference_s_per_token=2e-3)  # fmt: skip
    sweep, serial = rt_sweep(LengthDistribution(median=20, sigma=1.0), batch=128, cap=200, prompt_len=8,
                             instances=4, profile=profile, bs_max=64, slots=128)  # fmt: skip
    rts = [rt for rt, _ in sweep]
    assert rts[0] == 6 and rts[-1] == 122 and rts == sorted(set(rts))
    best = min(r.gen_inf_s for _, r in sweep)
    assert best < serial.gen_inf_s  # a long tail and costly inference: fusion pays
    policy = AutoThreshold(0.5, instances=4, bs_max=64)
    assert policy.threshold(128) == 64  # the initial value until lengths and costs are known
    lengths = LengthDistribution(median=20, sigma=1.0).sample(
        128, 200, __import__("numpy").random.default_rng(1)
    )
    policy.observe(BatchObservation(lengths.tolist(), prompt_len=8, cap=200, slots=128, profile=profile))
    assert policy.chosen is not None and policy.predicted is not None and policy.predicted_serial is not None
    assert policy.predicted.gen_inf_s < policy.predicted_serial.gen_inf_s and 0 < policy.threshold(128) < 128
    # without inference work there is nothing to hide under the tail: migration is turned off
    idle = CostProfile(
        step_base_s=0.01, step_per_sample_s=0.0, prefill_s_per_token=1e-5, inference_s_per_token=0
    )
    policy.observe(BatchObservation(lengths.tolist(), prompt_len=8, cap=200, slots=128, profile=idle))
    assert policy.threshold(128) == 0


def test_the_tuner_and_the_planner_agree_on_the_same_setting():
    """One simulator: the tuner (`simulate`, measured costs) fed the profile of the planner's cost model predicts
    the planner's own Gen+Inf (`gen_inf_serial` / `gen_inf_fused`) on the same batch, Rt by Rt, and both pick
    the same best Rt. Only the cost figures differ (a fitted line against the cost model's step times)."""
    import numpy as np

    from rlhfuse.planner import CostModel, RLHFModels, Workload, cluster, gen_inf_fused, gen_inf_serial, model
    from rlhfuse.planner.plan_simulator import RT_FRACTIONS, ModeledCosts, Samples, rt_values

    cost, models = CostModel(cluster("h100", 4)), RLHFModels(model("13B"), model("33B"))
    drawn = Workload(global_batch=256, mini_batch=64, max_len=1024).sample()
    samples = Samples(np.full(256, 128, dtype=np.int64), drawn.response)
    tp, ctx = 8, 128 + 1024
    planner = ModeledCosts(cost, models.actor, tp, ctx, 0.0, models, group=tp)
    profile = CostProfile.of(planner, samples)
    lengths, bs_max = samples.response.tolist(), cost.bs_max(models.actor, tp)
    slots = 10**6  # the planner's KV memory does not bind here either
    serial = simulate(lengths, 128, planner.instances, 0, profile, bs_max=bs_max, slots=slots)
    assert serial.gen_inf_s == pytest.approx(
        gen_inf_serial(cost, models, samples, tp, tp, max_context=ctx, resident_bytes=0.0).end, rel=0.02
    )
    tuned, planned = {}, {}
    for _, rt in rt_values(RT_FRACTIONS, 256):
        tuned[rt] = simulate(
            lengths, 128, planner.instances, rt, profile, bs_max=bs_max, slots=slots
        ).gen_inf_s
        planned[rt] = gen_inf_fused(cost, models, samples, tp, rt, max_context=ctx, resident_bytes=0.0).end
        assert tuned[rt] == pytest.approx(planned[rt], rel=0.05), rt
    assert min(tuned, key=tuned.__getitem__) == min(planned, key=planned.__getitem__)


def test_auto_keeps_rt_0_when_the_measured_lockstep_cost_eats_the_gain():
    """migration=auto never loses on what it measured: a fused run's lockstep cost per step (the count
    synchronisation) enters the prediction, and Rt = 0 is chosen once it outweighs the hidden inference; the
    fused-run figures survive the Rt = 0 iterations that cannot measure them."""
    import numpy as np

    lengths = LengthDistribution(median=20, sigma=1.0).sample(128, 200, np.random.default_rng(1)).tolist()
    cheap = CostProfile(step_base_s=0.01, step_per_sample_s=0.0, prefill_s_per_token=1e-5,
                        inference_s_per_token=2e-4, inference_measured=True)  # fmt: skip
    policy = AutoThreshold(0.5, instances=2, bs_max=64)
    policy.observe(BatchObservation(lengths, prompt_len=8, cap=200, slots=128, profile=cheap))
    assert policy.threshold(128) > 0
    costly = CostProfile(**{**cheap.__dict__, "lockstep_s": 0.03})
    policy.observe(BatchObservation(lengths, prompt_len=8, cap=200, slots=128, profile=costly))
    assert policy.threshold(128) == 0 and policy.predicted is policy.predicted_serial
    # an Rt = 0 iteration measures decoding only: the lockstep figure is kept, so Rt stays 0
    policy.observe(BatchObservation(lengths, prompt_len=8, cap=200, slots=128, profile=cheap))
    assert policy.profile is not None and policy.profile.lockstep_s == 0.03 and policy.threshold(128) == 0


def _measured_run(policy, lengths, profile, seconds_of, iterations):
    """Run `iterations` batches: each 'measures' seconds_of(rt > 0) times the simulator's serial prediction of
    the batch (a machine where migrating is that much slower or faster than predicted); the Rt of each."""
    serial = simulate(lengths, 8, policy.instances, 0, profile, bs_max=64, slots=128).gen_inf_s
    chosen = []
    for _ in range(iterations):
        rt = policy.threshold(len(lengths))
        chosen.append(rt)
        policy.observe(BatchObservation(lengths, prompt_len=8, cap=200, slots=128, profile=profile,
                                        measured_s=seconds_of(rt > 0) * serial, rt=rt))  # fmt: skip
    return chosen


def test_auto_falls_back_to_off_when_migrating_measures_slower_than_predicted():
    """The sweep predicts a gain (costly inference to hide), but on this machine a migrating iteration measures
    twice the serial one (a loaded machine, unmodelled costs): after one Rt = 0 probe auto stays off, trying
    the sweep's Rt again once every `check_every` iterations, which measures slow again."""
    import numpy as np

    lengths = LengthDistribution(median=20, sigma=1.0).sample(128, 200, np.random.default_rng(1)).tolist()
    profile = CostProfile(step_base_s=0.01, step_per_sample_s=0.0, prefill_s_per_token=1e-5,
                          inference_s_per_token=2e-3, inference_measured=True)  # fmt: skip
    policy = AutoThreshold(0.5, instances=4, bs_max=64, check_every=4)
    chosen = _measured_run(policy, lengths, profile, lambda migrating: 2.0 if migrating else 1.0, 12)
    assert chosen[0] > 0 and chosen[1] == 0  # the initial Rt, then one Rt = 0 probe
    assert policy.overruled and policy.pays() is False
    migrating = [i for i, rt in enumerate(chosen) if rt > 0]
    assert migrating == [0, 5, 10]  # one try after every 4 iterations off, once the measurements said off
    # the same machine where migrating measures 30% faster: auto keeps migrating, probing Rt = 0 now and then
    policy = AutoThreshold(0.5, instances=4, bs_max=64, check_every=4)
    chosen = _measured_run(policy, lengths, profile, lambda migrating: 0.7 if migrating else 1.0, 12)
    assert [i for i, rt in enumerate(chosen) if rt == 0] == [1, 6, 11]
    assert policy.pays() is True and not policy.overruled
