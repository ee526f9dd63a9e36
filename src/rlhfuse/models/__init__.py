"""Decoder-only transformers (LLaMA / Qwen2), engine-owned KV cache, HF checkpoint I/O and pipeline stages."""

from rlhfuse.models.attention import ATTENTION_BACKENDS, MULTI_POSITION_BACKENDS, get_attention
from rlhfuse.models.cache import KVCache, SlotState
from rlhfuse.models.checkpoint import CheckpointError, from_pretrained, save_pretrained
from rlhfuse.models.config import ModelConfig
from rlhfuse.models.stages import Stage, split_stages
from rlhfuse.models.transformer import Transformer

__all__ = [
    "ATTENTION_BACKENDS",
    "CheckpointError",
    "MULTI_POSITION_BACKENDS",
    "KVCache",
    "ModelConfig",
    "SlotState",
    "Stage",
    "Transformer",
    "from_pretrained",
    "get_attention",
    "save_pretrained",
    "split_stages",
]
