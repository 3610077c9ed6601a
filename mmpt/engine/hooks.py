"""Who is told where a step is: the hang watchdog, observers a caller adds (`observing`), and, only when a run
asks for it (`MMPT_INJECT_FAULT`), the fault injector. The loop says where it is, once per point; it never
asks who listens."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from mmpt.engine.faults import FaultInjector

Observer = Callable[[str, int], None]  # (point, step): data, forward, backward, step, log, eval, checkpoint, save:*

_OBSERVERS: list[Observer] = []


@contextmanager
def observing(observer: Observer) -> Iterator[None]:
    """Tell `observer` every point the runs started inside this block reach (a profiler, a test's counter)."""
    _OBSERVERS.append(observer)
    try:
        yield
    finally:
        _OBSERVERS.remove(observer)


class StepHooks:
    def __init__(self, observers: list[Observer], faults: FaultInjector | None = None):
        self.observers = [*observers, *_OBSERVERS]
        self.faults = faults

    def reached(self, point: str, step: int) -> None:
        for observer in self.observers:
            observer(point, step)
        if self.faults is not None:
            self.faults.reached(point, step)

    def loss(self, total: torch.Tensor) -> torch.Tensor:
        """The loss about to be backpropagated: itself, unless an injected fault replaces it."""
        return total if self.faults is None else self.faults.loss(total)
