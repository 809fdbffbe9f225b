"""Timing a step's phases on the device they run on: what the length policy learns costs from.

On a CPU a phase's work is done when its Python call returns, so wall time is its time. On a GPU the calls only
enqueue work: a phase timed on the host would count its asynchronous work in whichever later phase waits for it
(the draft's levels in verification's time). There each mark is a CUDA event recorded on the stream, and the
seconds between two are read after the step's one host read has waited for the device.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch


def cuda_event() -> Any:
    return torch.cuda.Event(enable_timing=True)


class PhaseClock:
    """Marks between a step's phases on ``device``; ``seconds(start, end)`` once the device has passed ``end``.
    ``event``: makes a device event (tests pass a stand-in)."""

    def __init__(self, device: torch.device, event: Callable[[], Any] = cuda_event) -> None:
        self.on_device = device.type == "cuda"
        self._event = event

    def mark(self) -> Any:
        if not self.on_device:
            return time.perf_counter()
        event = self._event()
        event.record()
        return event

    def seconds(self, start: Any, end: Any) -> float:
        """The time between two marks; on a GPU only after a host read that waited for ``end``'s work."""
        return start.elapsed_time(end) / 1e3 if self.on_device else end - start
