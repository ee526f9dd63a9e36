"""Alias of `rlhfuse.algorithms.ops` (Triton kernel dispatch), kept for the name the docs have always shown."""

from rlhfuse.algorithms.ops import chosen_logprobs, gae, triton_available

__all__ = ["chosen_logprobs", "gae", "triton_available"]
