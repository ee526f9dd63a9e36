"""`plan=auto`: the execution-plan generator chooses the run's layout before any model is built."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from rlhfuse.planner.plan_simulator import TrainLayout, TrainResult
from rlhfuse.planner.specs import gpu_preset
from rlhfuse.trainer import build_trainer, compose_config, planning, validate
from rlhfuse.trainer.planning import plan_config
from rlhfuse.trainer.run_config import resolve_components
from rlhfuse.trainer.strategies.pipelines.config import validate_runtime

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "smoke_metrics.json"


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("warmstart-cache"))


@pytest.fixture(autouse=True)
def _single_process_env(monkeypatch):
    for key in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)


def test_plan_manual_is_the_default_and_changes_nothing(monkeypatch, cache_dir, tmp_path):
    default = compose_config([])
    assert default.plan == "manual"
    assert compose_config(["plan=manual"]) == default

    def boom(*args, **kwargs):
        raise AssertionError("plan=manual must not call the planner")

    monkeypatch.setattr(planning, "apply_plan", boom)
    monkeypatch.setattr(planning, "plan_config", boom)
    cfg = compose_config(["experiment=smoke", f"model.warmstart.cache_dir={cache_dir}"])
    trainer = build_trainer(cfg, run_dir=tmp_path, log=lambda _: None)
    # the configuration as given, with only the printed component rules applied (off_policy_correction=auto)
    assert trainer.config == resolve_components(cfg, log=lambda _: None)


def test_unknown_plan_value_names_the_key():
    with pytest.raises(ValueError, match=r"plan='sometimes' is not one of \['manual', 'auto'\]"):
        validate(compose_config(["plan=sometimes"]))


def test_plan_auto_on_one_process_keeps_plain_and_produces_a_plan():
    cfg = compose_config(["plan=auto"])
    result = plan_config(cfg, "cpu", "test")
    assert result.config.pipeline.name == "plain"
    assert result.config == cfg  # nothing to change in one process with one generation instance
    assert result.plan.cluster.gpus == 1 and result.plan.breakdown.total > 0
    table = "\n".join(result.table())
    for task, _ in result.plan.layout_rows():
        assert task in table
    assert "predicted iteration" in table
    validate(result.config)


@pytest.mark.parametrize("extra", [[], ["model.num_layers=4", "data.mini_batch_size=32"]])
def test_plan_auto_on_two_processes_passes_the_runtime_validation(extra):
    cfg = compose_config(["plan=auto", "distributed.nproc_per_node=2", *extra])
    # the manual default is refused on 2 processes (pipeline=plain runs in one process) ...
    assert validate_runtime(cfg.pipeline_run())
    result = plan_config(cfg, "cpu", "test")
    planned = result.config
    # ... the planned one is not
    assert validate_runtime(planned.pipeline_run()) == []
    validate(planned)
    a, c = result.plan.train.actor, result.plan.train.critic
    assert planned.pipeline.name == ("fused" if result.plan.train.mode == "fused" else "serial_1f1b")
    assert (planned.pipeline.actor_pp, planned.pipeline.critic_pp) == (a.pp, c.pp)
    assert a.pp * a.dp == c.pp * c.dp == 2 and a.tp == c.tp == 1
    assert planned.pipeline.microbatches >= 1
    # only the planned keys moved
    assert dataclasses.replace(planned, pipeline=cfg.pipeline) == cfg


def test_plan_auto_sets_the_migration_threshold_with_several_instances():
    cfg = compose_config(["plan=auto", "generator.instances=2", "migration=auto"])
    result = plan_config(cfg, "cpu", "test")
    mig = result.config.migration
    plan = result.migration_plan
    assert plan is not None and plan.cluster.gpus == 2
    if plan.rt_fraction is None:
        assert mig.name == "off"
    else:
        assert (
            mig.name == "auto" and mig.threshold == pytest.approx(plan.rt_fraction) and 0 < mig.threshold < 1
        )
    validate(result.config)


def _fake_plan(actor_pp, critic_pp, world):
    def fake(*args, **kwargs):
        from rlhfuse.planner.api import plan_for as real

        plan = real(*args, **kwargs)
        train = TrainResult(
            "serial",
            TrainLayout(1, actor_pp, world // actor_pp, 1),
            TrainLayout(1, critic_pp, world // critic_pp, 1),
            1.0,
            1.0,
            0.0,
            1,
        )
        return dataclasses.replace(plan, train=train)

    return fake


def test_an_inapplicable_plan_fails_naming_the_key(monkeypatch):
    # Actor on 2 stages, Critic on 3: the runtime's co-located layout needs one pp to divide the other
    monkeypatch.setattr(planning, "plan_for", _fake_plan(2, 3, 6))
    cfg = compose_config(["plan=auto", "distributed.nproc_per_node=6", "model.num_layers=6"])
    with pytest.raises(ValueError, match=r"plan=auto: .*pipeline\.actor_pp=2 cannot be applied"):
        plan_config(cfg, "cpu", "test")


def test_a_plan_the_runtime_refuses_fails_naming_the_key():
    # a pipeline setting the runtime refuses: plan=auto says so instead of falling back to plain
    cfg = compose_config(["plan=auto", "distributed.nproc_per_node=2", "pipeline.prefetch=-1"])
    with pytest.raises(
        ValueError, match=r"plan=auto: the chosen plan .* cannot run:\n.*pipeline\.prefetch=-1"
    ):
        plan_config(cfg, "cpu", "test")
    # checkpoints no longer stop a pipeline plan (the pipeline strategies write sharded ones)
    plan_config(
        compose_config(["plan=auto", "distributed.nproc_per_node=2", "checkpoint.every=5"]), "cpu", "test"
    )


def test_tied_embeddings_with_stages_fail_naming_the_key(monkeypatch, tmp_path):
    hf = {
        "model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2, "tie_word_embeddings": True,
    }  # fmt: skip
    for name in ("sft", "rm"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(hf))
    monkeypatch.setattr(planning, "plan_for", _fake_plan(2, 2, 2))
    cfg = compose_config(
        [
            "plan=auto", "distributed.nproc_per_node=2", f"model.sft_path={tmp_path / 'sft'}",
            f"model.reward_path={tmp_path / 'rm'}", "data.source=file", "data.path=p.jsonl",
        ]
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"pipeline\.actor_pp=2.*tie_word_embeddings"):
        plan_config(cfg, "cpu", "test")


def test_gpu_preset_rule():
    assert gpu_preset("NVIDIA H200", 141e9)[0] == "h200"
    assert gpu_preset("NVIDIA H100 80GB HBM3", 80e9)[0] == "h100"
    assert gpu_preset("NVIDIA A100-SXM4-80GB", 80e9)[0] == "a100"
    preset, why = gpu_preset("NVIDIA L40S", 48e9)
    assert preset in ("a100", "h100") and "nearest memory" in why
    assert planning.device_preset(torch.device("cpu"))[0] == "cpu"


def test_smoke_experiment_runs_end_to_end_with_plan_auto(cache_dir, tmp_path):
    logged: list[str] = []
    cfg = compose_config(["experiment=smoke", "plan=auto", f"model.warmstart.cache_dir={cache_dir}"])
    trainer = build_trainer(cfg, run_dir=tmp_path / "run", log=logged.append)
    history = trainer.fit()
    assert len(history) == 3
    text = "\n".join(logged)
    assert "plan=auto:" in text and "training schedule" in text and "predicted iteration" in text
    # one process, one instance: the plan keeps the smoke job as it is (same metrics as the golden run)
    expected = json.loads(GOLDEN.read_text())
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for row, e in zip(rows, expected):
        for key in e:
            assert row[key] == pytest.approx(e[key], rel=1e-4, abs=1e-6), key


def _fake_tp_plan(actor_tp, critic_tp, gen_tp, world):
    def fake(*args, **kwargs):
        from rlhfuse.planner.api import plan_for as real

        assert kwargs["max_tp"] == world  # tp up to one node's devices
        plan = real(*args, **kwargs)
        train = TrainResult(
            "fused",
            TrainLayout(actor_tp, 2, world // (2 * actor_tp), 1),
            TrainLayout(critic_tp, 2, world // (2 * critic_tp), 1),
            1.0,
            1.0,
            0.0,
            1,
        )
        return dataclasses.replace(plan, train=train, gen_tp=gen_tp)

    return fake


def test_plan_auto_applies_tensor_parallelism(monkeypatch):
    """A plan with tp = 2 for both models and the generation sets pipeline.actor_tp / critic_tp and generator.tp
    and passes the runtime's validation; unequal tp fails naming the keys; a generation tp other than the
    training tp is applied."""
    cfg = compose_config(["plan=auto", "distributed.nproc_per_node=4"])
    monkeypatch.setattr(planning, "plan_for", _fake_tp_plan(2, 2, 2, 4))
    result = plan_config(cfg, "cpu", "test")
    p = result.config.pipeline
    assert (p.name, p.actor_pp, p.critic_pp, p.actor_tp, p.critic_tp) == ("fused", 2, 2, 2, 2)
    assert result.config.generator.tp == 2
    assert ("pipeline.actor_tp", 2) in result.applied and ("generator.tp", 2) in result.applied
    assert validate_runtime(result.config.pipeline_run()) == []
    # unequal tp: the Critic's 2 stages of tp=1 merge onto one tp=2 group (2 Critic replicas)
    monkeypatch.setattr(planning, "plan_for", _fake_tp_plan(2, 1, 1, 4))
    result = plan_config(cfg, "cpu", "test")
    p = result.config.pipeline
    assert (p.actor_pp, p.critic_pp, p.actor_tp, p.critic_tp) == (2, 2, 2, 1)
    assert ("pipeline.critic_tp", 1) in result.applied
    assert validate_runtime(result.config.pipeline_run()) == []
    # a generation tp other than the training tp is resharded to (rlhfuse.runtime.reshard): applied
    monkeypatch.setattr(planning, "plan_for", _fake_tp_plan(1, 1, 2, 4))
    result = plan_config(cfg, "cpu", "test")
    assert (result.config.pipeline.actor_tp, result.config.generator.tp) == (1, 2)
    assert ("generator.tp", 2) in result.applied and validate_runtime(result.config.pipeline_run()) == []


def test_plan_auto_chooses_tensor_parallelism_the_runtime_runs():
    """A LLaMA-7B-shaped model on 8 H100s (fp32 weights under bf16-mixed, Ref / Reward resident, a bf16
    generation copy: what the runtime holds): the real planner chooses tp > 1 for training and generation, and
    the plan applies and passes the runtime's validation."""
    shape = ["model.num_layers=32", "model.hidden_size=4096", "model.num_heads=32", "model.num_kv_heads=32",
             "model.head_dim=128", "model.intermediate_size=11008"]  # fmt: skip
    result = plan_config(
        compose_config(["plan=auto", "distributed.nproc_per_node=8", *shape]), "h100", "test"
    )
    p = result.config.pipeline
    assert p.actor_tp == p.critic_tp > 1 and result.config.generator.tp > 1
    assert validate_runtime(result.config.pipeline_run()) == []


