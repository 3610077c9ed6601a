"""What the image-text losses share: fp32 logits from features of any precision.

Features may arrive in bf16 (DeepSpeed casts the model); a loss upcasts them on entry (`upcast`), so
the gather, the logits and their softmax run in fp32, and their gradients go back in the features' dtype.
CLIP's loss over every rank's pairs is `mmpt.losses.grouped_itc.GroupedContrastiveLoss` with one group.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def full_fp32() -> Iterator[None]:
    """fp32 matrix products in full precision inside, whatever `train.tf32` set for the model.

    TF32 keeps 10 mantissa bits: at a logit scale of 100 a logit would be off by up to ~0.1, the error the
    fp32 logits are there to avoid. The losses' logits (forward, and the tiled backwards' recomputation) run
    under this; autograd's own backward of an untiled product follows the global setting (a relative error
    of ~5e-4 on the features' gradients under TF32, below bf16's rounding of them)."""
    matmul = torch.backends.cuda.matmul
    before = matmul.allow_tf32
    matmul.allow_tf32 = False
    try:
        yield
    finally:
        matmul.allow_tf32 = before


@full_fp32()
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
