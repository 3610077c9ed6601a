"""The model under ZeRO-3 on several ranks, built partitioned: never one whole copy per rank.

Built plainly, every rank holds the whole model in fp32 until DeepSpeed partitions it (a 10B model: ~41 GB
of host memory per rank, eight times over on a node of eight). Here:

1. every rank builds the model inside `deepspeed.zero.Init`, which partitions each module's parameters as
   soon as the module exists, so no rank holds more than one module whole;
2. the values every rank starts from, exactly those of ZeRO 0-2, come from rank 0, in one of two ways:
   - where the method's initial weights give every tensor the model saves (`Method.initial_tensors`, e.g.
     the M²-Encoder's `init_from`), rank 0 reads them from the file one tensor at a time: no process
     ever holds the whole model;
   - otherwise rank 0 alone builds the model as one process would (same seed, same initialisation code)
     and loads the method's initial weights into it (`load_initial_weights`, e.g. backbone weights): one
     whole copy in the job;
3. rank 0's values go into the partitioned model one module at a time: the module's parameters are made
   whole for the copy and re-partitioned (`GatheredParameters` with rank 0 as the writer), buffers are
   broadcast, and momentum copies (their tensors partitioned like the parameters they follow, see
   `copies.py`) receive only their own partition of each tensor.

Why rank 0 builds a plain copy when the weights do not cover the model, instead of every rank initialising
under `zero.Init` alone: towers whose parent module initialises its children's weights directly (timm's ViT
`init_weights`, open_clip's text `init_parameters`) find those children already partitioned there, and their
initialisation silently does nothing (DeepSpeed re-gathers only for `Module.apply`). Rank 0's copy is freed
before DeepSpeed's optimizer allocates anything.
"""

from __future__ import annotations

import ctypes
import functools
import gc
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

import torch
from torch import nn

from mmpt import distributed as mdist
from mmpt.engine import deepspeed_private
from mmpt.engine.checkpoint.weights import full_shapes
from mmpt.engine.zero3.copies import ShardedCopies
from mmpt.models.momentum import MomentumCopy
from mmpt.models.tensor_files import TensorReader, check_covers

TRIM_EVERY_BYTES = 16 << 20  # whole module bytes copied between two returns of freed memory to the system


def build_partitioned(
    build: Callable[[], nn.Module],
    load: Callable[[nn.Module], str | None],
    tensors: Callable[[nn.Module], tuple[str, TensorReader]] | None,
    copies_of: Callable[[nn.Module], Sequence[MomentumCopy]],
    deepspeed_config: dict,
) -> tuple[nn.Module, str | None, ShardedCopies | None]:
    """(the partitioned model with rank 0's values, what rank 0 said it loaded, the sharded momentum copies).

    `build` makes the model; `tensors` opens the initial weights, tensor by tensor, where they cover the model
    (else None: `load` puts them into a model built whole); `copies_of` names a model's momentum copies.
    Every rank calls it; an error on rank 0 (weights that do not fit) is raised on every rank.
    """
    import deepspeed
    from transformers.initialization import no_init_weights

    if not deepspeed.comm.is_initialized():  # a process group torch started: DeepSpeed's layer wraps it
        deepspeed.init_distributed(dist_backend=torch.distributed.get_backend())
    # Initialisation is skipped (its values are replaced below, and some of it, HF's among it, would index
    # parameters that are already partitioned); mem_efficient_linear off: DeepSpeed would otherwise replace
    # torch.nn.functional.linear for the whole process.
    # 0-D parameters stay whole: the models re-make theirs with shape [1] (open_clip's logit scale), and
    # `deepspeed.initialize` partitions any parameter still whole.
    freed = _FreedMemory()
    init = deepspeed_private.partitioned_init(lambda module: freed.add(module.parameters(recurse=False)))
    with no_init_weights(), init(config_dict_or_path=deepspeed_config, mem_efficient_linear=False):
        model = build()
    copies = copies_of(model)
    sharded = ShardedCopies(copies) if copies else None
    values, said, failure = None, None, None
    if mdist.get_rank() == 0:
        try:
            values, said = _rank_0_values(model, sharded, build, load, tensors)
        except Exception as exc:  # said on every rank below, so none waits for the others in a collective
            failure = exc
    said, error = mdist.broadcast_object((said, None if failure is None else (type(failure), str(failure))))
    if failure is not None:
        raise failure
    if error is not None:
        raise _same_error(*error)
    _copy_values(values, model, sharded)
    del values
    gc.collect()
    return model, said, sharded


