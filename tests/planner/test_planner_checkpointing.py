"""The cost model's activation memory per micro-batch follows pipeline.activation_checkpointing."""

import pytest

from rlhfuse.planner import H100, CostModel, cluster, model
from rlhfuse.planner.plan_simulator import TrainLayout, activation_peak


def test_activation_bytes_shrink_with_checkpointing():
    spec, llama = cluster(H100, 1, 8), model("13b")
    by_mode = {
        mode: CostModel(spec, activation_checkpointing=mode).activation_bytes(llama, 4096, 1, llama.layers)
        for mode in ("none", "selective", "full")
    }
    # Korthikanti et al.: 34 bytes per token x hidden x layer kept; selective (attention + MLP recomputed) 17,
    # full (each layer's input only) 2
    assert by_mode["none"] == pytest.approx(34 * 4096 * llama.hidden * llama.layers)
    assert by_mode["selective"] / by_mode["none"] == pytest.approx(17 / 34)
    assert by_mode["full"] / by_mode["none"] == pytest.approx(2 / 34)


def test_unknown_mode_names_the_key():
    with pytest.raises(
        ValueError, match=r"activation_checkpointing='some'.*pipeline\.activation_checkpointing"
    ):
        CostModel(cluster(H100, 1, 8), activation_checkpointing="some").activation_bytes(
            model("13b"), 1, 1, 1
        )


def test_the_pipeline_peak_follows_the_mode():
    lay = TrainLayout(tp=1, pp=4, dp=1, micro_batch=2)
    spec, llama = cluster(H100, 1, 8), model("13b")
    none = activation_peak(CostModel(spec), llama, lay, 16, 1024.0)
    full = activation_peak(CostModel(spec, activation_checkpointing="full"), llama, lay, 16, 1024.0)
    assert full == pytest.approx(none * 2 / 34)


def test_plan_for_passes_the_mode_to_the_training_memory():
    from rlhfuse.planner import plan_for
    from rlhfuse.planner.plan_simulator import Workload

    workload = Workload(global_batch=64, mini_batch=16, max_len=256)
    plans = {
        mode: plan_for("7b", "7b", nodes=2, workload=workload, activation_checkpointing=mode)
        for mode in ("none", "full")
    }
    assert plans["full"].train.memory < plans["none"].train.memory
