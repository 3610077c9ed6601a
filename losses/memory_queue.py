"""A FIFO memory queue of key features (MoCo), identical on every rank.

Each push gathers the keys of all ranks (rank order) and writes them after the newest entries,
overwriting the oldest once the queue is full. The entries, write position and fill count are
buffers: they are saved with the training checkpoint and restored on resume. Until the queue has
filled, only the entries written so far are negatives.

The write position and fill count are also kept as Python ints, so a step never reads them back from
the device; the buffers are written from them (host to device) and read once after a state load.

`contents()` is a view of the entries, not a copy: a loss built on it keeps reading the entries until
its backward has run. So `push` gathers the keys at once (the collective stays where every rank calls
it) but writes them at the next `contents()` or `state_dict()`, after that backward; a checkpoint
therefore always holds every pushed key.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from mmpt.distributed import all_gather_with_grad, collectives


class MemoryQueue(nn.Module):
    entries: torch.Tensor  # buffers, registered in __init__
    position: torch.Tensor
    count: torch.Tensor

    def __init__(self, size: int, dim: int, group: dist.ProcessGroup | None = None):
        super().__init__()
        if size < 1:
            raise ValueError(f"queue size must be positive, got {size}")
        self.group = group
        self.register_buffer("entries", torch.zeros(size, dim))
        # Shape [1], not 0-D: DeepSpeed's buffer broadcast flattens tensors.
        self.register_buffer("position", torch.zeros(1, dtype=torch.long))  # where the next entry goes
        self.register_buffer("count", torch.zeros(1, dtype=torch.long))  # entries written, at most size
        self._pointers: tuple[int, int] | None = (0, 0)  # (position, count); None: read from the buffers
        self._pending: list[torch.Tensor] = []  # gathered keys not yet written, oldest first

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        self._pending.clear()
        self._pointers = None

    def _save_to_state_dict(self, *args, **kwargs):
        self._write_pending()
        super()._save_to_state_dict(*args, **kwargs)

    def pointers(self) -> tuple[int, int]:
        """(write position, fill count); read from the buffers only once after a state load."""
        if self._pointers is None:
            self._pointers = (int(self.position), int(self.count))
        return self._pointers

    @property
    def size(self) -> int:
        return self.entries.shape[0]

    def contents(self) -> torch.Tensor:
        """The valid entries [n, dim] (no gradient), oldest-first order not guaranteed: a view, valid until
        the next `contents()` (by then, a step's backward is done)."""
        self._write_pending()
        return self.entries[: self.pointers()[1]].detach()

    @torch.no_grad()
    def push(self, keys: torch.Tensor) -> None:
        """Enqueue every rank's `keys` [n, dim] (n may differ between ranks); every rank must call it. Without a group
        of its own the queue gathers over the data-parallel ranks (ranks splitting one batch's sequences hold
        the same keys)."""
        group = self.group if self.group is not None else collectives().layout.data_group
        self._pending.append(all_gather_with_grad(keys.detach().contiguous(), group).to(self.entries.dtype))

    @torch.no_grad()
    def _write_pending(self) -> None:
        for keys in self._pending:
            if keys.shape[0] > self.size:
                keys = keys[-self.size :]
            rows = keys.shape[0]
            start, count = self.pointers()
            slots = (torch.arange(rows, device=keys.device) + start) % self.size
            self.entries[slots] = keys
            self._pointers = ((start + rows) % self.size, min(count + rows, self.size))
            self.position.fill_(self._pointers[0])
            self.count.fill_(self._pointers[1])
        self._pending.clear()
