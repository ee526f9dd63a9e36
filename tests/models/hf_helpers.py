"""Helpers for tiny random Hugging Face checkpoints, shared by the models tests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

HF_COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # grouped-query attention: 2 query heads per kv head
    max_position_embeddings=256,
)


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """HF initialises biases to 0 and norms to 1; random values make every mapped tensor count in parity."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1.0 + 0.1 * noise if "norm" in name else 0.1 * noise)


def write_hf(model: torch.nn.Module, path: Path, **save_kwargs) -> Path:
    model.save_pretrained(path, safe_serialization=True, **save_kwargs)
    return path


def exact_norms_(model: torch.nn.Module) -> None:
    """transformers' RMSNorms round through float32 even for float64 inputs (~1e-6 on the logits); for a float64
    reference, run them in the input's dtype, so that a comparison measures the architecture, not that rounding."""

    def forward(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.variance_epsilon))

    def gemma_forward(self, x):  # Gemma stores the scale minus one
        return (1.0 + self.weight) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    for module in model.modules():
        name = type(module).__name__
        if name.endswith("RMSNorm"):
            module.forward = (gemma_forward if name.startswith("Gemma") else forward).__get__(module)


@contextlib.contextmanager
def float64_softmax() -> Iterator[None]:
    """transformers' eager attention (Gemma 2's only one: its soft-cap has no SDPA kernel) takes the softmax in
    float32 even for float64 scores; inside the block the float64 reference keeps float64."""
    softmax = torch.nn.functional.softmax

    def keep_float64(x, dim=None, _stacklevel=3, dtype=None):
        return softmax(x, dim=dim, dtype=None if x.dtype == torch.float64 else dtype)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.nn.functional, "softmax", keep_float64)
        yield
