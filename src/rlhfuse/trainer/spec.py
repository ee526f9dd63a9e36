"""A configuration compiled once into the run it describes (`RunSpec`): the planner's layout applied (plan=auto),
the component choices the layout implies applied and printed (`resolve_components`), every problem gathered into
one error (`validate`), the topology derived (`topology`). Everything `build_trainer` builds reads the spec;
nothing after it rewrites the configuration (what the tokenizer adds makes a new one: `with_stop_tokens`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from rlhfuse.data.tokenizer import Tokenizer
from rlhfuse.trainer.device_choice import resolve_device
from rlhfuse.trainer.run_config import DerivedCounts, RLHFConfig, resolve_components
from rlhfuse.trainer.topology import Topology, topology
from rlhfuse.trainer.validate import validate


@dataclass(frozen=True)
class RunSpec:
    """The compiled run: its resolved, validated configuration, its topology and its step counts."""

    config: RLHFConfig
    topology: Topology
    counts: DerivedCounts


def compile_run(config: RLHFConfig, *, log: Callable[[str], None] = print) -> RunSpec:
    """`config` as the run it describes (see the module); raises one ValueError naming every problem."""
    if config.plan == "auto":  # the planner chooses the layout before anything is built
        from rlhfuse.trainer.planning import apply_plan

        config = apply_plan(config, resolve_device(config.device), log=log)
    config = resolve_components(config, log=log)
    # one topology: its pipeline stages are derived once, for validation and the build alike
    layout = topology(config)
    counts = validate(config, layout)
    return RunSpec(config, layout, counts)


def with_stop_tokens(config: RLHFConfig, tokenizer: Tokenizer) -> RLHFConfig:
    """`config` whose generator.stop_token_ids also hold the tokenizer's stop ids besides its EOS
    (generation_config.json's eos list), which every generator stops on; `config` itself is left as it is."""
    sampling = config.generator.sampling
    extra = set(tokenizer.stop_ids) - {tokenizer.eos_id} - set(sampling.stop_token_ids)
    if not extra:
        return config
    stops = [*sampling.stop_token_ids, *sorted(extra)]
    generator = dataclasses.replace(
        config.generator, sampling=dataclasses.replace(sampling, stop_token_ids=stops)
    )
    return dataclasses.replace(config, generator=generator)
