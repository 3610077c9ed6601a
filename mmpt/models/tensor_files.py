"""Named tensors read from a weights file one at a time, so that no process holds the whole file.

Used when a model built partitioned (ZeRO-3) is filled from its initial weights: rank 0 reads one tensor,
every rank keeps its part, and the next tensor is read. A file is mapped into memory, and the pages read
count towards the process's resident memory until the mapping closes: the readers close it after each
tensor (safetensors) or after `REMAP_BYTES` read (PyTorch checkpoints, whose index is costlier to re-read).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Protocol, TypeVar

import torch

# Pages of a mapped PyTorch checkpoint held before it is mapped afresh (each re-map re-reads its index).
REMAP_BYTES = 16 << 20

Shape = tuple[int, ...]
Module = TypeVar("Module", bound=torch.nn.Module)


class CheckpointMismatch(RuntimeError):
    """The checkpoint's keys or shapes do not match the configured model."""


class TensorReader(Protocol):
    """Whole tensors by name, each read when asked for."""

    name: str  # the file it reads, for messages

    def shapes(self) -> dict[str, Shape]: ...

    def read(self, name: str) -> torch.Tensor: ...


def check_covers(source: str, found: Mapping[str, Shape], expected: Mapping[str, Shape], what: str) -> None:
    """A strict load's check: the same names with the same shapes, or one line naming what differs (`what`:
    the model the file should fit, e.g. "this M2-Encoder config")."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    shapes = [
        f"{k}: checkpoint {list(found[k])} vs model {list(expected[k])}"
        for k in sorted(set(found) & set(expected))
        if tuple(found[k]) != tuple(expected[k])
    ]
    parts = []
    for title, items in (("missing", missing), ("unexpected", unexpected), ("shape mismatch", shapes)):
        if items:
            parts.append(f"{title} ({len(items)}): {', '.join(items[:8])}{' ...' if len(items) > 8 else ''}")
    if parts:
        raise CheckpointMismatch(f"{source} does not fit {what}: " + "; ".join(parts))


def read_safetensors(directory: Path) -> dict[str, torch.Tensor]:
    """A release's or finished run's weights: model.safetensors, or the shards its index names."""
    from safetensors.torch import load_file

    index = directory / "model.safetensors.index.json"
    if not index.is_file():
        return load_file(str(directory / "model.safetensors"))
    state = {}
    for name in sorted(set(json.loads(index.read_text())["weight_map"].values())):
        state.update(load_file(str(directory / name)))
    return state


def load_strictly(model: Module, state: Mapping[str, torch.Tensor], source: str, what: str) -> Module:
    """`model` with `state` loaded, after `check_covers` has named any key or shape that differs."""
    shapes = {name: tuple(tensor.shape) for name, tensor in state.items()}
    check_covers(source, shapes, {name: tuple(t.shape) for name, t in model.state_dict().items()}, what)
    model.load_state_dict(state, strict=True)
    return model


class SafetensorsTensors:
    """A safetensors file, or the shards its `<name>.index.json` lists."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        self._open, self.name = safe_open, str(path)
        index = path.with_name(path.name + ".index.json")
        if path.is_file():
            self._files = {path}
        else:
            weight_map = json.loads(index.read_text())["weight_map"]
            self._files = {index.parent / shard for shard in set(weight_map.values())}
        self._where: dict[str, Path] = {}
        self._shapes: dict[str, Shape] = {}
        for file in sorted(self._files):
            with self._open(str(file), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 (a safetensors handle is not a dict)
                    self._where[name] = file
                    self._shapes[name] = tuple(handle.get_slice(name).get_shape())

    def shapes(self) -> dict[str, Shape]:
        return dict(self._shapes)

    def read(self, name: str) -> torch.Tensor:
        with self._open(str(self._where[name]), framework="pt") as handle:
            return handle.get_tensor(name).clone()  # a copy: the mapping closes with the handle


class MappedCheckpoint:
    """A `torch.save`d dict of tensors, mapped (`torch.load(mmap=True)`, tensors only) and read tensor by tensor.

    `select` finds the state dict inside what was saved (a Lightning or DeepSpeed wrapper) and may rename its
    keys. A file in PyTorch's legacy (pre-zip) format cannot be mapped and is read whole once.
    """

    def __init__(self, path: Path, select: Callable[[object], Mapping[str, torch.Tensor]]):
        self._path, self._select, self.name = path, select, str(path)
        self._state: Mapping[str, torch.Tensor] | None = None
        self._read_since_mapped = 0
        self._mapped = True
        self._shapes = {name: tuple(t.shape) for name, t in self._load().items()}

    def _load(self) -> Mapping[str, torch.Tensor]:
        if self._state is None:
            try:
                obj = torch.load(self._path, map_location="cpu", weights_only=True, mmap=self._mapped)
            except RuntimeError as exc:
                if not self._mapped or "mmap" not in str(exc):
                    raise
                self._mapped = False
                obj = torch.load(self._path, map_location="cpu", weights_only=True)
            self._state, self._read_since_mapped = self._select(obj), 0
        return self._state

    def shapes(self) -> dict[str, Shape]:
        return dict(self._shapes)

    def read(self, name: str) -> torch.Tensor:
        tensor = self._load()[name]
        if not self._mapped:
            return tensor
        self._read_since_mapped += tensor.numel() * tensor.element_size()
        copy = tensor.clone()
        if self._read_since_mapped >= REMAP_BYTES:
            self._state = None  # the mapping closes once nothing refers to its tensors
        return copy
