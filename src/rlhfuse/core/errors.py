"""Errors shared across packages (each names what was wrong and what to do)."""

from __future__ import annotations


class NonFiniteError(FloatingPointError):
    """A loss or gradient norm became NaN/inf; raised before the optimizer step, so weights stay finite."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, tampered with or unreadable."""