class _Values(Protocol):
    """Rank 0's value of each tensor the partitioned model has, by name, and the shape of each buffer."""

    def value(self, name: str) -> torch.Tensor: ...

    def buffer_layouts(self) -> dict[str, tuple[torch.Size, torch.dtype]]: ...


def _rank_0_values(
    model: nn.Module,
    sharded: ShardedCopies | None,
    build: Callable[[], nn.Module],
    load: Callable[[nn.Module], str | None],
    tensors: Callable[[nn.Module], tuple[str, TensorReader]] | None,
) -> tuple[_Values, str | None]:
    if tensors is None:
        whole = build()
        return _WholeModel(whole), load(whole)
    said, reader = tensors(model)
    check_covers(reader.name, reader.shapes(), full_shapes(model, sharded), "this config's model")
    return _ReadTensors(reader, model, sharded), said


class _WholeModel:
    """Values from a model built whole (tied and non-persistent tensors included)."""

    def __init__(self, whole: nn.Module):
        self._tensors: dict[str, torch.Tensor] = dict(whole.named_parameters(remove_duplicate=False))
        self._layouts = {n: (b.shape, b.dtype) for n, b in whole.named_buffers(remove_duplicate=False)}
        self._tensors.update(whole.named_buffers(remove_duplicate=False))

    def value(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def buffer_layouts(self) -> dict[str, tuple[torch.Size, torch.dtype]]:
        return self._layouts


class _ReadTensors:
    """Values read from a file one tensor at a time; a buffer the file does not hold (not saved with the
    model: built by its module, the same on every rank) keeps the value rank 0 built."""

    def __init__(self, reader: TensorReader, model: nn.Module, sharded: ShardedCopies | None):
        self._reader, self._held = reader, set(reader.shapes())
        self._built = dict(model.named_buffers(remove_duplicate=False))
        self._layouts = {
            n: (sharded.full_shape(b) if sharded is not None and sharded.is_partition(b) else b.shape, b.dtype)
            for n, b in self._built.items()
        }

    def value(self, name: str) -> torch.Tensor:
        return self._reader.read(name) if name in self._held else self._built[name]

    def buffer_layouts(self) -> dict[str, tuple[torch.Size, torch.dtype]]:
        return self._layouts


@torch.no_grad()
def _copy_values(values: _Values | None, model: nn.Module, sharded: ShardedCopies | None) -> None:
    """Rank 0's parameters and buffers into every rank's partitioned model, one module at a time."""
    import deepspeed

    # Buffers take rank 0's shapes and dtypes: a momentum copy's were copied from partitioned parameters.
    layouts: dict[str, tuple[torch.Size, torch.dtype]] = mdist.broadcast_object(
        values.buffer_layouts() if values is not None else {}
    )
    freed = _FreedMemory()
    for prefix, module in model.named_modules(remove_duplicate=False):
        params = list(module.named_parameters(prefix=prefix, recurse=False))
        freed.add(p for _, p in params)
        if params:
            with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=0):
                for name, param in params:
                    if values is not None:
                        param.copy_(values.value(name))
                    if not hasattr(param, "ds_id"):  # left whole (0-D): DeepSpeed partitions it later
                        param.copy_(mdist.broadcast_tensor(param.detach()))
        for name, buffer in module.named_buffers(prefix=prefix, recurse=False):
            shape, dtype = layouts[name]
            value = mdist.broadcast_tensor(
                values.value(name).to(dtype).clone() if values is not None else torch.empty(shape, dtype=dtype)
            )
            if sharded is not None and sharded.is_partition(buffer):
                sharded.fill(buffer, value)
            else:  # in place of the data, so whatever holds the buffer keeps holding it
                buffer.data = value.to(buffer.device)


class _FreedMemory:
    """Returns freed memory to the system after every `TRIM_EVERY_BYTES` of parameters made whole and freed."""

    def __init__(self):
        self.since = 0

    def add(self, params: Iterable[torch.Tensor]) -> None:
        self.since += sum(4 * getattr(p, "ds_numel", p.numel()) for p in params)
        if self.since > TRIM_EVERY_BYTES:
            self.since = 0
            release_freed_memory()


def release_freed_memory() -> None:
    """Give the memory freed so far back to the system (glibc's `malloc_trim`; elsewhere nothing).

    Each module made whole for the copy, and each tensor read, is freed right after, but glibc keeps freed
    blocks of these sizes in the process for reuse: a partitioned build would otherwise end up resident
    with as much as the whole model at its peak, though it never holds it."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


def _same_error(kind: type[Exception], message: str) -> Exception:
    """Rank 0's error as this rank's: the same type where it takes a message alone (the exit code follows it)."""
    try:
        return kind(message)
    except TypeError:
        return RuntimeError(f"rank 0: {message}")
