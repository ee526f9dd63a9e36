"""A run of one process without Lightning: `LocalFabric` answers what the trainer and the strategies ask of a
Fabric (`rlhfuse.core.protocols.FabricLike`) for one process on one device.

Why not Lightning's own `Fabric(devices=1)`: importing `lightning.fabric` takes seconds (it imports `torchmetrics`,
which imports `transformers`), as long as a small run's first iterations, and one process uses none of what it
brings — no launcher, no process group, no strategy. (`torch._dynamo`, which Lightning imports too, loads anyway:
torch's optimizers import it when they are made.) What remains is the precision, which is torch's: nothing under
32-true, `torch.autocast` to bf16 under bf16-mixed (what Fabric's `MixedPrecision` plugin does for bf16, which
needs no gradient scaler). Runs of several processes launch through Fabric
(`rlhfuse.runtime.launch.distributed_fabric`).
"""

from __future__ import annotations

import contextlib
import random
from typing import Any, Literal, get_args

import torch

Precision = Literal["32-true", "bf16-mixed"]
LOCAL_PRECISIONS: tuple[str, ...] = get_args(Precision)
"""The resolved `pipeline.precision`s a `LocalFabric` runs (`bf16-true` resolves to 32-true over bf16 weights)."""


class LocalFabric:
    """Fabric's interface for the only process of a run, on `device`, in `precision`."""

    def __init__(self, device: torch.device | str = "cpu", precision: Precision = "32-true") -> None:
        if precision not in LOCAL_PRECISIONS:
            raise ValueError(f"LocalFabric(precision={precision!r}): known are {list(LOCAL_PRECISIONS)}")
        self._device = torch.device(device)
        self.precision = precision

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def global_rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    @property
    def is_global_zero(self) -> bool:
        return True

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.precision == "bf16-mixed":
            return torch.autocast(self._device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def backward(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        tensor.backward(*args, **kwargs)

    def seed_everything(self, seed: int | None = None, workers: bool = False, verbose: bool = True) -> int:
        """Seeds Python's, NumPy's and torch's generators as Lightning's `seed_everything` does (the same draws
        follow: a run's metrics do not depend on which of the two built it)."""
        del workers, verbose  # no data-loader workers here; nothing to print
        seed = 0 if seed is None else int(seed)
        random.seed(seed)
        import numpy as np  # torch has imported it already

        np.random.seed(seed)
        torch.manual_seed(seed)
        return seed
