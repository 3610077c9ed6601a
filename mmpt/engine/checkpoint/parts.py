"""What the checkpointer asks of the run's stateful parts; it names no part itself.

Two kinds:
- a rank's own state (data position, RNG, ...): `RankPart`, registered by name with the checkpointer and
  saved in `rank_<r>.pt`;
- module tensors kept as per-rank partitions by something other than ZeRO (e.g. ZeRO-3-sharded momentum
  copies): `PartitionedTensors`, which the checkpointer gathers for the final weights and cuts again when
  the buffers are restored on another number of ranks.

Everything else a model holds (parameters, buffers such as queues) travels in DeepSpeed's module state.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import nn


class RankPart(Protocol):
    def state_dict(self) -> Any:
        """This rank's state, as saved in `rank_<r>.pt` (torch.load-able with weights_only)."""
        ...

    def load_state_dict(self, state: Any) -> None:
        """Continue exactly from `state`, saved by this rank in the same layout."""
        ...

    def load_resharded(self, states: Sequence[Any], step: int) -> None:
        """Continue from every saved rank's `states` (rank order), saved in another layout, at `step`."""
        ...


class PartitionedTensors(Protocol):
    def is_partition(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` (a module's state-dict entry) is this rank's partition of a larger tensor."""
        ...

    def full(self, tensor: torch.Tensor) -> torch.Tensor:
        """The whole tensor of a partition (a collective: every rank calls it)."""
        ...

    def full_shape(self, tensor: torch.Tensor) -> Sequence[int]: ...

    def shapes(self, module: nn.Module) -> dict[str, list[int]]:
        """{state-dict name: full shape} of the partitions in `module`, saved for readers of a checkpoint."""
        ...

    def load_whole(self, module: nn.Module, whole: dict[str, torch.Tensor]) -> None:
        """Refill this rank's partitions from whole tensors (state-dict names)."""
        ...


def whole_from_partitions(name: str, parts: Sequence[torch.Tensor], shape: Sequence[int]) -> torch.Tensor:
    """The tensor `name` of `shape` from the flat partitions every rank saved (rank order, ZeRO-3's layout),
    or as saved when a run kept it whole."""
    if tuple(parts[0].shape) == tuple(shape):
        return parts[0]
    whole = torch.cat([p.reshape(-1) for p in parts])[: math.prod(shape)]
    if whole.numel() != math.prod(shape):
        raise ValueError(
            f"'{name}': the saved partitions hold {whole.numel()} elements, the model needs "
            f"{math.prod(shape)} (shape {tuple(shape)})"
        )
    return whole.reshape(shape)
