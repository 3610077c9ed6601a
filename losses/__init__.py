"""Losses (installed as ``mmpt.losses``): take tensors and, where they gather, a process group."""

from mmpt.losses.grouped_itc import GroupedContrastiveLoss
from mmpt.losses.sigmoid import SigmoidLoss

__all__ = ["GroupedContrastiveLoss", "SigmoidLoss"]
