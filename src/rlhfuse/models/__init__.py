"""Decoder-only transformers (LLaMA / Qwen2), engine-owned KV cache, HF checkpoint I/O and pipeline stages."""

from rlhfuse.models.attention import ATTENTION_BACKENDS, MULTI_POSITION_BACKENDS, get_attention
from rlhfuse.models.cache import KVCache, SlotState, upload
from rlhfuse.models.hf_checkpoint import CheckpointError, from_pretrained, load_weights, save_pretrained
from rlhfuse.models.model_config import ModelConfig
from rlhfuse.models.stages import (
    Stage,
    cast_copy,
    joined,
    metered,
    resident_bytes,
    split_stages,
    stage_of,
    stage_ranges,
    to_device,
    unshared_bytes,
)
from rlhfuse.models.transformer import Transformer, load_balancing_loss, record_router_logits

__all__ = [
    "ATTENTION_BACKENDS",
    "CheckpointError",
    "MULTI_POSITION_BACKENDS",
    "KVCache",
    "ModelConfig",
    "SlotState",
    "Stage",
    "Transformer",
    "cast_copy",
    "from_pretrained",
    "get_attention",
    "joined",
    "load_balancing_loss",
    "load_weights",
    "metered",
    "record_router_logits",
    "resident_bytes",
    "save_pretrained",
    "split_stages",
    "stage_of",
    "stage_ranges",
    "to_device",
    "unshared_bytes",
    "upload",
]
