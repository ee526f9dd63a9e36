"""The closed choices of the algorithms' keyword arguments, as `Literal` types. No torch, so that the configs
naming them (`rlhfuse.core.algorithm_config`) are read without it."""

from typing import Literal

RatioLevel = Literal["token", "sequence"]
"""Which importance ratio a policy loss weighs (`rlhfuse.algorithms.losses`, module docstring)."""

OffPolicyCorrection = Literal["auto", "none", "tis", "token_mask", "sequence_mask"]
"""How the policy loss corrects for the sampler's policy differing from the one the trainer's old log-probs come
from (`rlhfuse.algorithms.off_policy`)."""
