"""The image-text losses under bf16 features: their gradients against fp64 on the same bf16 inputs.

The reference is a plain fp64 softmax cross-entropy written here (no code of the losses), so a loss that
rounds its logits or its softmax to bf16, or whose tiled backward disagrees with its forward, shows up
as a relative gradient error above the bound. At n=512, d=256 and a logit scale of 100, bf16 logits put
the error near 1% (untiled) and 2.5% (tiled); fp32 logits leave only the bf16 rounding of the returned
gradient (~0.1%).
"""

import pytest
import torch

from mmpt.losses.grouped_itc import GroupedContrastiveLoss
from mmpt.losses.sigmoid import INIT_LOGIT_BIAS, SigmoidLoss

ROWS, DIM, SCALE, BOUND = 512, 256, 100.0, 5e-3


def bf16_pairs() -> tuple[torch.Tensor, torch.Tensor]:
    """Unit image and text features in bf16; each text near its image, so the softmax is neither flat nor one-hot."""
    gen = torch.Generator().manual_seed(0)
    images = torch.nn.functional.normalize(torch.randn(ROWS, DIM, generator=gen), dim=-1)
    texts = torch.nn.functional.normalize(images + 6 * torch.randn(ROWS, DIM, generator=gen) / DIM**0.5, dim=-1)
    return images.bfloat16(), texts.bfloat16()


def fp64_reference(images: torch.Tensor, texts: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """d/d(images, texts) of the symmetric InfoNCE, every operation in fp64."""
    i, t = images.double().requires_grad_(), texts.double().requires_grad_()
    logits = scale * i @ t.T
    diagonal = torch.arange(len(logits))

    def cross_entropy(z: torch.Tensor) -> torch.Tensor:
        return (torch.logsumexp(z, dim=1) - z[diagonal, diagonal]).mean()

    loss = 0.5 * (cross_entropy(logits) + cross_entropy(logits.T))
    grad_i, grad_t = torch.autograd.grad(loss, (i, t))
    return grad_i, grad_t


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours.double() - reference).norm() / reference.norm()).item()


@pytest.mark.parametrize(
    "loss", [GroupedContrastiveLoss(), GroupedContrastiveLoss(tile_size=96)], ids=["infonce", "infonce-tiled"]
)
def test_bf16_gradients_match_fp64(loss):
    images, texts = bf16_pairs()
    i, t = images.clone().requires_grad_(), texts.clone().requires_grad_()
    scale = torch.tensor(SCALE, dtype=torch.bfloat16)
    value = loss(i, t, scale)
    grad_i, grad_t = torch.autograd.grad(value, (i, t))
    assert grad_i.dtype == grad_t.dtype == torch.bfloat16  # the gradients come back in the features' dtype
    ref_i, ref_t = fp64_reference(images, texts, SCALE)
    errors = relative_error(grad_i, ref_i), relative_error(grad_t, ref_t)
    assert max(errors) < BOUND, errors


def fp64_sigmoid_reference(images: torch.Tensor, texts: torch.Tensor, scale: float, bias: float):
    """d/d(images, texts) of SigLIP's loss, every operation in fp64."""
    i, t = images.double().requires_grad_(), texts.double().requires_grad_()
    signs = 2 * torch.eye(len(i), dtype=torch.float64) - 1
    loss = torch.log1p(torch.exp(-signs * (scale * i @ t.T + bias))).sum() / len(i)
    grad_i, grad_t = torch.autograd.grad(loss, (i, t))
    return grad_i, grad_t


@pytest.mark.parametrize("loss", [SigmoidLoss(), SigmoidLoss(tile_size=96)], ids=["sigmoid", "sigmoid-tiled"])
def test_bf16_sigmoid_gradients_match_fp64(loss):
    images, texts = bf16_pairs()
    i, t = images.clone().requires_grad_(), texts.clone().requires_grad_()
    scale, bias = torch.tensor([SCALE], dtype=torch.bfloat16), torch.tensor([INIT_LOGIT_BIAS], dtype=torch.bfloat16)
    grad_i, grad_t = torch.autograd.grad(loss(i, t, scale, bias), (i, t))
    assert grad_i.dtype == grad_t.dtype == torch.bfloat16
    ref_i, ref_t = fp64_sigmoid_reference(images, texts, SCALE, INIT_LOGIT_BIAS)
    errors = relative_error(grad_i, ref_i), relative_error(grad_t, ref_t)
    assert max(errors) < 3e-3, errors  # fp32 logits: 1.7e-3 (the gradients' rounding); bf16 logits: 5.4e-3


@pytest.mark.parametrize(
    "loss",
    [GroupedContrastiveLoss(), GroupedContrastiveLoss(tile_size=96), SigmoidLoss(), SigmoidLoss(tile_size=96)],
    ids=["infonce", "infonce-tiled", "sigmoid", "sigmoid-tiled"],
)
def test_logits_stay_full_fp32_where_the_model_runs_tf32(loss, monkeypatch):
    """`train.tf32` (on by default) lets GPUs run the model's fp32 products in TF32; the losses' logits, forward
    and tiled backward, are computed in full fp32 regardless (the setting each product sees is recorded)."""
    seen: list[bool] = []
    product = torch.Tensor.__matmul__

    def recording(a, b):
        seen.append(torch.backends.cuda.matmul.allow_tf32)
        return product(a, b)

    monkeypatch.setattr(torch.Tensor, "__matmul__", recording)
    matmul = torch.backends.cuda.matmul
    before, matmul.allow_tf32 = matmul.allow_tf32, True
    try:
        images, texts = bf16_pairs()
        i, t = images.clone().requires_grad_(), texts.clone().requires_grad_()
        scale = torch.tensor([SCALE])
        value = (
            loss(i, t, scale, torch.tensor([INIT_LOGIT_BIAS])) if isinstance(loss, SigmoidLoss) else loss(i, t, scale)
        )
        value.backward()
        assert matmul.allow_tf32  # restored for the model
    finally:
        matmul.allow_tf32 = before
    tiled = bool(loss.tile_size)
    assert len(seen) >= (10 if tiled else 1) and not any(seen), seen
