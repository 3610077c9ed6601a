"""Model towers and heads. Free of parallelism, precision and checkpoint logic."""

from mmpt.models.clip import ClipModel, ImageTowerConfig, TextTowerConfig

__all__ = ["ClipModel", "ImageTowerConfig", "TextTowerConfig"]
