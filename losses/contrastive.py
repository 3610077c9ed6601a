"""Global image-text contrastive loss (InfoNCE over all ranks' pairs), as CLIP trains it.

Each rank scores its own rows against every rank's columns (gathered with gradient), the
"local loss" form: the same gradients as the full N*b x N*b matrix at 1/N of its memory. Each rank's
loss is the mean over its own rows; ranks may hold different numbers of rows (see
`mmpt.distributed.allow_uneven_rows`), and the engine then weighs each rank's loss by its share.
Called like open_clip's `ClipLoss`: `loss(image_features, text_features, logit_scale)` where
`logit_scale` is the multiplier (already exponentiated).

Features may arrive in bf16 (DeepSpeed casts the model); the loss upcasts them on entry (`upcast`), so
the gather, the logits and their softmax run in fp32, and their gradients go back in the features' dtype.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mmpt.distributed import all_gather_with_grad, gather_rows_with_grad


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


class ContrastiveLoss(nn.Module):
    def __init__(self, group: dist.ProcessGroup | None = None):
        super().__init__()
        self.group = group

    def forward(
        self, image_features: torch.Tensor, text_features: torch.Tensor, logit_scale: torch.Tensor
    ) -> torch.Tensor:
        image_features, text_features = upcast(image_features), upcast(text_features)
        all_images = gather_rows_with_grad(image_features, self.group)
        all_texts = all_gather_with_grad(text_features, self.group)
        targets = torch.arange(image_features.shape[0], device=image_features.device) + all_images.offset
        logits_per_image = scaled_logits(image_features, all_texts, logit_scale)
        logits_per_text = scaled_logits(text_features, all_images.rows, logit_scale)
        return 0.5 * (F.cross_entropy(logits_per_image, targets) + F.cross_entropy(logits_per_text, targets))
