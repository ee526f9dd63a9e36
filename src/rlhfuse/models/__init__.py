"""Decoder-only transformers (LLaMA / Qwen2), engine-owned KV cache, HF checkpoint I/O and pipeline stages."""

from typing import TYPE_CHECKING

from rlhfuse._lazy import lazy_package

if TYPE_CHECKING:
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

# The public names are imported from their modules on first use (rlhfuse._lazy): importing one module of
# the package does not load the others (`rlhfuse-train --help` reads the configs without torch).
_PUBLIC: dict[str, tuple[str, ...]] = {
    "rlhfuse.models.attention": ("ATTENTION_BACKENDS", "MULTI_POSITION_BACKENDS", "get_attention"),
    "rlhfuse.models.cache": ("KVCache", "SlotState", "upload"),
    "rlhfuse.models.hf_checkpoint": ("CheckpointError", "from_pretrained", "load_weights", "save_pretrained"),
    "rlhfuse.models.model_config": ("ModelConfig",),
    "rlhfuse.models.stages": (
        "Stage",
        "cast_copy",
        "joined",
        "metered",
        "resident_bytes",
        "split_stages",
        "stage_of",
        "stage_ranges",
        "to_device",
        "unshared_bytes",
    ),
    "rlhfuse.models.transformer": ("Transformer", "load_balancing_loss", "record_router_logits"),
}
lazy_package(__name__, _PUBLIC)

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
