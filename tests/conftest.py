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
