"""A run's consolidated fp32 weights as one safetensors file, written tensor by tensor as each is gathered,
and read back strictly."""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from mmpt import distributed as mdist
from mmpt.artifacts import commit, shareable, temporary_for
from mmpt.engine.checkpoint.parts import PartitionedTensors


def full_weights(
    model: nn.Module, partitioned: PartitionedTensors | None = None
) -> Iterator[tuple[str, torch.Tensor | None]]:
    """(name, full fp32 tensor on the CPU of rank 0, None elsewhere) of every state-dict entry, one at a time;
    every rank iterates (a parameter partitioned by ZeRO-3, or a tensor in `partitioned`, is gathered as it
    comes).

    Parameters come from the optimizer's fp32 master copy where one exists (bf16/fp16, any ZeRO stage),
    so no rank ever holds more than one full parameter besides its own shard. A parameter without one (fp32 at
    ZeRO 0, a locked one at any stage) is the module's own, gathered first where ZeRO-3 partitions it.
    """
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    params = dict(model.named_parameters(remove_duplicate=False))  # tied weights under every name
    for name, value in model.state_dict(keep_vars=True).items():
        if name in params:
            tensor = safe_get_full_fp32_param(params[name])
            if tensor is None and hasattr(params[name], "ds_id"):  # partitioned, not in the optimizer
                with deepspeed.zero.GatheredParameters([params[name]]):
                    tensor = params[name].detach().clone() if mdist.get_rank() == 0 else params[name]
            elif tensor is None:
                tensor = value
        elif partitioned is not None and partitioned.is_partition(value):
            tensor = partitioned.full(value)
        else:
            tensor = value
        yield name, tensor.detach().float().cpu().contiguous() if mdist.get_rank() == 0 else None


def full_shapes(model: nn.Module, partitioned: PartitionedTensors | None = None) -> dict[str, tuple[int, ...]]:
    """Every state-dict entry's full shape, known without gathering (ZeRO-3 keeps it in `ds_shape`)."""
    shapes = {}
    for name, value in model.state_dict(keep_vars=True).items():
        if partitioned is not None and partitioned.is_partition(value):
            shapes[name] = tuple(partitioned.full_shape(value))
        else:
            shapes[name] = tuple(getattr(value, "ds_shape", value.shape))
    return shapes


def gathered_state_dict(
    model: nn.Module, partitioned: PartitionedTensors | None = None
) -> dict[str, torch.Tensor] | None:
    """Full fp32 weights on rank 0 (None elsewhere); every rank calls it."""
    full = {name: tensor.clone() for name, tensor in full_weights(model, partitioned) if tensor is not None}
    return full if mdist.get_rank() == 0 else None


def read_weights(model: nn.Module, path: Path) -> nn.Module:
    """`model` with the weights `write_weights` wrote to `path` (every state-dict entry, tied ones too)."""
    from safetensors.torch import load_file

    model.load_state_dict(load_file(str(path)), strict=True)
    return model


def write_weights(model: nn.Module, path: Path, partitioned: PartitionedTensors | None = None) -> None:
    """Consolidated fp32 weights as safetensors, streamed: rank 0 writes each tensor as it is gathered, so
    neither the accelerator nor the host ever holds a second full model. Every rank calls it.

    The safetensors layout is written directly: an 8-byte little-endian header length, a JSON header naming
    every tensor's dtype, shape and byte range (known up front from the shapes), then the bytes in that order.
    """
    shapes = full_shapes(model, partitioned)
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes.items():
        size = 4 * math.prod(shape)
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    temporary = temporary_for(path)
    handle = open(temporary, "wb") if mdist.get_rank() == 0 else None  # noqa: SIM115 (every rank gathers below)
    try:
        if handle is not None:
            handle.write(struct.pack("<Q", len(encoded)) + encoded)
        for name, tensor in full_weights(model, partitioned):
            if handle is None or tensor is None:
                continue
            if tuple(tensor.shape) != shapes[name]:
                raise RuntimeError(f"{name}: gathered shape {tuple(tensor.shape)} differs from {shapes[name]}")
            handle.write(tensor.reshape(-1).numpy().view(np.uint8).data)
    finally:
        if handle is not None:
            handle.close()
    if handle is not None:
        commit(temporary, path)
        shareable(path)
