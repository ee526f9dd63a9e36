"""The closed choices of the algorithms' keyword arguments, as `Literal` types. No torch, so that the configs
naming them (`rlhfuse.core.algorithm_config`) are read without it."""

from typing import Literal

RatioLevel = Literal["token", "sequence"]
"""Which importance ratio a policy loss weighs (`rlhfuse.algorithms.losses`, module docstring)."""
