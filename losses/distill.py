"""Distillation of an image-text student from a frozen teacher's similarities (open_clip's `DistillClipLoss` term).

Both models score the same global batch: each rank's images against every rank's captions and each rank's
captions against every rank's images, the student with its logit scale, the teacher with its own. The
student's scores are pulled towards the teacher's softened ones by a cross-entropy against the teacher's
softmax, both directions averaged:

    T^2 * mean_i [ -sum_j softmax(t_ij / T) log softmax(s_ij / T) ]

With T = 1 that is open_clip's term; T^2 keeps its gradient's size as T changes (Hinton et al.). The
student's columns are gathered with gradient, so the sum over ranks equals the loss of one big batch, as the
contrastive loss's is; the teacher's carry none. Features are upcast to fp32 on entry (`scaled_logits`).
"""

from __future__ import annotations

import torch

from mmpt.distributed import all_gather_with_grad, gather_rows_with_grad
from mmpt.losses.contrastive import scaled_logits, upcast


def soft_cross_entropy(teacher_logits: torch.Tensor, student_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Mean over rows of the cross-entropy of the student's softmax against the teacher's, at `temperature`."""
    targets = (teacher_logits.detach() / temperature).softmax(dim=1)
    return -(targets * (student_logits / temperature).log_softmax(dim=1)).sum(dim=1).mean() * temperature**2


def distillation_loss(
    student_images: torch.Tensor,
    student_texts: torch.Tensor,
    student_scale: torch.Tensor,
    teacher_images: torch.Tensor,
    teacher_texts: torch.Tensor,
    teacher_scale: torch.Tensor,
    temperature: float = 1.0,
) -> torch.Tensor:
    """This rank's rows of the distillation term: its images and captions against every rank's (fp32)."""
    images, texts = upcast(student_images), upcast(student_texts)
    all_images, all_texts = gather_rows_with_grad(images).rows, all_gather_with_grad(texts)
    with torch.no_grad():
        t_images, t_texts = upcast(teacher_images), upcast(teacher_texts)
        t_all_images, t_all_texts = all_gather_with_grad(t_images), all_gather_with_grad(t_texts)
        teacher_i2t = scaled_logits(t_images, t_all_texts, teacher_scale)
        teacher_t2i = scaled_logits(t_texts, t_all_images, teacher_scale)
    return 0.5 * (
        soft_cross_entropy(teacher_i2t, scaled_logits(images, all_texts, student_scale), temperature)
        + soft_cross_entropy(teacher_t2i, scaled_logits(texts, all_images, student_scale), temperature)
    )