def _plan_on_8_h100s(tmp_path, shapes):
    """plan=auto for Llama config.json files of `shapes` (sft, rm) on 8 H100s."""
    for name, shape in shapes.items():
        (tmp_path / name).mkdir()
        hf = {"model_type": "llama", "vocab_size": 32000, "tie_word_embeddings": False, **shape}
        (tmp_path / name / "config.json").write_text(json.dumps(hf))
    cfg = compose_config(
        [
            "plan=auto", "distributed.nproc_per_node=8", f"model.sft_path={tmp_path / 'sft'}",
            f"model.reward_path={tmp_path / 'rm'}", "data.source=file", "data.path=p.jsonl",
        ]
    )  # fmt: skip
    return plan_config(cfg, "h100", "test")


def test_plan_auto_chooses_merged_stages_the_runtime_runs(tmp_path):
    """A 30-layer Actor (48 heads, 8 kv heads) and a 2-layer Critic / Reward with 2 kv heads on 8 H100s: the
    Critic cannot follow the Actor to tp=4 (tp divides the kv heads) nor split into more than 2 stages, so the
    real planner chooses Actor tp=4 x pp=2 beside a Critic at tp=2, whose two consecutive stages merge onto one
    tp=4 group (`ParallelLayout.merge`), costed as the runtime runs them; the plan applies and validates."""
    shapes = {
        "sft": {"num_hidden_layers": 30, "hidden_size": 6144, "num_attention_heads": 48, "num_key_value_heads": 8,
                "intermediate_size": 16576},
        "rm": {"num_hidden_layers": 2, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 2,
               "intermediate_size": 11008},
    }  # fmt: skip
    result = _plan_on_8_h100s(tmp_path, shapes)
    train = result.plan.train
    p = result.config.pipeline
    assert (p.actor_tp, p.critic_tp) == (train.actor.tp, train.critic.tp)
    assert p.actor_tp != p.critic_tp and train.merged
    assert validate_runtime(result.config.pipeline_run()) == []
    from rlhfuse.trainer.strategies.pipelines.training import pipeline_layout

    layout = pipeline_layout(p, 8, result.config.data.mini_batch_size, 1)
    narrow = "actor" if p.actor_tp < p.critic_tp else "critic"
    assert layout.merge(narrow) > 1


