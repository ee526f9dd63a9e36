"""Test-wide environment: CPU, offline, deterministic, Triton in interpreter mode, and NCCL's point-to-point
ordering emulated on gloo (`rlhfuse.distributed.ordering`): every process a test starts inherits it, so an order
NCCL would hang on hangs here too."""

import os

for _key, _value in {
    "OMP_NUM_THREADS": "1",
    "TRITON_INTERPRET": "1",
    "WANDB_MODE": "offline",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "RLHFUSE_NCCL_ORDER": "1",
}.items():
    os.environ.setdefault(_key, _value)


def pytest_collection_modifyitems(config, items):
    """Tests marked `vllm` skip, saying why, where vLLM is not installed (`make test-vllm` installs it)."""
    import importlib.util

    import pytest

    if importlib.util.find_spec("vllm") is not None:
        return
    skip = pytest.mark.skip(reason="vllm is not installed: `make test-vllm` runs these in .venv-vllm")
    for item in items:
        if item.get_closest_marker("vllm") is not None:
            item.add_marker(skip)
