"""Masked language modelling loss, shared by the methods that predict masked tokens (SPACE-2, VICTOR)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE = -100  # the target of a position that is not predicted (cross-entropy's own default)


def masked_lm_loss(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE) -> torch.Tensor:
    """Mean cross-entropy over the predicted tokens; 0 when there are none.

    logits [..., V] and targets [...]: either only the predicted positions (selected before the vocabulary
    head), or every position with `ignore_index` where nothing is predicted. Written as a sum divided by the
    count of predicted tokens, which stays on the device: cross-entropy's own mean is 0/0 without any, and
    selecting the predicted positions on the device would size a tensor by a value the host must read."""
    logits = logits.reshape(-1, logits.shape[-1]).float()
    targets = targets.reshape(-1)
    total = F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="sum")
    return total / (targets != ignore_index).sum().clamp(min=1)