def test_plan_device_prices_plan_auto_with_a_device_file_and_bad_ones_name_the_key(tmp_path):
    """plan_device=FILE (`rlhfuse-plan calibrate --from gpu_check.json`): plan=auto uses the file's device and
    factors in place of the preset; a missing or malformed file, or plan=manual, is a problem naming the key."""
    from rlhfuse.planner.specs import H100, DeviceProfile, Efficiency

    slow = DeviceProfile(dataclasses.replace(H100, name="H100 (calibrated)"), Efficiency(decode_mbu=0.1))
    path = slow.save(tmp_path / "h100.json")
    cfg = compose_config(["plan=auto", "distributed.nproc_per_node=2", f"plan_device={path}"])
    result = plan_config(cfg, DeviceProfile.load(path), f"plan_device={path}")
    validate(result.config)
    assert result.plan.cluster.device.name == "H100 (calibrated)" and result.device == "H100 (calibrated)"
    assert f"plan_device={path}" in result.table()[0]
    preset = plan_config(cfg, "h100", "test")
    assert result.plan.breakdown.generation > preset.plan.breakdown.generation  # decode at 1/7 the bandwidth
    with pytest.raises(ValueError, match=r"plan_device=.* is read by plan=auto only: set plan=auto"):
        validate(compose_config([f"plan_device={path}"]))
    missing = compose_config(["plan=auto", f"plan_device={tmp_path / 'none.json'}"])
    with pytest.raises(ValueError, match=r"plan_device: device file .*none.json does not exist"):
        validate(missing)
    with pytest.raises(ValueError, match=r"^plan_device: device file .*none.json does not exist"):
        planning.apply_plan(
            missing, torch.device("cpu"), log=lambda _: None
        )  # before validate, in build_trainer


