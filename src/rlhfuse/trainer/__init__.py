"""The RLHF trainer: `RLHFTrainer.fit()`, its plug points (Protocols), typed stage data and the configs.

Typical use from a script::

    from rlhfuse.trainer import compose_config, build_trainer
    cfg = compose_config(["experiment=smoke", "algorithm.kl_coef=0.05"])
    build_trainer(cfg, run_dir="runs/smoke").fit()
"""

from rlhfuse.core.advantages import AlgorithmConfig, compute_train_batch
from rlhfuse.core.checkpoint import CheckpointConfig, load_checkpoint, save_checkpoint
from rlhfuse.core.errors import CheckpointError, NonFiniteError
from rlhfuse.core.inference import InferencerConfig
from rlhfuse.core.protocols import Callback, Generator, Inferencer, Logger, Strategy
from rlhfuse.core.sampling import SamplingConfig
from rlhfuse.core.types import Experience, PromptBatch, Rollout, TrainBatch
from rlhfuse.generation.batched import SamplingGenerator
from rlhfuse.generation.generation_config import EngineOptions, GenerationConfig, VLLMOptions
from rlhfuse.trainer.build import build_trainer
from rlhfuse.trainer.hydra import compose_config, to_config
from rlhfuse.trainer.inferencer import ModelInferencer
from rlhfuse.trainer.run_config import RLHFConfig
from rlhfuse.trainer.strategy import PlainStrategy
from rlhfuse.trainer.trainer import RLHFTrainer
from rlhfuse.trainer.validate import validate

__all__ = [
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
