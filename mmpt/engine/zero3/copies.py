"""Momentum copies under ZeRO-3, sharded like the parameters they follow.

ZeRO-3 keeps of each parameter only this rank's partition: a flat slice (`ds_tensor`) of ceil(numel / ranks)
elements, the last one zero-padded. A momentum (EMA) copy kept whole on every rank would cost each rank
the full model again, in fp32. Here each of the copy's tensors that follows a partitioned parameter is
cut the same way, so:

- the EMA update reads only this rank's own partition of the parameter: no communication at all;
- the copy's forward gathers one module's tensors at a time (a forward pre-hook) and drops them after its
  forward, as ZeRO-3 does for parameters;
- a checkpoint holds each rank's partition in that rank's model-states file (ZeRO-3 saves one per rank);
  a resume on another number of ranks rebuilds every tensor from all the saved partitions and cuts it anew.

Tensors that follow buffers of the source (BatchNorm statistics) are not partitioned by ZeRO and stay whole.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
from torch import nn

from mmpt.models.momentum import MomentumCopy, ema_


class _Partitioned(Protocol):
    """What ZeRO-3 attaches to a parameter it partitions."""

    ds_tensor: Any  # this rank's flat partition, a tensor with its length in `ds_numel`
    ds_process_group: dist.ProcessGroup


@dataclass
class _Shard:
    """A partitioned tensor's full shape, and the parameter it follows (whose partitioning it copies)."""

    shape: torch.Size
    follows: torch.Tensor

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def group(self) -> dist.ProcessGroup:
        return cast(_Partitioned, self.follows).ds_process_group


class ShardedCopies:
    """The momentum copies of a ZeRO-3 model with their parameter-following tensors partitioned."""

    def __init__(self, copies: Sequence[MomentumCopy]):
        self.copies = tuple(copies)
        self._shards: dict[int, _Shard] = {}  # id(partition tensor) -> where it lives
        by_module: dict[int, list[str]] = {}
        for copy in self.copies:
            for name, key, query in copy.pairs():
                if getattr(query, "ds_tensor", None) is None:
                    continue  # not partitioned by ZeRO-3 (a buffer of the source): stays whole
                path, _, attr = name.rpartition(".")
                module = copy.network.get_submodule(path)
                # The parameter's whole shape: a copy taken from an already partitioned model holds empty tensors.
                shard = _Shard(cast(torch.Size, getattr(query, "ds_shape", key.shape)), query)
                partition = self._cut(key, shard)
                module._buffers[attr] = partition
                self._shards[id(partition)] = shard
                if id(module) not in by_module:
                    by_module[id(module)] = []
                    module.register_forward_pre_hook(self._gather_hook)
                    module.register_forward_hook(self._release_hook, always_call=True)
                by_module[id(module)].append(attr)
        self._attrs = by_module
        self._held: dict[int, dict[str, torch.Tensor]] = {}  # a module's partitions while it runs whole

    @staticmethod
    def _cut(full: torch.Tensor, shard: _Shard) -> torch.Tensor:
        """This rank's flat partition of `full`, laid out as ZeRO-3 lays out the parameter it follows."""
        size = cast(_Partitioned, shard.follows).ds_tensor.ds_numel
        start = size * dist.get_rank(shard.group)
        flat = full.detach().reshape(-1)
        partition = torch.zeros(size, dtype=full.dtype, device=full.device)
        count = max(0, min(size, flat.numel() - start))
        partition[:count] = flat[start : start + count]
        return partition

    def is_partition(self, tensor: torch.Tensor) -> bool:
        return id(tensor) in self._shards

    def full_shape(self, tensor: torch.Tensor) -> torch.Size:
        return self._shards[id(tensor)].shape

    def full(self, tensor: torch.Tensor) -> torch.Tensor:
        """The whole tensor of which `tensor` is this rank's partition (a collective over its group)."""
        shard = self._shards[id(tensor)]
        return self._gather([tensor], [shard])[0]

    @staticmethod
    def _gather(partitions: list[torch.Tensor], shards: list[_Shard]) -> list[torch.Tensor]:
        """Whole tensors from the partitions of one module, in one all-gather."""
        group = shards[0].group
        ranks = dist.get_world_size(group)
        flat = torch.cat(partitions) if len(partitions) > 1 else partitions[0]
        gathered = flat.new_empty(ranks * flat.numel())
        dist.all_gather_into_tensor(gathered, flat, group=group)
        by_rank = gathered.view(ranks, flat.numel())
        whole, offset = [], 0
        for partition, shard in zip(partitions, shards):
            size = partition.numel()
            whole.append(by_rank[:, offset : offset + size].reshape(-1)[: shard.numel].view(shard.shape))
            offset += size
        return whole

    def _gather_hook(self, module: nn.Module, args) -> None:
        attrs = self._attrs[id(module)]
        partitions = [cast(torch.Tensor, module._buffers[a]) for a in attrs]  # set by __init__
        self._held[id(module)] = dict(zip(attrs, partitions))
        for attr, tensor in zip(attrs, self._gather(partitions, [self._shards[id(p)] for p in partitions])):
            module._buffers[attr] = tensor

    def _release_hook(self, module: nn.Module, args, output) -> None:
        module._buffers.update(self._held.pop(id(module), {}))

    @torch.no_grad()
    def update(self) -> None:
        """Every copy's EMA step: a partitioned tensor from this rank's partition of its parameter."""
        for copy in self.copies:
            for _, key, query in copy.pairs():
                ema_(key, cast(_Partitioned, query).ds_tensor if id(key) in self._shards else query, copy.momentum)

    @torch.no_grad()
    def fill(self, partition: torch.Tensor, whole: torch.Tensor) -> None:
        """Set this rank's `partition` from the whole tensor it is part of."""
        shard = self._shards[id(partition)]
        partition.copy_(self._cut(whole.to(partition.device, partition.dtype), shard))

    @torch.no_grad()
    def load_whole(self, module: nn.Module, whole: dict[str, torch.Tensor]) -> None:
        """Refill the partitions of `module`'s copies from whole tensors (state-dict names), each cut for this
        rank; a resume on another layout rebuilds them with `checkpoint.parts.whole_from_partitions`."""
        for name, tensor in module.state_dict(keep_vars=True).items():
            if id(tensor) in self._shards:
                self.fill(tensor, whole[name])

    def shapes(self, module: nn.Module) -> dict[str, list[int]]:
        """{state-dict name: full shape} of `module`'s partitioned tensors, for readers of a checkpoint."""
        return {
            name: list(self._shards[id(t)].shape)
            for name, t in module.state_dict(keep_vars=True).items()
            if id(t) in self._shards
        }


def momentum_bytes(copies: Iterable[MomentumCopy]) -> int:
    """Bytes of the copies' state on this rank, whole or partitioned."""
    return sum(b.numel() * b.element_size() for copy in copies for b in copy.buffers())
