"""Losses (installed as ``mmpt.losses``): take tensors and, where they gather, a process group."""

from mmpt.losses.contrastive import ContrastiveLoss

__all__ = ["ContrastiveLoss"]
