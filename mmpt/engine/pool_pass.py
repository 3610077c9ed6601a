"""How a step with pooled accumulation runs: a pool pass without gradient then K training steps, or one merged
pass (`mmpt.methods.base.EngineNeeds.merged_step`). The engine, the run summary, the FLOP count and the planner
ask `step_pooling`, so that they cannot disagree."""

from __future__ import annotations

from typing import Literal

from torch import nn

from mmpt.config import Config, ConfigError
from mmpt.methods.base import EngineNeeds

Pooling = Literal["merged", "separate"] | None


def step_pooling(cfg: Config, needs: EngineNeeds, model: nn.Module) -> Pooling:
    """None where a step does not pool (no step pool, or one micro-batch: `train.grad_accum` 1); else "merged" (one
    pass with gradient) or "separate" (a pool pass without gradient first). `train.pool_pass` auto merges where the
    towers checkpoint activations: the K micro-batches held until backward then cost little memory."""
    pooled = needs.step_pool is not None and cfg.train.grad_accum > 1
    choice, mergeable = cfg.train.pool_pass, pooled and needs.merged_step is not None
    if choice == "merged" and not mergeable:
        raise ConfigError(
            "config key 'train.pool_pass': merged needs pooled accumulation (a method whose loss pools the step's "
            "micro-batches, with train.grad_accum > 1); use auto"
        )
    if not pooled:
        return None
    checkpointing = bool(getattr(model, "grad_checkpointing", False))
    merged = mergeable and (choice == "merged" or (choice == "auto" and checkpointing))
    return "merged" if merged else "separate"
