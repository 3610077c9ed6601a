"""Global image-text contrastive loss (InfoNCE over all ranks' pairs), as CLIP trains it.

Each rank scores its own rows against every rank's columns (gathered with gradient), the
"local loss" form: the same gradients as the full N*b x N*b matrix at 1/N of its memory.
Called like open_clip's `ClipLoss`: `loss(image_features, text_features, logit_scale)` where
`logit_scale` is the multiplier (already exponentiated).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mmpt.distributed import all_gather_with_grad, get_rank


class ContrastiveLoss(nn.Module):
    def __init__(self, group: dist.ProcessGroup | None = None):
        super().__init__()
        self.group = group

    def forward(
        self, image_features: torch.Tensor, text_features: torch.Tensor, logit_scale: torch.Tensor
    ) -> torch.Tensor:
        all_images = all_gather_with_grad(image_features, self.group)
        all_texts = all_gather_with_grad(text_features, self.group)
        rows = image_features.shape[0]
        targets = torch.arange(rows, device=image_features.device) + get_rank(self.group) * rows
        logits_per_image = logit_scale * image_features @ all_texts.T
        logits_per_text = logit_scale * text_features @ all_images.T
        return 0.5 * (F.cross_entropy(logits_per_image, targets) + F.cross_entropy(logits_per_text, targets))
