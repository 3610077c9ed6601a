"""What the image-text losses share: fp32 logits from features of any precision.

Features may arrive in bf16 (DeepSpeed casts the model); a loss upcasts them on entry (`upcast`), so
the gather, the logits and their softmax run in fp32, and their gradients go back in the features' dtype.
CLIP's loss over every rank's pairs is `mmpt.losses.grouped_itc.GroupedContrastiveLoss` with one group.
"""

from __future__ import annotations

import torch


def scaled_logits(queries: torch.Tensor, keys: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`scale * queries @ keys.T` in fp32 whatever the inputs' dtype.

    With a logit scale of 100, a bf16 logit (8 mantissa bits) is off by up to ~0.2 in absolute terms, which
    moves the softmax itself: the loss's gradient came out ~1% wrong. Upcasting the operands is exact, so
    only the fp32 product rounds; autograd returns the gradients in the operands' own dtype.
    """
    return scale.float() * (queries.float() @ keys.float().T)


def upcast(features: torch.Tensor) -> torch.Tensor:
    """`features` in fp32, where a loss takes them in: every use inside the loss (its own rows, the gathered
    columns) then sums its gradient in fp32, as does the gather's reduce-scatter over ranks, and the
    features' gradient is rounded to their dtype once, at this cast's backward."""
    return features.float()
