"""How a step with pooled accumulation runs: a pool pass without gradient then K training steps, or one merged
pass (`mmpt.methods.base.EngineNeeds.merged_step`). The engine, the FLOP count and the planner ask here."""

from __future__ import annotations

from torch import nn

from mmpt.config import Config, ConfigError
from mmpt.methods.base import EngineNeeds


def merges_pool_pass(cfg: Config, needs: EngineNeeds, model: nn.Module) -> bool:
    """Whether a pooled step runs as one pass (`train.pool_pass`; auto: where the towers checkpoint activations,
    so the K micro-batches held until backward cost little memory and the pool pass's forward is saved)."""
    choice, pooled = cfg.train.pool_pass, needs.merged_step is not None and cfg.train.grad_accum > 1
    if choice == "merged" and not pooled:
        raise ConfigError(
            "config key 'train.pool_pass': merged needs pooled accumulation (a method whose loss pools the step's "
            "micro-batches, with train.grad_accum > 1); use auto"
        )
    return pooled and (choice == "merged" or (choice == "auto" and bool(getattr(model, "grad_checkpointing", False))))
