"""The RLHF trainer: `RLHFTrainer` composed of parts (strategy, generator, inferencer, callbacks, loggers), its
plug points (Protocols), typed stage data and the configs.

From objects::

    from rlhfuse.trainer import RLHFTrainer, FusedPipelineStrategy, EngineGeneration, FixedMigration
    trainer = RLHFTrainer(
        strategy=FusedPipelineStrategy(actor_pp=2, critic_pp=2),
        generator=EngineGeneration(instances=2, migration=FixedMigration(threshold=0.25)),
        iterations=20,
        run_dir="runs/fused",
    )
    trainer.fit()

From the packaged configuration (the same objects)::

    from rlhfuse.trainer import compose_config, build_trainer
    cfg = compose_config(["experiment=smoke", "algorithm.kl_coef=0.05"])
    build_trainer(cfg, run_dir="runs/smoke").fit()
"""

from typing import TYPE_CHECKING

from rlhfuse._lazy import lazy_package

if TYPE_CHECKING:
    from rlhfuse.core.advantages import compute_train_batch
    from rlhfuse.core.algorithm_config import AlgorithmConfig
    from rlhfuse.core.checkpoint import load_checkpoint, save_checkpoint
    from rlhfuse.core.checkpoint_config import CheckpointConfig
    from rlhfuse.core.errors import CheckpointError, NonFiniteError
    from rlhfuse.core.inference_config import InferencerConfig
    from rlhfuse.core.optim_config import OptimConfig
    from rlhfuse.core.protocols import Callback, Generator, Inferencer, Logger, Strategy
    from rlhfuse.core.rewards import RewardSample, reward_samples
    from rlhfuse.core.sampling_config import SamplingConfig
    from rlhfuse.core.types import Experience, PromptBatch, Rollout, TrainBatch
    from rlhfuse.data.data_config import DataConfig
    from rlhfuse.generation.batched import SamplingGenerator
    from rlhfuse.generation.generation_config import EngineOptions, GenerationConfig, VLLMOptions
    from rlhfuse.trainer.async_config import AsyncConfig
    from rlhfuse.trainer.asynchronous import AsyncRollout
    from rlhfuse.trainer.build import build_trainer
    from rlhfuse.trainer.components import BuildContext
    from rlhfuse.trainer.evaluation_config import EvalConfig
    from rlhfuse.trainer.hydra import compose_config, to_config
    from rlhfuse.trainer.logging import LoggerConfig
    from rlhfuse.trainer.models_config import ModelsConfig, WarmStartConfig
    from rlhfuse.trainer.parts import (
        AutoMigration,
        DataParallelStrategy,
        EngineGeneration,
        FixedMigration,
        FSDPStrategy,
        FusedPipelineStrategy,
        GeneratorPart,
        InferencerPart,
        MigrationPart,
        ModelInference,
        NoMigrationPolicy,
        PipelineInference,
        SamplingGeneration,
        Serial1F1BStrategy,
        StrategyPart,
        VLLMGeneration,
    )
    from rlhfuse.trainer.run_config import MigrationConfig, RLHFConfig
    from rlhfuse.trainer.strategies.plain.inference import ModelInferencer
    from rlhfuse.trainer.strategies.plain.training import PlainStrategy
    from rlhfuse.trainer.trainer import RLHFTrainer
    from rlhfuse.trainer.validate import validate

