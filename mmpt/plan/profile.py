"""What a config's model costs, independent of how many GPUs run it: counts from a meta-device build, and the
working bytes and FLOPs of a micro-batch measured on fake tensors at two batch sizes (memory grows linearly in
the batch, apart from the logits, which `logits` adds for the real world size)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from mmpt.config import Config
from mmpt.engine.pool_pass import step_pooling
from mmpt.plan.batches import micro_batch
from mmpt.plan.build import Counts, built, count
from mmpt.plan.measure import StepMeasure, measure_step, on_fake_tensors, set_checkpointing


@dataclass(frozen=True)
class Line:
    """bytes(b) = fixed + per_sample * b, from two measured batch sizes."""

    fixed: float
    per_sample: float

    @staticmethod
    def through(a: StepMeasure, b: StepMeasure, value: str) -> Line:
        ya, yb = getattr(a, value), getattr(b, value)
        slope = (yb - ya) / (b.batch - a.batch)
        return Line(ya - slope * a.batch, slope)

    def at(self, batch: int) -> float:
        return max(0.0, self.fixed + self.per_sample * batch)


@dataclass(frozen=True)
class Profile:
    counts: Counts
    loss: nn.Module  # the meta-built loss (its type and tiling say how logits grow)
    activations: Line  # as configured (gradient checkpointing on or off)
    activations_other: Line | None  # with checkpointing the other way round; None when the model has no switch
    checkpointing: bool  # what the config runs
    merged: bool  # the step runs its K pooled micro-batches as one pass (`mmpt.engine.pool_pass`)
    model_flops: Line  # forward + backward (+ the step pool's forward, unless merged), no recompute
    hardware_flops: Line  # as configured (recompute included when checkpointing)
    batch_bytes_per_sample: float  # the micro-batch's input tensors
    feature_dim: int  # width of the features a contrastive loss gathers (0: none)


def profile(cfg: Config) -> Profile:
    with built(cfg) as b:
        counts = count(b)
        sources = len(cfg.data.train.sources) if cfg.data.train.compose == "per_source" else 1
        sizes = (2 * sources, 4 * sources)  # two samples at least: batch norm needs more than one
        configured = bool(getattr(b.model, "grad_checkpointing", False))  # as the config built it
        merged = step_pooling(cfg, b.needs, b.model) == "merged"  # as configured: every measure runs the run's step
        mode = on_fake_tensors(b)
        runs: dict[bool, tuple[StepMeasure, StepMeasure]] = {}
        with mode:
            batch = micro_batch(b, sizes[0])
            batch_bytes = sum(t.nbytes for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor)) / sizes[0]
            for checkpointing in (False, True):
                if set_checkpointing(b.model, checkpointing) or not checkpointing:
                    small, large = (measure_step(b, size, pool_pass=not merged) for size in sizes)
                    runs[checkpointing] = (small, large)
        on = configured and True in runs
        other = runs.get(not on)
        return Profile(
            counts=counts,
            loss=b.loss,
            activations=Line.through(*runs[on], "peak_bytes"),
            activations_other=Line.through(*other, "peak_bytes") if other and True in runs else None,
            checkpointing=on,
            merged=merged,
            model_flops=Line.through(*runs[False], "flops"),
            hardware_flops=Line.through(*runs[on], "flops"),
            batch_bytes_per_sample=batch_bytes,
            feature_dim=feature_dim(cfg),
        )


def feature_dim(cfg: Config) -> int:
    for owner in (cfg.method, getattr(cfg.method, "arch", None)):
        for name in ("output_dim", "embed_dim"):
            if owner is not None and isinstance(getattr(owner, name, None), int):
                return getattr(owner, name)
    return 0
