"""The RLHF trainer: `RLHFTrainer.fit()`, its plug points (Protocols), typed stage data and the configs.

Typical use from a script::

    from rlhfuse.trainer import compose_config, build_trainer
    cfg = compose_config(["experiment=smoke", "algorithm.kl_coef=0.05"])
    build_trainer(cfg, run_dir="runs/smoke").fit()
"""

from rlhfuse.trainer.advantages import AlgorithmConfig, compute_train_batch
from rlhfuse.trainer.build import build_trainer
from rlhfuse.trainer.checkpoint import CheckpointConfig, CheckpointError, load_checkpoint, save_checkpoint
from rlhfuse.trainer.config import RLHFConfig, validate
from rlhfuse.trainer.generator import GeneratorConfig, SamplingGenerator
from rlhfuse.trainer.hydra import compose_config, to_config
from rlhfuse.trainer.inferencer import InferencerConfig, ModelInferencer
from rlhfuse.trainer.protocols import Callback, Generator, Inferencer, Logger, Strategy
from rlhfuse.trainer.strategy import NonFiniteError, PlainStrategy, StrategyConfig
from rlhfuse.trainer.trainer import RLHFTrainer
from rlhfuse.trainer.types import Experience, PromptBatch, Rollout, TrainBatch

__all__ = [
    "AlgorithmConfig",
    "Callback",
    "CheckpointConfig",
    "CheckpointError",
    "Experience",
    "Generator",
    "GeneratorConfig",
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
    "StrategyConfig",
    "TrainBatch",
    "build_trainer",
    "compose_config",
    "compute_train_batch",
    "load_checkpoint",
    "save_checkpoint",
    "to_config",
    "validate",
]
