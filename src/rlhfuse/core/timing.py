"""Timing device work: CUDA events on a CUDA device, `perf_counter` where compute is synchronous (the CPU).

On a GPU the host runs ahead of the device: `perf_counter` around a kernel launch measures the launch, not the
kernel, and the fused schedule search planned from such times would plan from noise. `OpTimer` records a pair of
events around each measured region instead and reads them all after one synchronisation (`seconds`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Hashable, Iterator
from typing import Any

import torch


class OpTimer:
    """Seconds of measured regions (`measure(key)`), read once at the end (`seconds()`)."""

    def __init__(self, device: torch.device) -> None:
        # a device that only reports "cuda" (the CPU test suite's stand-in) computes synchronously on the CPU
        self.device = device
        self.events = device.type == "cuda" and torch.cuda.is_available()
        self._marks: list[tuple[Hashable, Any, Any]] = []

    @contextlib.contextmanager
    def measure(self, key: Hashable) -> Iterator[None]:
        if self.events:
            start_event, end_event = (
                torch.cuda.Event(enable_timing=True),
                torch.cuda.Event(enable_timing=True),
            )
            start_event.record()
            yield
            end_event.record()
            self._marks.append((key, start_event, end_event))
        else:
            start = time.perf_counter()
            yield
            self._marks.append((key, start, time.perf_counter()))

    @property
    def pending(self) -> bool:
        """Whether regions were measured since the last `take`."""
        return bool(self._marks)

    def take(self) -> list[tuple[Hashable, float]]:
        """The regions measured since the last `take`, then forgets them. On CUDA it waits for the last region's
        end event only, not for the device: once the caller has read a result computed after that region (a
        decode step's tokens), the events are complete and reading them costs no wait."""
        marks, self._marks = self._marks, []
        if self.events:
            if marks:
                marks[-1][2].synchronize()
            return [(key, start.elapsed_time(end) / 1000.0) for key, start, end in marks]
        return [(key, end - start) for key, start, end in marks]

    def seconds(self) -> list[tuple[Hashable, float]]:
        """Every measured region's seconds, in the order measured (one device synchronisation on CUDA)."""
        if self.events:
            torch.cuda.synchronize(self.device)
            return [(key, start.elapsed_time(end) / 1000.0) for key, start, end in self._marks]
        return [(key, end - start) for key, start, end in self._marks]
