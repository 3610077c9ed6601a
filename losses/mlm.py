"""Masked language modelling loss, shared by the methods that predict masked tokens (SPACE-2, VICTOR)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def masked_lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the predicted tokens only (logits [n, V] and targets [n] of the masked
    positions, selected before the vocabulary head); 0 when there are none."""
    if targets.numel() == 0:
        return logits.sum() * 0.0
    return F.cross_entropy(logits.float(), targets)
