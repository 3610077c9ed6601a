"""The shared engine: DeepSpeed setup, the training loop, checkpoints and metrics."""

from mmpt.engine.trainer import train

__all__ = ["train"]
