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

from rlhfuse.core.advantages import AlgorithmConfig, compute_train_batch
from rlhfuse.core.checkpoint import CheckpointConfig, load_checkpoint, save_checkpoint
from rlhfuse.core.errors import CheckpointError, NonFiniteError
from rlhfuse.core.inference import InferencerConfig
from rlhfuse.core.optim import OptimConfig
from rlhfuse.core.protocols import Callback, Generator, Inferencer, Logger, Strategy
from rlhfuse.core.rewards import RewardSample, reward_samples
from rlhfuse.core.sampling import SamplingConfig
from rlhfuse.core.types import Experience, PromptBatch, Rollout, TrainBatch
from rlhfuse.data.data_config import DataConfig
from rlhfuse.generation.batched import SamplingGenerator
from rlhfuse.generation.generation_config import EngineOptions, GenerationConfig, VLLMOptions
from rlhfuse.trainer.build import build_trainer
from rlhfuse.trainer.components import BuildContext
from rlhfuse.trainer.evaluation import EvalConfig
from rlhfuse.trainer.hydra import compose_config, to_config
from rlhfuse.trainer.logging import LoggerConfig
from rlhfuse.trainer.models import ModelsConfig, WarmStartConfig
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
