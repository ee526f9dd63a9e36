"""Cost model: hand-derived values, monotonic and limiting behaviour."""

import math

import numpy as np
import pytest

from rlhfuse.planner import A100, H100, H200, CostModel, Efficiency, cluster, model
from rlhfuse.planner.cost import GRAD_BUCKET_BYTES, TRAIN_STATE_BYTES_PER_PARAM

NO_OVERHEAD = Efficiency(decode_step_overhead=0.0, layer_overhead=0.0)


@pytest.mark.parametrize(("name", "billions"), [("13b", 13.0), ("33b", 32.5), ("65b", 65.2)])
def test_llama_parameter_counts_match_the_paper(name, billions):
    assert model(name).params() / 1e9 == pytest.approx(billions, rel=0.01)


def test_kv_bytes_per_token_hand_derived():
    cost = CostModel(cluster("h100", 1))
    # K and V, 40 layers, 40 heads x 128 channels, 2 bytes
    assert cost.kv_bytes_per_token(model("13b")) == 2 * 40 * 5120 * 2


def test_train_state_bytes_shard_over_tp_and_pp():
    m = model("13b")
    cost = CostModel(cluster("h100", 1))
    full = cost.train_state_bytes(m, "lm", 1, 1)
    # 16 bytes per matmul weight, plus the norms' and AdamW's step counters (a few per million)
    assert full == pytest.approx(TRAIN_STATE_BYTES_PER_PARAM * m.params(), rel=1e-4)
    # 20 layers per stage, one vocabulary table on each edge stage: an even split
    assert cost.train_state_bytes(m, "lm", 4, 2) == pytest.approx(full / 8, rel=1e-3)
    # a value head: the last stage holds no vocabulary table, the first stage is the busiest
    value = cost.train_state_bytes(m, "value", 1, 2)
    assert value == pytest.approx(
        TRAIN_STATE_BYTES_PER_PARAM * (m.vocab * m.hidden + 20 * m.block_params() // m.layers), rel=1e-4
    )


def test_decode_step_is_flat_below_bs_max_and_grows_above():
    cost = CostModel(cluster("h100", 1), NO_OVERHEAD)
    m = model("13b")
    bs = cost.bs_max(m, 1)
    small, half, big = cost.decode_step_time(m, 1, np.array([1, bs // 2, 4 * bs]), np.zeros(3))
    assert half == pytest.approx(small, rel=1e-9)  # memory-bound: the weight read dominates
    assert big > 3.5 * small  # compute-bound: linear in the batch


def test_bs_max_is_peak_over_bandwidth_ratio():
    cost = CostModel(cluster("h100", 1))
    e = cost.eff
    m = model("65b")
    expected = (
        H100.peak_flops
        * e.decode_mfu
        / (H100.hbm_bw * e.decode_mbu)
        * 2
        * m.params()
        / cost.matmul_flops_per_token(m)
    )
    assert cost.bs_max(m, 8) == int(expected)
    assert 100 < cost.bs_max(m, 8) < 400


def test_decode_monotonic_in_batch_and_context():
    cost = CostModel(cluster("h100", 1))
    m = model("13b")
    batch = np.arange(1, 600, 7)
    t = cost.decode_step_time(m, 8, batch, batch * 300)
    assert np.all(np.diff(t) >= 0)
    ctx = np.linspace(0, 1e6, 50)
    t = cost.decode_step_time(m, 8, np.full(50, 32), ctx)
    assert np.all(np.diff(t) > 0)


def test_decode_small_batch_scales_with_hbm_bandwidth_only():
    m = model("33b")
    h100 = CostModel(cluster("h100", 1), NO_OVERHEAD).decode_step_time(m, 1, 4, 0)
    h200 = CostModel(cluster("h200", 1), NO_OVERHEAD).decode_step_time(m, 1, 4, 0)
    assert h100 / h200 == pytest.approx(H200.hbm_bw / H100.hbm_bw, rel=1e-9)


def test_prefill_is_compute_bound_and_monotonic():
    m = model("13b")
    seqs = [[s] * 16 for s in (64, 256, 1024, 4096)]
    cost = CostModel(cluster("h100", 1), NO_OVERHEAD)
    times = [cost.prefill_time(m, s, 1) for s in seqs]
    assert times == sorted(times) and len(set(times)) == 4
    # same peak, different HBM: prefill of a big batch costs the same on H100 and H200
    h200 = CostModel(cluster("h200", 1), NO_OVERHEAD).prefill_time(m, seqs[-1], 1)
    assert h200 == pytest.approx(times[-1], rel=1e-9)
    # A100 has 312 vs 989 TFLOP/s
    a100 = CostModel(cluster("a100", 1), NO_OVERHEAD).prefill_time(m, seqs[-1], 1)
    assert a100 / times[-1] == pytest.approx(H100.peak_flops / A100.peak_flops, rel=1e-9)


def test_mfu_saturates_at_its_ceiling():
    e = Efficiency()
    assert e.mfu(0.5, 1e12) == pytest.approx(0.5, rel=1e-6)
    assert e.mfu(0.5, e.half_tokens) == pytest.approx(0.25)
    assert e.mfu(0.5, 10) < e.mfu(0.5, 100) < e.mfu(0.5, 1000)


def test_allreduce_limits():
    cost = CostModel(cluster("h100", 2))
    assert cost.allreduce_time(1e9, 1) == 0.0
    intra = cost.allreduce_time(1e9, 8)
    inter = cost.allreduce_time(1e9, 8, inter_node=True)
    assert inter > intra > 0
    # large messages: bandwidth term 2(n-1)/n x bytes / (link x efficiency) dominates
    bw = H100.intra_bw * cost.eff.link_eff
    assert cost.allreduce_time(1e12, 8) == pytest.approx(
        2 * 7 / 8 * 1e12 / bw + H100.intra_latency, rel=1e-12
    )
    assert cost.allreduce_time(2e9, 8) > cost.allreduce_time(1e9, 8)


def test_exposed_gradient_reduction_is_what_the_last_backward_does_not_cover():
    cost = CostModel(cluster("h100", 4))
    m = model("33b")
    total = cost.grad_allreduce_time(m, "lm", 4, 4, 16)
    last = cost.allreduce_time(GRAD_BUCKET_BYTES, 16, cost.group_inter_node(4, 16))
    assert total > 10 * last > 0
    assert cost.exposed_grad_allreduce_time(m, "lm", 4, 4, 16, overlap_s=0.0) == pytest.approx(total)
    assert cost.exposed_grad_allreduce_time(m, "lm", 4, 4, 16, overlap_s=total / 2) == pytest.approx(
        total / 2
    )
    # a backward longer than the whole reduction still leaves the last bucket's own all-reduce
    assert cost.exposed_grad_allreduce_time(m, "lm", 4, 4, 16, overlap_s=10 * total) == pytest.approx(last)
    assert cost.exposed_grad_allreduce_time(m, "lm", 4, 4, 1, overlap_s=0.0) == 0.0


def test_stage_times_backward_is_twice_forward_compute_and_pp_divides_work():
    cost = CostModel(cluster("h100", 4), Efficiency())
    m = model("13b")
    f1, b1 = cost.stage_times(m, "lm", 1, 1, 32, 1, 512)
    assert b1 == pytest.approx(2 * f1, rel=1e-9)  # tp = pp = 1: no communication
    f4, _ = cost.stage_times(m, "lm", 1, 4, 8, 1, 512)
    assert f4 < f1 / 3.9  # a quarter of the layers, plus one activation send
    # more tensor parallelism: less compute per device, but never below the ideal 1/tp
    f8, _ = cost.stage_times(m, "lm", 8, 1, 4, 1, 512)
    assert f1 / 8 < f8 < f1


def test_reshard_and_swap():
    cost = CostModel(cluster("h100", 4))
    m = model("13b")
    assert cost.reshard_time(m, "lm", 8, 1, 8) == 0.0  # same layout: nothing moves
    assert cost.reshard_time(m, "lm", 8, 4, 8) < cost.reshard_time(m, "lm", 4, 4, 8)
    swap = cost.swap_in_time([(m, "lm")], 8)
    assert swap == pytest.approx(m.params() * 2 / 8 / (H100.host_bw * cost.eff.link_eff))
    assert math.isfinite(swap)


def test_fsdp_gathers_are_ring_all_gathers_of_the_padded_units():
    """An all-gather (or reduce-scatter) moves (n - 1) / n of the bytes over each link, one latency per collective
    inside a node (n - 1 across nodes); pipeline=fsdp gathers every unit once: world x its padded shards."""
    from rlhfuse.planner.memory import fsdp_padded_count

    cost = CostModel(cluster("h100", 2))
    bw = H100.intra_bw * cost.eff.link_eff
    assert cost.allgather_time(1e12, 1) == 0.0
    assert cost.allgather_time(1e12, 8) == pytest.approx(7 / 8 * 1e12 / bw + H100.intra_latency, rel=1e-12)
    assert cost.allgather_time(1e12, 8) == pytest.approx(cost.allreduce_time(1e12, 8) / 2, rel=1e-4)
    m = model("7b")
    gather = cost.fsdp_gather_time(m, "lm", 8, 2)
    assert gather == pytest.approx(
        7 / 8 * 8 * fsdp_padded_count(m, "lm", 8) * 2 / bw + (m.layers + 1) * H100.intra_latency, rel=1e-12
    )
    # 16 ranks span both nodes: the gathers cross the network
    assert cost.fsdp_gather_time(m, "lm", 16, 2) > 5 * gather
