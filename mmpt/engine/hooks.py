"""Who is told where a step is: the hang watchdog, and observers added from outside the engine (a profiler, a
test's counter or fault injector), for the runs started inside a block (`observing`) or for every run of the
process (`observe`, e.g. from a module loaded with `launch/train.py --import`). The loop says where it is, once
per point; it never asks who listens."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

Observer = Callable[[str, int], None]  # (point, step): data, forward, backward, step, log, eval, checkpoint, save:*
LossHook = Callable[[torch.Tensor], torch.Tensor]  # the loss about to be backpropagated -> the one to use

_ADDED: list[tuple[Observer, LossHook | None]] = []


def observe(observer: Observer, loss: LossHook | None = None) -> None:
    """Tell `observer` every point the runs started from now on in this process reach; `loss`, if given,
    sees each loss about to be backpropagated and returns the one to backpropagate."""
    _ADDED.append((observer, loss))


@contextmanager
def observing(observer: Observer, loss: LossHook | None = None) -> Iterator[None]:
    """Tell `observer` every point the runs started inside this block reach (and `loss`, as for `observe`)."""
    observe(observer, loss)
    try:
        yield
    finally:
        _ADDED.remove((observer, loss))


class StepHooks:
    def __init__(self, observers: list[Observer]):
        self.observers = [*observers, *(observer for observer, _ in _ADDED)]
        self.loss_hooks = [loss for _, loss in _ADDED if loss is not None]

    def reached(self, point: str, step: int) -> None:
        for observer in self.observers:
            observer(point, step)

    def loss(self, total: torch.Tensor) -> torch.Tensor:
        """The loss about to be backpropagated: itself, unless an added hook replaces it."""
        for hook in self.loss_hooks:
            total = hook(total)
        return total
