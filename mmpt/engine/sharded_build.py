"""The model under ZeRO-3 on several ranks, built partitioned: one whole copy per job, not one per rank.

Built plainly, every rank holds the whole model in fp32 until DeepSpeed partitions it (a 10B model: ~41 GB
of host memory per rank, eight times over on a node of eight). Here:

1. rank 0 alone builds the model as one process would (same seed, same initialisation code) and loads the
   method's initial weights into it (`method.init_from`, backbone weights): the values every rank starts
   from, exactly those of ZeRO 0-2;
2. every rank builds the model inside `deepspeed.zero.Init`, which partitions each module's parameters as
   soon as the module exists, so no rank but the first ever holds more than one module whole;
3. rank 0's values go into the partitioned model one module at a time: the module's parameters are made
   whole for the copy and re-partitioned (`GatheredParameters` with rank 0 as the writer), buffers are
   broadcast, and momentum copies (their tensors partitioned like the parameters they follow, see
   `sharded_copies.py`) receive only their own partition of each tensor.

Why rank 0 builds a plain copy instead of every rank initialising under `zero.Init` alone: towers whose parent
module initialises its children's weights directly (timm's ViT `init_weights`, open_clip's text
`init_parameters`) find those children already partitioned there, and their initialisation silently does
nothing (DeepSpeed re-gathers only for `Module.apply`). Rank 0's copy is freed before DeepSpeed's optimizer
allocates anything.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence

import torch
from torch import nn

from mmpt import distributed as mdist
from mmpt.engine.sharded_copies import ShardedCopies
from mmpt.models.momentum import MomentumCopy


def build_partitioned(
    build: Callable[[], nn.Module],
    load: Callable[[nn.Module], str | None],
    copies_of: Callable[[nn.Module], Sequence[MomentumCopy]],
    deepspeed_config: dict,
) -> tuple[nn.Module, str | None, ShardedCopies | None]:
    """(the partitioned model with rank 0's values, what `load` said on rank 0, the sharded momentum copies).

    `build` makes the model, `load` puts the initial weights into a whole one, `copies_of` names a model's
    momentum copies. Every rank calls it; an error on rank 0 (weights that do not fit) is raised on every rank.
    """
    import deepspeed
    from transformers.initialization import no_init_weights

    if not deepspeed.comm.is_initialized():  # a process group torch started: DeepSpeed's layer wraps it
        deepspeed.init_distributed(dist_backend=torch.distributed.get_backend())
    source, said, failure = None, None, None
    if mdist.get_rank() == 0:
        try:
            source = build()
            said = load(source)
        except Exception as exc:  # said on every rank below, so none waits for the others in a collective
            failure = exc
    said, error = mdist.broadcast_object((said, None if failure is None else (type(failure), str(failure))))
    if failure is not None:
        raise failure
    if error is not None:
        raise _same_error(*error)

    # Initialisation is skipped (its values are replaced below, and some of it, HF's among it, would index
    # parameters that are already partitioned); mem_efficient_linear off: DeepSpeed would otherwise replace
    # torch.nn.functional.linear for the whole process.
    with no_init_weights(), _init_partitioned()(config_dict_or_path=deepspeed_config, mem_efficient_linear=False):
        model = build()
    copies = copies_of(model)
    sharded = ShardedCopies(copies) if copies else None
    _copy_values(source, model, sharded)
    del source
    gc.collect()
    return model, said, sharded


@torch.no_grad()
def _copy_values(source: nn.Module | None, model: nn.Module, sharded: ShardedCopies | None) -> None:
    """Rank 0's parameters and buffers into every rank's partitioned model, one module at a time."""
    import deepspeed

    whole: dict[str, torch.Tensor] = {}
    if source is not None:  # tied and non-persistent tensors included: every name the partitioned model has
        whole = dict(source.named_parameters(remove_duplicate=False))
        whole.update(source.named_buffers(remove_duplicate=False))
    # Buffers take rank 0's shapes and dtypes: a momentum copy's were copied from partitioned parameters.
    layouts: dict[str, tuple[torch.Size, torch.dtype]] = {}
    if source is not None:
        layouts = {n: (b.shape, b.dtype) for n, b in source.named_buffers(remove_duplicate=False)}
    layouts = mdist.broadcast_object(layouts)
    for prefix, module in model.named_modules(remove_duplicate=False):
        params = list(module.named_parameters(prefix=prefix, recurse=False))
        if params:
            with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=0):
                for name, param in params:
                    if source is not None:
                        param.copy_(whole[name])
                    if not hasattr(param, "ds_id"):  # left whole (0-D): DeepSpeed partitions it later
                        param.copy_(mdist.broadcast_tensor(param.detach()))
        for name, buffer in module.named_buffers(prefix=prefix, recurse=False):
            shape, dtype = layouts[name]
            value = mdist.broadcast_tensor(
                whole[name].clone() if source is not None else torch.empty(shape, dtype=dtype)
            )
            if sharded is not None and sharded.is_partition(buffer):
                sharded.fill(buffer, value)
            else:  # in place of the data, so whatever holds the buffer keeps holding it
                buffer.data = value.to(buffer.device)


def _same_error(kind: type[Exception], message: str) -> Exception:
    """Rank 0's error as this rank's: the same type where it takes a message alone (the exit code follows it)."""
    try:
        return kind(message)
    except TypeError:
        return RuntimeError(f"rank 0: {message}")


def _init_partitioned():
    """`deepspeed.zero.Init` that leaves 0-D parameters whole: DeepSpeed 0.19 fails on them while building (it
    broadcasts each parameter as bytes); the models re-make theirs with shape [1] (open_clip's logit scale),
    and `deepspeed.initialize` partitions any parameter still whole."""
    import deepspeed

    class InitPartitioned(deepspeed.zero.Init):
        def _zero_init_param(self, param):
            if param.dim() > 0:
                super()._zero_init_param(param)

    return InitPartitioned
