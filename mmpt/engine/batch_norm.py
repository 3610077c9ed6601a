"""Batch normalisation over the global batch: every data-parallel rank's samples in one mean and variance.

A method asks for it in `EngineNeeds.batch_norm_across_ranks`. torch's SyncBatchNorm does this on GPUs
only; this version runs wherever the process group does (gloo CPU ranks included) and swaps the class of
existing BatchNorm modules, so their parameters, buffers and names stay the objects the optimizer and
checkpoints already know.

In training mode each rank all-reduces its per-channel sample count and sum, then the sum of squared
deviations from the global mean (two passes, as exact as one process on the whole batch). The
all-reduces carry gradients (their backward sums every rank's), so each input's gradient is what a
single process normalising the whole batch would give it. Running statistics are updated from the
global statistics, hence identical on every rank. In evaluation mode nothing is communicated.
"""

from __future__ import annotations

import functools
from typing import cast

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


class _AcrossRanks(_BatchNorm):
    """Mixed in before a BatchNorm class: its training-mode forward with global batch statistics."""

    process_group: dist.ProcessGroup | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and dist.is_initialized() and dist.get_world_size(self.process_group) > 1):
            return super().forward(x)
        self._check_input_dim(x)
        dims = [0, *range(2, x.dim())]
        shape = [1, -1] + [1] * (x.dim() - 2)
        local = x.float()
        count = torch.full((1,), local.numel() / local.shape[1], dtype=torch.float32, device=x.device)
        totals = dist_fn.all_reduce(torch.cat([count, local.sum(dims)]), group=self.process_group)
        n, mean = totals[0], totals[1:] / totals[0]
        centred = local - mean.view(shape)
        var = dist_fn.all_reduce(centred.pow(2).sum(dims), group=self.process_group) / n
        if self.track_running_stats:
            self._update_running_stats(mean.detach(), var.detach() * n.detach() / (n.detach() - 1))
        y = centred * torch.rsqrt(var + self.eps).view(shape)
        if self.weight is not None and self.bias is not None:  # affine
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y.to(x.dtype)

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, unbiased_var: torch.Tensor) -> None:
        assert self.num_batches_tracked is not None and self.running_mean is not None and self.running_var is not None
        self.num_batches_tracked.add_(1)
        momentum = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        self.running_mean.lerp_(mean.to(self.running_mean.dtype), momentum)
        self.running_var.lerp_(unbiased_var.to(self.running_var.dtype), momentum)


@functools.cache
def _across_ranks_class(cls: type) -> type:
    return type(f"{cls.__name__}AcrossRanks", (_AcrossRanks, cls), {})


def batch_norm_across_ranks(model: nn.Module, group: dist.ProcessGroup | None = None) -> int:
    """Make every BatchNorm in `model` normalise over all ranks of `group` (None: all); how many there were."""
    converted = 0
    for module in model.modules():
        if isinstance(module, _BatchNorm) and not isinstance(module, (_AcrossRanks, nn.SyncBatchNorm)):
            module.__class__ = _across_ranks_class(type(module))
            cast(_AcrossRanks, module).process_group = group
            converted += 1
    return converted


class RunningStatisticsKept:
    """Within it, batch norm in training mode normalises with each batch's statistics as always but leaves its
    running statistics as they were: pooled accumulation's pool pass computes a micro-batch's features once more
    than training does, and must not count the micro-batch twice in them."""

    def __init__(self, model: nn.Module):
        self.layers = [m for m in model.modules() if isinstance(m, _BatchNorm) and m.training and m.track_running_stats]
        self._saved: list[tuple[float | None, torch.Tensor]] = []

    def __enter__(self) -> None:
        self._saved = [(m.momentum, cast(torch.Tensor, m.num_batches_tracked).clone()) for m in self.layers]
        for layer in self.layers:
            layer.momentum = 0.0  # running = (1 - 0) * running + 0 * batch: unchanged

    def __exit__(self, *exc) -> None:
        for layer, (momentum, tracked) in zip(self.layers, self._saved):
            layer.momentum = momentum
            cast(torch.Tensor, layer.num_batches_tracked).copy_(tracked)
