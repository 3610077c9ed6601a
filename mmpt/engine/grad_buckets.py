"""Gradient all-reduce for ZeRO-0 that overlaps backward and copies nothing (the way torch DDP does it).

DeepSpeed's ZeRO-0 all-reduce waits for the whole backward, flattens every gradient into a new buffer,
all-reduces it and copies the averages back: two full copies of the gradients and no overlap. Here every
gradient is a view into one of a few flat buckets, filled in about the order backward produces them
(reverse registration order). Autograd accumulates into the views; once every gradient of a bucket is in,
the bucket's all-reduce starts (asynchronously) while backward goes on. Buckets start strictly in order,
so every rank issues the same collectives in the same order even when a parameter gets no gradient in a
step (its bucket then starts when the step's backward is done, with zeros there).

Only for the engine's plain optimizer path (fp32 ZeRO-0): DeepSpeed's bf16/fp16 wrappers keep gradients
of their own.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

BUCKET_BYTES = 25 * 2**20  # DDP's default bucket size


class BucketedAllReduce:
    """Per optimizer step: `start_step()`, then `reduce_during_backward(last)` before each micro-batch's
    backward (only the step's last one reduces; earlier ones accumulate) and `finish()` after the last."""

    def __init__(self, parameters: Iterable[nn.Parameter], bucket_bytes: int = BUCKET_BYTES):
        self.world = dist.get_world_size()
        params = [p for p in parameters if p.requires_grad]
        self.buckets: list[torch.Tensor] = []
        self.members: list[list[nn.Parameter]] = []
        self.views: dict[nn.Parameter, torch.Tensor] = {}
        self.bucket_of: dict[nn.Parameter, int] = {}
        current: list[nn.Parameter] = []
        filled = 0
        for param in reversed(params):  # backward runs roughly in reverse order of registration
            if current and (
                param.dtype != current[0].dtype or param.device != current[0].device or filled >= bucket_bytes
            ):
                self._add_bucket(current)
                current, filled = [], 0
            current.append(param)
            filled += param.numel() * param.element_size()
        if current:
            self._add_bucket(current)
        for param in params:
            param.register_post_accumulate_grad_hook(self._gradient_ready)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for flat in self.buckets:
            by_dtype.setdefault(flat.dtype, []).append(flat)
        self.by_dtype = list(by_dtype.values())  # the unscale kernel takes tensors of one dtype per call
        self.inverse = torch.full((1,), 1.0 / self.world, device=self.buckets[0].device)
        self.reducing = False
        self.ready = [0] * len(self.buckets)
        self.next_bucket = 0
        self.handles: list[dist.Work] = []

    def _add_bucket(self, params: list[nn.Parameter]) -> None:
        flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        offset = 0
        for param in params:
            self.views[param] = flat[offset : offset + param.numel()].view_as(param)
            self.bucket_of[param] = len(self.buckets)
            offset += param.numel()
        self.buckets.append(flat)
        self.members.append(params)

    def start_step(self) -> None:
        """Zero the buckets and make every gradient their view again (the optimizer's zero_grad drops them)."""
        for flat in self.buckets:
            flat.zero_()
        for param, view in self.views.items():
            param.grad = view
        self.ready = [0] * len(self.buckets)
        self.next_bucket = 0
        self.handles = []

    def reduce_during_backward(self, reduce: bool) -> None:
        """Whether the next backward launches each bucket's all-reduce as soon as its gradients are complete."""
        self.reducing = reduce

    def _gradient_ready(self, param: nn.Parameter) -> None:
        if not self.reducing:
            return
        if param.grad is not self.views[param]:
            raise RuntimeError(
                "a gradient stopped being a view of its bucket (was .grad replaced or set to None "
                "between the step's start and its backward?)"
            )
        index = self.bucket_of[param]
        self.ready[index] += 1
        self._launch(until_incomplete=True)

    def _launch(self, until_incomplete: bool) -> None:
        while self.next_bucket < len(self.buckets):
            index = self.next_bucket
            if until_incomplete and self.ready[index] < len(self.members[index]):
                return
            flat = self.buckets[index]
            self.handles.append(dist.all_reduce(flat, async_op=True))
            self.next_bucket += 1

    def finish(self) -> torch.Tensor:
        """After the step's last backward: reduce what is left, wait for all, average. Returns whether some
        averaged gradient is not finite (a device tensor, 1.0 or 0.0), found in the same pass as the average."""
        self._launch(until_incomplete=False)
        for handle in self.handles:
            handle.wait()
        self.handles = []
        self.reducing = False
        found_inf = torch.zeros(1, device=self.inverse.device)  # fresh each step: the optimizer keeps it
        # GradScaler's unscale kernel: multiplies by 1/ranks and flags non-finite values in one pass per bucket
        for same_dtype in self.by_dtype:
            torch._amp_foreach_non_finite_check_and_unscale_(  # pyright: ignore[reportPrivateImportUsage]
                same_dtype, found_inf, self.inverse
            )
        return found_inf.squeeze(0)
