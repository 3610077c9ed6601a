"""A momentum (EMA) copy of a module: MoCo's key network.

The copy's weights are buffers, not parameters: no gradient and no optimizer state, and they are
saved with the module's state. `update()` moves them towards the source,
key <- m * key + (1 - m) * query, after each optimizer step. When that runs and in which precision
the copy is kept are for the method that uses it to declare (see `VictorMethod.engine_needs`).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import torch
from torch import nn


def _parameters_to_buffers(module: nn.Module) -> None:
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is None:
                continue
            del sub._parameters[name]
            sub.register_buffer(name, param.detach().clone())


@torch.no_grad()
def ema_(key: torch.Tensor, query: torch.Tensor, momentum: float) -> None:
    """One EMA step in place, in `key`'s precision and on its device; integer tensors (counters) are copied."""
    if key.is_floating_point():
        key.lerp_(query.detach().to(key.device, key.dtype), 1.0 - momentum)
    else:
        key.copy_(query)


class MomentumCopy(nn.Module):
    """`MomentumCopy(source, m)(*args)` runs the EMA copy of `source` without gradient."""

    def __init__(self, source: nn.Module, momentum: float = 0.995):
        super().__init__()
        if not 0.0 <= momentum <= 1.0:
            raise ValueError(f"momentum must be in [0, 1], got {momentum}")
        self.momentum = momentum
        self.network = copy.deepcopy(source)
        _parameters_to_buffers(self.network)
        self.network.requires_grad_(False)
        self._source = [source]  # a list, so the source is not registered (and saved) twice

    @property
    def source(self) -> nn.Module:
        return self._source[0]

    def pairs(self) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
        """(name, the copy's tensor, the source's parameter or buffer it follows) for every tensor of the copy."""
        mine = dict(self.network.named_buffers())
        for name, tensor in (*self.source.named_parameters(), *self.source.named_buffers()):
            yield name, mine[name], tensor

    @torch.no_grad()
    def update(self) -> None:
        """key <- m * key + (1 - m) * source, in the copy's precision; integer buffers (counters) are copied."""
        for _, key, query in self.pairs():
            ema_(key, query, self.momentum)

    @torch.no_grad()
    def reset(self) -> None:
        """key <- source: after the source was loaded from a checkpoint, start the copy from the same weights."""
        for _, key, query in self.pairs():
            key.copy_(query)

    @torch.no_grad()
    def forward(self, *args, **kwargs):
        return self.network(*args, **kwargs)
