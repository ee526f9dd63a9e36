"""The run's topology is derived once from the configuration, as the strategy's part class and the registry
entries answer it (no component name is tested elsewhere): processes, generation instances, and whether the
rollout fuses inference into generation."""

from __future__ import annotations

import pytest

from rlhfuse.trainer import compose_config
from rlhfuse.trainer.components import GENERATORS
from rlhfuse.trainer.spec import compile_run, with_stop_tokens
from rlhfuse.trainer.strategies import (
    STRATEGIES,
    DataParallelStrategy,
    FSDPStrategy,
    FusedPipelineStrategy,
    RegisteredStrategy,
    Serial1F1BStrategy,
    strategy_class,
)
from rlhfuse.trainer.topology import generator_entry, topology


@pytest.fixture(autouse=True)
def _not_under_torchrun(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def test_every_registered_strategy_and_generator_says_what_it_can_do():
    facts = {
        name: (cls.whole_models, cls.instance_per_process, cls.fuses_training, cls.reshardable)
        for name in STRATEGIES.names()
        for cls in [strategy_class(name)]
    }
    assert facts == {
        "plain": (True, True, False, False),
        "fsdp": (False, True, False, True),
        "fused": (True, False, True, False),
        "serial_1f1b": (True, False, False, False),
    }
    assert {name: generator_entry(name).instances for name in GENERATORS.names()} == {
        "sampling": False,
        "engine": True,
        "vllm": True,
    }
    # a user's own builder named by import path runs under the data-parallel launch
    assert strategy_class("rlhfuse.trainer.components:model_inferencer") is RegisteredStrategy
    assert RegisteredStrategy.whole_models and RegisteredStrategy.instance_per_process


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ([], (DataParallelStrategy, 1, 1, False, False)),
        (["generator=engine", "generator.instances=2"], (DataParallelStrategy, 2, 2, True, True)),
        (
            ["generator=engine", "generator.instances=2", "generator.in_process=true"],
            (DataParallelStrategy, 1, 2, False, False),
        ),
        (["pipeline=fsdp", "generator=engine", "generator.instances=2"], (FSDPStrategy, 2, 2, False, True)),
        (["pipeline=fsdp"], (FSDPStrategy, 1, 1, False, True)),
        (
            ["pipeline=fused", "distributed.nproc_per_node=4", "generator.tp=2"],
            (FusedPipelineStrategy, 4, 2, False, True),
        ),
        (
            [
                "pipeline=serial_1f1b",
                "distributed.nproc_per_node=2",
                "generator=engine",
                "generator.instances=2",
            ],
            (Serial1F1BStrategy, 2, 2, True, True),
        ),
    ],
)
def test_the_topology_of_each_layout(overrides, expected):
    layout = topology(compose_config(overrides))
    kind, world, instances, fused, group = expected
    assert (layout.strategy, layout.world, layout.instances, layout.fused_rollout) == (
        kind,
        world,
        instances,
        fused,
    )
    assert layout.process_group is group


def test_a_run_is_compiled_once_and_the_tokenizers_stops_make_a_new_configuration():
    given = compose_config(["generator.instances=2"])  # sampling with 2 instances: the engine's
    spec = compile_run(given, log=lambda _: None)
    assert spec.config.generator.name == "engine" and given.generator.name == "sampling"
    assert spec.topology.fused_rollout and spec.counts.samples_per_iteration == 128

    class Stops:
        eos_id, stop_ids = 1, (1, 7)

    stopped = with_stop_tokens(spec.config, Stops())  # type: ignore[arg-type]
    assert stopped.generator.sampling.stop_token_ids == [7]
    assert spec.config.generator.sampling.stop_token_ids == []  # the compiled spec is left as it was


def test_the_pipeline_inferencer_is_refused_beside_a_rollout_fused_across_ranks():
    """Each rank of a fused rollout infers its own samples as they finish; the pipeline inferencer runs every
    rank on rank 0's rows, so together they would score one rank's samples twice (and drop the other's)."""
    from rlhfuse.trainer import validate

    two = [
        "pipeline=serial_1f1b",
        "distributed.nproc_per_node=2",
        "generator=engine",
        "generator.instances=2",
    ]
    validate(compose_config(two))  # the models inferencer: each rank infers its own samples
    with pytest.raises(ValueError, match=r"inferencer\.name=pipeline with generator\.instances=2"):
        validate(compose_config([*two, "inferencer.name=pipeline"]))
    validate(
        compose_config([*two[:2], "inferencer.name=pipeline"])
    )  # one instance: the training layout infers


def test_the_pipeline_layout_is_derived_once_for_validation_the_resume_check_and_the_stages(
    monkeypatch, tmp_path
):
    """compile_run's one Topology derives the pipeline layout once; validation, the resume check and the stages
    each rank builds all read it (the strategy is handed it too: `PipelineStrategy(layout=...)`)."""
    import rlhfuse.trainer.strategies.pipelines.training as runtime_strategy
    from rlhfuse.trainer.parts import FusedPipelineStrategy

    derive = runtime_strategy.pipeline_layout
    calls: list[int] = []

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        return derive(*args, **kwargs)

    monkeypatch.setattr(runtime_strategy, "pipeline_layout", counted)
    overrides = ["experiment=smoke", "model.num_layers=2", "pipeline=fused", "distributed.nproc_per_node=2",
                 "pipeline.microbatches=2", "resume=auto"]  # fmt: skip
    spec = compile_run(compose_config(overrides), log=lambda _: None)
    part = FusedPipelineStrategy.from_config(spec.config)
    part.check_resume(spec.config, spec.topology, tmp_path / "checkpoints", tmp_path)
    held = part.stages_held(spec.config, spec.topology, rank=1)
    assert held is not None and held["actor"] == (2, {1})
    assert spec.topology.stages.world_size == 2 and len(calls) == 1