def test_plan_auto_may_choose_uneven_stages_the_runtime_splits(tmp_path):
    """A 30-layer Actor beside a 24-layer Critic with 2 kv heads (tp <= 2) on 8 H100s: 30 layers over 4 stages
    (the slowest holding 8). The runtime splits any layer count (`stage_ranges`), so plan=auto plans with uneven pipelines
    too, and the plan it applies validates."""
    from rlhfuse.models import stage_ranges

    shapes = {
        "sft": {"num_hidden_layers": 30, "hidden_size": 6144, "num_attention_heads": 48, "num_key_value_heads": 8,
                "intermediate_size": 16576},
        "rm": {"num_hidden_layers": 24, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 2,
               "intermediate_size": 11008},
    }  # fmt: skip
    result = _plan_on_8_h100s(tmp_path, shapes)
    p = result.config.pipeline
    assert 30 % p.actor_pp, "the chosen Actor pipeline splits 30 layers unevenly"
    # the slowest stage holds ceil(30 / pp) layers, as the planner costs it
    assert max(hi - lo for lo, hi in stage_ranges(30, p.actor_pp)) == -(-30 // p.actor_pp)
    assert validate_runtime(result.config.pipeline_run()) == []


def _hf_job(tmp_path, shape):
    """plan=auto on 8 processes for a Llama config.json of `shape` (Actor and reward model), with a prompts file."""
    for name in ("sft", "rm"):
        (tmp_path / name).mkdir()
        hf = {"model_type": "llama", "vocab_size": 128256, **shape}
        (tmp_path / name / "config.json").write_text(json.dumps(hf))
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "hello"}) + "\n")
    return compose_config(
        [
            "plan=auto", "distributed.nproc_per_node=8", f"model.sft_path={tmp_path / 'sft'}",
            f"model.reward_path={tmp_path / 'rm'}", "data.source=file", f"data.path={tmp_path / 'p.jsonl'}",
        ]
    )  # fmt: skip


