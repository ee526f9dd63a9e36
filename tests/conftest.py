"""Test-wide environment: CPU, offline, deterministic, Triton in interpreter mode."""

import os

for _key, _value in {
    "OMP_NUM_THREADS": "1",
    "TRITON_INTERPRET": "1",
    "WANDB_MODE": "offline",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ.setdefault(_key, _value)
