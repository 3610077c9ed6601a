"""Timing of work, not of launches: CUDA events on a GPU, the host clock on CPU.

On a GPU the host runs ahead of the kernels and collectives it queues, so a host clock around a
forward pass measures how long the launches took. An event recorded on the current stream marks
when the device got there; a span between two events is device time, including the time the device
sat idle waiting for the host (a slow loader shows in the data span). Events are read once per
logging window (`take()`, one synchronize), so no step waits for the host.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch


class Spans:
    """Seconds spent in named spans since the last `take()`; `start(name)`/`stop(name)` pairs may repeat."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self._open: dict[str, float | torch.cuda.Event] = {}
        self._events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self._totals: dict[str, float] = defaultdict(float)

    def _mark(self) -> float | torch.cuda.Event:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self, name: str) -> None:
        self._open[name] = self._mark()

    def stop(self, name: str) -> None:
        started, ended = self._open.pop(name), self._mark()
        if isinstance(started, torch.cuda.Event) and isinstance(ended, torch.cuda.Event):
            self._events.append((name, started, ended))
        elif isinstance(started, float) and isinstance(ended, float):
            self._totals[name] += ended - started

    def take(self) -> dict[str, float]:
        """The totals so far, then start over. On a GPU this waits for the recorded work to finish."""
        if self._events:
            self._events[-1][2].synchronize()  # events complete in stream order: the last one is the latest
            for name, started, ended in self._events:
                self._totals[name] += started.elapsed_time(ended) / 1000.0
        totals = dict(self._totals)
        self._events.clear()
        self._totals.clear()
        return totals
