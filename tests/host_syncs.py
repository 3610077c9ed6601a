"""Find, at torch's dispatcher, every op that would make the host wait for a GPU (see test_host_syncs.py).

On CPU these ops cost nothing, so a CPU run cannot time them; what it can do is see them. Under `HostSyncs`
every aten op a block of code dispatches (its own, and those of torch, timm or transformers code it calls,
in the forward and in autograd's backward) is checked against the ops whose CUDA kernels read a device
value back to the host before they can return:

- a scalar read: `_local_scalar_dense` (`.item()`, `bool()`/`int()`/`float()` of a tensor, a Python list
  or `if` indexed or tested with one), `is_nonzero`, `equal`;
- an output whose size depends on values: `nonzero` (`torch.where(cond)`, `argwhere`), `masked_select`,
  `unique` and its variants, `bincount`, `repeat_interleave` with a tensor of repeats and no
  `output_size`, and indexing with a boolean mask (`index`/`index_put` with a bool or uint8 index,
  which runs `nonzero` inside the kernel);
- a tensor made from a Python sequence inside the block (`lift_fresh` of one or more dimensions:
  `torch.tensor([...])`, a tensor indexed with a list), a copy from pageable host memory that CUDA makes
  synchronously. A lifted scalar is left out where it fills (`x[i] = 0.5`, `x[:, 0] = 0.5`: CUDA fills
  on the device), but not where it is written through tensor indices (`x[rows, cols] = 1.0`: `index_put_`
  wants its values on the device, so CUDA copies the scalar there from pageable memory, synchronously; an
  H100's sync debug mode caught SPACE-2's losses doing this).

Calls of `tolist()`, `cpu()` and `numpy()` are caught where they are made (a CPU tensor's dispatches nothing).
Not seen: reads inside a kernel (below the dispatcher), and copies to the host spelled `.to("cpu")`, which
on CPU cannot be told from a move to the training device.
"""

from __future__ import annotations

import traceback
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[1]
aten = torch.ops.aten

# Ops that synchronise whatever their arguments.
ALWAYS = {
    aten._local_scalar_dense,
    aten.is_nonzero,
    aten.equal,
    aten.nonzero,
    aten.masked_select,
    aten._unique,
    aten._unique2,
    aten.unique_dim,
    aten.unique_consecutive,
    aten.unique_dim_consecutive,
    aten.bincount,
}
INDEXING = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_, aten._unsafe_index}
REPEATS = {aten.repeat_interleave}


def syncs(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], lifted: torch.Tensor | None = None) -> bool:
    """Whether the op `func(*args, **kwargs)` would read a device value back to the host on a GPU, or copy one
    from pageable host memory. `lifted`: the last 0-dim tensor lifted from a Python scalar."""
    packet = func.overloadpacket
    if packet in ALWAYS:
        return True
    if packet in INDEXING:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        values = args[2] if len(args) > 2 else kwargs.get("values")
        return (lifted is not None and values is lifted) or any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices if i is not None
        )
    if packet is aten.lift_fresh:
        return args[0].ndim > 0
    if packet in REPEATS:
        # .Tensor(repeats) or .self_Tensor(self, repeats); .self_int repeats a Python number
        repeats = args[1] if len(args) > 1 else (args[0] if args else kwargs.get("repeats"))
        return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None
    return False


def where(stack: list[traceback.FrameSummary]) -> str:
    """The innermost caller outside torch (the line that asked for the op), and the innermost line of the
    repository's code under it when that is a different one (the step's line that led there)."""
    outside = [f for f in stack if "/torch/" not in f.filename and f.filename != __file__]
    if not outside:
        return "?"
    ours = [f for f in outside if f.filename.startswith(str(REPO)) and "/.venv/" not in f.filename]
    caller = f"{short(outside[-1].filename)}:{outside[-1].lineno}"
    if ours and ours[-1] is not outside[-1]:
        caller += f" (from {short(ours[-1].filename)}:{ours[-1].lineno})"
    return caller


def short(filename: str) -> str:
    path = Path(filename)
    if path.is_relative_to(REPO) and "/.venv/" not in filename:
        return str(path.relative_to(REPO))
    parts = path.parts
    anchor = max((i for i, p in enumerate(parts) if p == "site-packages"), default=len(parts) - 2)
    return "/".join(parts[anchor + 1 :])


class HostSyncs:
    """While active, records "op at file:line" (`found`) for every host-synchronising op dispatched, and for
    every call of a tensor method whose one job is to bring values to the host (`tolist`, `cpu`, `numpy`:
    on CPU they dispatch nothing, so the dispatcher alone would miss them)."""

    def __init__(self) -> None:
        self.found: Counter[str] = Counter()
        self._modes = (_Called(self.found), _Dispatched(self.found))

    def __enter__(self) -> HostSyncs:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


HOST_METHODS = {getattr(torch.Tensor, name) for name in ("tolist", "cpu", "numpy")}


class _Called(TorchFunctionMode):
    def __init__(self, found: Counter[str]) -> None:
        super().__init__()
        self.found = found

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_METHODS:
            self.found[f"{func.__name__} at {where(traceback.extract_stack())}"] += 1
        return func(*args, **(kwargs or {}))


class _Dispatched(TorchDispatchMode):
    def __init__(self, found: Counter[str]) -> None:
        super().__init__()
        self.found = found
        self.lifted: torch.Tensor | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if syncs(func, args, kwargs, self.lifted):
            node = torch._C._current_autograd_node()  # in the backward: the forward op's gradient that asked
            during = f" in {node.name()}" if node is not None else ""
            self.found[f"{func.overloadpacket.__name__}{during} at {where(traceback.extract_stack())}"] += 1
        out = func(*args, **kwargs)
        if func.overloadpacket is aten.lift_fresh and out.ndim == 0:
            self.lifted = out  # a scalar is lifted right before the op it is for
        return out