# Each public name is imported from its module on first use (rlhfuse._lazy): importing the package (as
# `rlhfuse-train --help` does) loads neither torch nor Lightning, and the configs load without them.
_PUBLIC: dict[str, tuple[str, ...]] = {
    "rlhfuse.core.advantages": ("compute_train_batch",),
    "rlhfuse.core.algorithm_config": ("AlgorithmConfig",),
    "rlhfuse.core.checkpoint": ("load_checkpoint", "save_checkpoint"),
    "rlhfuse.core.checkpoint_config": ("CheckpointConfig",),
    "rlhfuse.core.errors": ("CheckpointError", "NonFiniteError"),
    "rlhfuse.core.inference_config": ("InferencerConfig",),
    "rlhfuse.core.optim_config": ("OptimConfig",),
    "rlhfuse.core.protocols": ("Callback", "Generator", "Inferencer", "Logger", "Strategy"),
    "rlhfuse.core.rewards": ("RewardSample", "reward_samples"),
    "rlhfuse.core.sampling_config": ("SamplingConfig",),
    "rlhfuse.core.types": ("Experience", "PromptBatch", "Rollout", "TrainBatch"),
    "rlhfuse.data.data_config": ("DataConfig",),
    "rlhfuse.generation.batched": ("SamplingGenerator",),
    "rlhfuse.generation.generation_config": ("EngineOptions", "GenerationConfig", "VLLMOptions"),
    "rlhfuse.trainer.async_config": ("AsyncConfig",),
    "rlhfuse.trainer.asynchronous": ("AsyncRollout",),
    "rlhfuse.trainer.build": ("build_trainer",),
    "rlhfuse.trainer.components": ("BuildContext",),
    "rlhfuse.trainer.evaluation_config": ("EvalConfig",),
    "rlhfuse.trainer.hydra": ("compose_config", "to_config"),
    "rlhfuse.trainer.logging": ("LoggerConfig",),
    "rlhfuse.trainer.models_config": ("ModelsConfig", "WarmStartConfig"),
    "rlhfuse.trainer.parts": (
        "AutoMigration",
        "DataParallelStrategy",
        "EngineGeneration",
        "FixedMigration",
        "FSDPStrategy",
        "FusedPipelineStrategy",
        "GeneratorPart",
        "InferencerPart",
        "MigrationPart",
        "ModelInference",
        "NoMigrationPolicy",
        "PipelineInference",
        "SamplingGeneration",
        "Serial1F1BStrategy",
        "StrategyPart",
        "VLLMGeneration",
    ),
    "rlhfuse.trainer.run_config": ("MigrationConfig", "RLHFConfig"),
    "rlhfuse.trainer.strategies.plain.inference": ("ModelInferencer",),
    "rlhfuse.trainer.strategies.plain.training": ("PlainStrategy",),
    "rlhfuse.trainer.trainer": ("RLHFTrainer",),
    "rlhfuse.trainer.validate": ("validate",),
}
lazy_package(__name__, _PUBLIC)

__all__ = [
    "AutoMigration",
    "DataParallelStrategy",
    "EngineGeneration",
    "FixedMigration",
    "FSDPStrategy",
    "FusedPipelineStrategy",
    "GeneratorPart",
    "InferencerPart",
    "MigrationPart",
    "ModelInference",
    "NoMigrationPolicy",
    "PipelineInference",
    "SamplingGeneration",
    "Serial1F1BStrategy",
    "StrategyPart",
    "VLLMGeneration",
    "MigrationConfig",
    "OptimConfig",
    "RewardSample",
    "reward_samples",
    "DataConfig",
    "BuildContext",
    "EvalConfig",
    "AsyncConfig",
    "AsyncRollout",
    "LoggerConfig",
    "ModelsConfig",
    "WarmStartConfig",
    "AlgorithmConfig",
    "Callback",
    "CheckpointConfig",
    "CheckpointError",
    "Experience",
    "Generator",
    "EngineOptions",
    "GenerationConfig",
    "SamplingConfig",
    "VLLMOptions",
    "Inferencer",
    "InferencerConfig",
    "Logger",
    "ModelInferencer",
    "NonFiniteError",
    "PlainStrategy",
    "PromptBatch",
    "RLHFConfig",
    "RLHFTrainer",
    "Rollout",
    "SamplingGenerator",
    "Strategy",
    "TrainBatch",
    "build_trainer",
    "compose_config",
    "compute_train_batch",
    "load_checkpoint",
    "save_checkpoint",
    "to_config",
    "validate",
]
