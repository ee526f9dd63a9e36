"""Dispatch between the Triton kernels in `kernels/` and their PyTorch references.

Legend: B batch rows, T time (tokens), N flattened rows, V vocabulary.

backend = "auto" (default): the Triton kernel on CUDA tensors when triton is importable, the PyTorch reference
otherwise. "torch" or "triton" force one path; the environment variable RLHFUSE_FORCE_TRITON=1 turns "auto" into
"triton" (with TRITON_INTERPRET=1 the kernels then run on CPU tensors, which is how the parity tests run them).
triton is imported only when a kernel is first used, never at `import rlhfuse`.
"""

from __future__ import annotations

import importlib.util
import os
from functools import cache

import torch

from rlhfuse._resources import load_kernel_module
from rlhfuse.algorithms.gae import _check_gae_inputs, compute_gae_scan
from rlhfuse.algorithms.logits import chosen_logprobs_torch

_BACKENDS = ("auto", "torch", "triton")


@cache
def triton_available() -> bool:
    """Whether triton can be imported (looked up without importing it)."""
    return importlib.util.find_spec("triton") is not None


def _use_triton(backend: str | None, *tensors: torch.Tensor) -> bool:
    backend = backend or "auto"
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if backend == "auto" and os.environ.get("RLHFUSE_FORCE_TRITON", "0") == "1":
        backend = "triton"
    if backend == "torch":
        return False
    if backend == "triton":
        if not triton_available():
            raise RuntimeError("backend='triton' needs the triton package: pip install triton (Linux only)")
        on_cuda = all(t.is_cuda for t in tensors)
        if not on_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1":
            raise RuntimeError(
                "backend='triton' on CPU tensors needs TRITON_INTERPRET=1 (the interpreter); "
                "or use backend='torch'"
            )
        return True
    return triton_available() and all(t.is_cuda for t in tensors)


def gae(
    rewards_BT: torch.Tensor,
    values_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    gamma: float,
    lam: float,
    *,
    chunk_size: int = 512,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked GAE (see `rlhfuse.algorithms.gae`): `kernels/gae.py`, or the exact O(B·T) `compute_gae_scan`.

    `chunk_size` is accepted for signature compatibility with `compute_gae_matrix` and unused here.
    """
    if _use_triton(backend, rewards_BT, values_BT, mask_BT):
        _check_gae_inputs(rewards_BT, values_BT, mask_BT, gamma, lam)
        return load_kernel_module("gae").gae(rewards_BT, values_BT, mask_BT, gamma, lam)  # type: ignore[no-any-return]
    del chunk_size
    return compute_gae_scan(rewards_BT, values_BT, mask_BT, gamma, lam)


def chosen_logprobs(
    logits_NV: torch.Tensor,
    labels_N: torch.Tensor,
    temperature: float = 1.0,
    *,
    chunk_size: int = 1024,
    backend: str | None = None,
) -> torch.Tensor:
    """log softmax(x/τ)[y] per row (fp32, differentiable): `kernels/logprobs.py` or `chosen_logprobs_torch`."""
    if _use_triton(backend, logits_NV, labels_N):
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        module = load_kernel_module("logprobs")
        return module.chosen_logprobs(logits_NV, labels_N, temperature)  # type: ignore[no-any-return]
    return chosen_logprobs_torch(logits_NV, labels_N, temperature, chunk_size=chunk_size)
