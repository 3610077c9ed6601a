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

Mark = float | torch.cuda.Event


class Clock:
    """The one device-or-host clock: `mark()` is a CUDA event recorded on the current stream on a GPU, the
    host's `time.perf_counter()` on CPU; `seconds(start, end)` is the time between two marks (on a GPU only
    once the later event has completed: `wait(end)`)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def mark(self) -> Mark:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @staticmethod
    def wait(mark: Mark) -> None:
        """Until the work before `mark` has finished (nothing to wait for on the host clock)."""
        if isinstance(mark, torch.cuda.Event):
            mark.synchronize()

    @staticmethod
    def seconds(start: Mark, end: Mark) -> float:
        if isinstance(start, torch.cuda.Event) and isinstance(end, torch.cuda.Event):
            return start.elapsed_time(end) / 1000.0
        if isinstance(start, float) and isinstance(end, float):
            return end - start
        raise TypeError("two marks of one clock")


class Spans:
    """Seconds spent in named spans since the last `take()`; `start(name)`/`stop(name)` pairs may repeat."""

    def __init__(self, cuda: bool):
        self.clock = Clock(cuda)
        self._open: dict[str, Mark] = {}
        self._marks: list[tuple[str, Mark, Mark]] = []

    def start(self, name: str) -> None:
        self._open[name] = self.clock.mark()

    def stop(self, name: str) -> None:
        started = self._open.pop(name)
        self._marks.append((name, started, self.clock.mark()))

    def take(self) -> dict[str, float]:
        """The totals so far, then start over. On a GPU this waits for the recorded work to finish."""
        totals: dict[str, float] = defaultdict(float)
        if self._marks:
            self.clock.wait(self._marks[-1][2])  # marks complete in stream order: the last one is the latest
        for name, started, ended in self._marks:
            totals[name] += self.clock.seconds(started, ended)
        self._marks.clear()
        return dict(totals)