def test_plan_auto_chooses_fsdp_where_no_pipeline_fits_and_the_config_validates(tmp_path):
    """Llama-3.2-3B's shape, whose embedding is its LM head (tie_word_embeddings), on 8 H100s: the runtime runs it
    only at pp = tp = 1 under the pipeline strategies, whole replicas whose training state does not fit, so
    plan=auto chooses pipeline=fsdp (every model sharded over the 8), one generation instance per process, and the
    configuration it writes passes `validate`."""
    shape = {"num_hidden_layers": 28, "hidden_size": 3072, "num_attention_heads": 24, "num_key_value_heads": 8,
             "intermediate_size": 8192, "head_dim": 128, "tie_word_embeddings": True}  # fmt: skip
    cfg = _hf_job(tmp_path, shape)
    result = plan_config(cfg, "h100", "test")
    planned, train = result.config, result.plan.train
    assert train.mode == "fsdp" and (train.actor.dp, train.actor.pp, train.actor.tp) == (8, 1, 1)
    p, g = planned.pipeline, planned.generator
    assert (p.name, p.reshard_after_forward, p.actor_tp, p.critic_tp) == (
        "fsdp",
        train.reshard_after_forward,
        1,
        1,
    )
    assert (g.instances, g.tp, planned.migration.name) == (8, 1, "off")
    assert planned.data.micro_batch_size == train.actor.micro_batch
    assert ("pipeline", "fsdp") in result.applied and ("generator.instances", 8) in result.applied
    validate(planned)
    # only the planned keys moved
    unplanned = dataclasses.replace(
        planned, pipeline=cfg.pipeline, generator=cfg.generator, migration=cfg.migration, data=cfg.data
    )
    assert unplanned == cfg
    table = "\n".join(result.table())
    assert "pipeline=fsdp" in table and "fsdp over 8 ranks" in table


def test_plan_auto_keeps_a_pipeline_where_fsdp_fits_but_is_slower():
    """The LLaMA-7B-shaped embedded model on 8 H100s: pipeline=fsdp fits (its shards, its rollout's KV cache and
    the layers it gathers), but the planner predicts the tensor- and pipeline-parallel plan faster, which is the
    one applied."""
    from rlhfuse.planner import CostModel, RLHFModels, cluster
    from rlhfuse.planner.plan_search import PruneStats, fsdp_plan, search_fsdp

    shape = ["model.num_layers=32", "model.hidden_size=4096", "model.num_heads=32", "model.num_kv_heads=32",
             "model.head_dim=128", "model.intermediate_size=11008"]  # fmt: skip
    cfg = compose_config(["plan=auto", "distributed.nproc_per_node=8", *shape])
    result = plan_config(cfg, "h100", "test")
    assert result.config.pipeline.name in ("fused", "serial_1f1b") and result.plan.train.mode != "fsdp"
    actor, critic = planning.model_shapes(cfg)
    models = RLHFModels(actor.spec, critic.spec)
    cost = CostModel(cluster("h100", 1, 8, 8), **planning.memory_facts(cfg, "gpu"))
    workload = planning.workload_for(cfg)
    samples = workload.sample()
    stats = PruneStats()
    sharded = [
        fsdp_plan(cost, models, workload, samples, t, fused=True, stats=stats, cache={})
        for t in search_fsdp(cost, models, workload, float(samples.seq.mean()), stats)
    ]
    fitting = [p for p in sharded if p is not None]
    assert fitting and min(p.breakdown.total for p in fitting) > result.plan.breakdown.total
