"""The shared engine: DeepSpeed setup, the training loop, checkpoints and metrics."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mmpt.engine.trainer import train

__all__ = ["train"]


def __getattr__(name: str):
    # Imported on first use: `mmpt.engine.stops` and friends load without torch's distributed stack.
    if name == "train":
        from mmpt.engine.trainer import train

        return train
    raise AttributeError(f"module 'mmpt.engine' has no attribute {name!r}")
