"""A check that turns "a parameter was used while ZeRO-3 had it partitioned" into a clear error.

Under ZeRO-3 a parameter holds only an empty placeholder except while DeepSpeed has gathered it:
inside a module call the engine has entered (its forward) or inside an explicit gather. Method code
that reads a parameter anywhere else computes with a 0-element tensor and fails far away with a
shape mismatch, or silently trains the wrong thing. While the guard is active, every torch op is
checked for such a placeholder among its inputs and stopped with the parameter's name and the rule.

The check costs a Python call per op, so the engine runs it over the first optimizer step only:
a step runs the same code every time, so a violation shows there.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

# Ops that read a placeholder's metadata or swap its storage (DeepSpeed itself does this while it
# gathers and releases parameters); only computing with its values is the error.
_METADATA = {
    "__get__",
    "__set__",
    "numel",
    "size",
    "dim",
    "is_floating_point",
    "element_size",
    "data_ptr",
    "__repr__",
    "__format__",
    "untyped_storage",
    "record_stream",
    "requires_grad_",
    "is_contiguous",
    "__hash__",
    "__eq__",
}


class PartitionedParameterError(RuntimeError):
    """A method computed with a parameter ZeRO-3 had not gathered."""


class _Guard(TorchFunctionMode):
    def __init__(self, names: dict[int, str], where: str):
        super().__init__()
        self.names, self.where = names, where

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") not in _METADATA:
            for leaf in tree_leaves((args, kwargs)):
                name = self.names.get(id(leaf)) if isinstance(leaf, nn.Parameter) else None
                if name is not None and _is_partitioned(leaf):
                    shape = tuple(getattr(leaf, "ds_shape", leaf.shape))  # ZeRO-3 keeps the full shape here
                    raise PartitionedParameterError(
                        f"parameter '{name}' (shape {shape}) was used by {_op_name(func)} in "
                        f"{self.where} while ZeRO-3 had it partitioned: method code may read parameters only inside "
                        f"training_step/pool_features/step_pool (which run in the engine's forward) or in an "
                        f"AfterStep that lists them in `reads`"
                    )
        return func(*args, **kwargs)


def _is_partitioned(param: nn.Parameter) -> bool:
    status = getattr(param, "ds_status", None)
    if status is None or status.name != "NOT_AVAILABLE":
        return False
    return param.numel() == 0 and getattr(param, "ds_numel", 0) > 0


def _op_name(func) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))


@contextmanager
def partitioned_parameter_guard(module: nn.Module, where: str, active: bool = True) -> Iterator[None]:
    """Within the block, an op on a partitioned parameter of `module` raises PartitionedParameterError."""
    if not active:
        yield
        return
    names = {id(p): n for n, p in module.named_parameters()}
    with _Guard(names, where):
        yield
