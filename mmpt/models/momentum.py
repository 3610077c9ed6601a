"""A momentum (EMA) copy of a module: MoCo's key network.

The copy's weights are buffers, not parameters: no gradient, no optimizer state, never partitioned by
ZeRO-3, and saved with the module's state in every checkpoint. `update()` moves them towards the source,
key <- m * key + (1 - m) * query, after each optimizer step (the engine calls `after_optimizer_step`
with the source's full parameters in place, whatever the ZeRO stage).

The copy keeps its weights in fp32 whatever the training precision (`keeps_fp32_buffers`): with
m = 0.995 an update moves a weight by 0.5% of its distance to the query weight, less than bf16 can
represent for most steps, so a bf16 average would stop moving. Its forward runs under autocast to the
precision of the source's parameters.
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


class MomentumCopy(nn.Module):
    """`MomentumCopy(source, m)(*args)` runs the EMA copy of `source` without gradient."""

    keeps_fp32_buffers = True  # the engine leaves these buffers in fp32 under bf16/fp16 training

    def __init__(self, source: nn.Module, momentum: float = 0.995):
        super().__init__()
        if not 0.0 <= momentum <= 1.0:
            raise ValueError(f"momentum must be in [0, 1], got {momentum}")
        self.momentum = momentum
        self.network = copy.deepcopy(source).float()
        _parameters_to_buffers(self.network)
        self.network.requires_grad_(False)
        self._source = [source]  # a list, so the source is not registered (and saved) twice

    @property
    def source(self) -> nn.Module:
        return self._source[0]

    def source_parameters(self) -> Iterator[nn.Parameter]:
        """What must be whole on this rank while `update` runs (the engine gathers them under ZeRO-3)."""
        return self.source.parameters()

    def _pairs(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        mine = dict(self.network.named_buffers())
        for name, tensor in (*self.source.named_parameters(), *self.source.named_buffers()):
            yield mine[name], tensor

    @torch.no_grad()
    def update(self) -> None:
        """key <- m * key + (1 - m) * source, computed in fp32; integer buffers (counters) are copied."""
        for key, query in self._pairs():
            if key.is_floating_point():
                key.lerp_(query.detach().to(key.dtype), 1.0 - self.momentum)
            else:
                key.copy_(query)

    @torch.no_grad()
    def reset(self) -> None:
        """key <- source: after the source was loaded from a checkpoint, start the copy from the same weights."""
        for key, query in self._pairs():
            key.copy_(query)

    def after_optimizer_step(self) -> None:
        self.update()

    @torch.no_grad()
    def forward(self, *args, **kwargs):
        dtype = next(self.source.parameters()).dtype  # the precision the query network trains in
        if dtype == torch.float32:
            return self.network(*args, **kwargs)
        device = next(self.network.buffers()).device.type
        with torch.autocast(device, dtype=dtype):
            outputs = self.network(*args, **kwargs)
        return _cast(outputs, dtype)


def _cast(value, dtype: torch.dtype):
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(_cast(v, dtype) for v in value)
    return value
