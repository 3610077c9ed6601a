"""Live-tensor bytes and FLOPs of one training micro-batch, measured by running the real model.

The model (built on the meta device) is given fake tensors (`FakeTensorMode`): every op runs for its shapes
and dtypes only, so a 10B model's step is measured at full width and depth without memory. A dispatch mode
counts each storage an op creates until Python frees it, which is when the real allocator would get it back;
the peak above what existed before the step is the micro-batch's working memory (activations kept for the
backward pass and the transient ones). Parameter gradients are dropped as soon as they are accumulated: the
model-state part of the plan counts them, by ZeRO stage. The same mode runs on real tensors too, which is how
`benchmarks/memory_plan.py` checks it against a CPU allocator's measurement.
"""

from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode
from torch.utils.weak import WeakIdKeyDictionary

from mmpt.engine import flops
from mmpt.engine.precision import policy
from mmpt.plan.batches import micro_batch
from mmpt.plan.build import Built


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages created inside this mode that are still alive, and their peak.

    Some tensors die only in a reference cycle (fake tensors above all), which Python frees at its next
    garbage collection, whenever that comes: counted as alive until then, they made the peak depend on the
    process's history (the same M²-Encoder 1B step measured 8.4, 9.9 and 16.6 GB in three processes, 27 GB with
    collection off). The allocator of a real step gets those bytes back at once, so before a new peak is
    taken the garbage is collected; objects from before the step are frozen out of the collections, which
    keeps each one short.
    """

    def __init__(self, existing: list[torch.Tensor] | tuple[torch.Tensor, ...] = ()):
        super().__init__()
        self.seen: WeakIdKeyDictionary = WeakIdKeyDictionary()
        for tensor in existing:
            self.seen[tensor.untyped_storage()] = 0  # already there: not the step's
        self.live = 0
        self.peak = 0

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            if storage in self.seen:
                continue
            nbytes = storage.nbytes()
            self.seen[storage] = nbytes
            weakref.finalize(storage, self._free, nbytes)
            self.live += nbytes
            if self.live > self.peak:
                gc.collect()  # what only a cycle keeps is not alive
                self.peak = max(self.peak, self.live)
        return out

    def __enter__(self):
        gc.freeze()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            gc.unfreeze()


@dataclass(frozen=True)
class StepMeasure:
    """One micro-batch of `batch` samples: peak working bytes and FLOPs (forward + backward, recompute included)."""

    batch: int
    peak_bytes: int
    flops: int


def set_checkpointing(model: nn.Module, enabled: bool) -> bool:
    """Turn gradient checkpointing on or off where the model offers it; False if it does not."""
    switch = getattr(model, "set_grad_checkpointing", None)
    if switch is None:
        return False
    switch(enabled)
    return True


def materialize(b: Built, device: str = "cpu") -> None:
    """Give `b`'s meta-built model and loss storage on `device` (fake storage inside FakeTensorMode), in the
    training precision as the engine sets it (`mmpt.engine.flops.materialize`)."""
    flops.materialize(b.model, b.loss, b.needs, policy(b.cfg.train.precision, b.cfg.train.zero_stage).model, device)


def run_step(b: Built, batch: dict[str, Any], pool_pass: bool = True) -> None:
    """What the engine runs for one micro-batch (`mmpt.engine.flops.run_step`): the step pool (unless the run's
    step is one merged pass: `pool_pass` false), the training step, the backward pass."""
    autocast = policy(b.cfg.train.precision, b.cfg.train.zero_stage).autocast
    flops.run_step(b.method, b.model, b.loss, b.needs, batch, autocast, pool_pass=pool_pass)


def drop_gradients(model: nn.Module) -> list[Any]:
    """Free each parameter's gradient once accumulated (the model-state part counts gradients)."""
    handles = []
    for param in model.parameters():
        if param.requires_grad:
            handles.append(param.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None)))
    return handles


def measure_step(b: Built, batch_size: int, pool_pass: bool = True) -> StepMeasure:
    """Measure one micro-batch of `b` (tensors on whatever device and mode `b` lives in); `pool_pass`: as
    `run_step`'s."""
    batch = micro_batch(b, batch_size)
    b.model.train()
    handles = drop_gradients(b.model)
    existing = [*b.model.parameters(), *b.model.buffers(), *b.loss.buffers(), *tree_flatten(batch)[0]]
    tracker = LiveBytes([t for t in existing if isinstance(t, torch.Tensor)])
    flops = FlopCounterMode(display=False)
    try:
        with flops, tracker:
            run_step(b, batch, pool_pass)
    finally:
        for handle in handles:
            handle.remove()
    return StepMeasure(batch_size, tracker.peak, flops.get_total_flops())


def on_fake_tensors(b: Built) -> Any:
    """A FakeTensorMode in which `b`'s meta-built model and loss have been given fake CPU storage; enter it
    around `measure_step`."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        materialize(b)
    return mode
