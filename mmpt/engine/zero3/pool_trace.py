"""ZeRO-3's prefetching kept through pooled accumulation: the pool pass gets a parameter trace of its own.

DeepSpeed's ZeRO-3 (0.19) records the order in which one forward of the engine's module and its backward
use the model's modules, then prefetches each module's parameters ahead of use, as long as every such
period uses them in the recorded order. A step with a pool (GBA-ITC) runs a pool pass, one forward over
all K micro-batches without backward, then K forward+backward periods: the pool's period breaks the
recorded order twice a step, and the period after it runs without prefetching while the trace is recorded
again. Here the pool pass runs with a second coordinator of DeepSpeed's kind, which records and prefetches
the pool's own order; the training periods keep theirs. Both are built from the same settings and share
the in-flight gather registry.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from mmpt.engine import deepspeed_private


class PoolTrace:
    """`with trace.pool_pass(): engine(micro_batches, entry="pool")`; nothing happens below ZeRO-3."""

    def __init__(self, engine: Any):
        self._offload = getattr(engine.optimizer, "parameter_offload", None)
        self._coordinator: Any = None

    @contextmanager
    def pool_pass(self) -> Iterator[None]:
        offload = self._offload
        if offload is None:
            yield
            return
        if self._coordinator is None:
            self._coordinator = deepspeed_private.pool_coordinator(offload)
            if self._coordinator is None:
                self._offload = None
                yield
                return
        training = offload.param_coordinator
        offload.param_coordinator = self._coordinator
        try:
            yield
        finally:
            offload.param_coordinator = training
