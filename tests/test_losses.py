"""The contrastive loss against open_clip's ClipLoss, on one process and on 2 gloo ranks."""

import pytest
import torch
import torch.nn.functional as F
from open_clip.loss import ClipLoss

from conftest import run_on_gloo_ranks
from mmpt.distributed import all_gather_with_grad
from mmpt.losses import GroupedContrastiveLoss


def features(seed, rows=6, dim=8):
    generator = torch.Generator().manual_seed(seed)
    image = F.normalize(torch.randn(rows, dim, generator=generator), dim=-1)
    text = F.normalize(torch.randn(rows, dim, generator=generator), dim=-1)
    return image.requires_grad_(), text.requires_grad_()


def test_single_process_matches_open_clip():
    image, text = features(0)
    scale = torch.tensor([12.5], requires_grad=True)
    ours = GroupedContrastiveLoss()(image, text, scale)
    ours.backward()
    grads = [t.grad.clone() for t in (image, text, scale)]
    for t in (image, text, scale):
        t.grad = None
    reference = ClipLoss()(image, text, scale)
    reference.backward()
    torch.testing.assert_close(ours, reference, atol=1e-6, rtol=0)
    for mine, theirs in zip(grads, (image.grad, text.grad, scale.grad)):
        torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=0)


def check_two_ranks_match_open_clip(rank: int) -> None:
    """On each of 2 gloo ranks: loss and gradients equal open_clip's local loss with gathered gradients, and the
    gather itself concatenates in rank order forward and sums every rank's gradient backward."""
    image, text = features(100 + rank)
    scale = torch.tensor([10.0], requires_grad=True)
    ours = GroupedContrastiveLoss()(image, text, scale)
    ours.backward()
    mine = [ours.detach(), image.grad.clone(), text.grad.clone(), scale.grad.clone()]
    for t in (image, text, scale):
        t.grad = None
    theirs = ClipLoss(local_loss=True, gather_with_grad=True, rank=rank, world_size=2)(image, text, scale)
    theirs.backward()
    for a, b in zip(mine, [theirs.detach(), image.grad, text.grad, scale.grad]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    x = torch.full((2, 3), float(rank), requires_grad=True)
    gathered = all_gather_with_grad(x)
    (gathered * torch.arange(1.0, 5.0)[:, None]).sum().backward()
    torch.testing.assert_close(gathered.detach(), torch.tensor([[0.0] * 3] * 2 + [[1.0] * 3] * 2))
    # d/dx of sum_r sum_i w_i * gathered_i: each rank's rows get weights (1,2) or (3,4), times 2 ranks.
    expected = torch.tensor([[2.0] * 3, [4.0] * 3]) if rank == 0 else torch.tensor([[6.0] * 3, [8.0] * 3])
    torch.testing.assert_close(x.grad, expected)


def test_two_ranks_match_open_clip_local_loss_with_gathered_gradients():
    run_on_gloo_ranks("test_losses", [("check_two_ranks_match_open_clip", ())], world=2)


@pytest.mark.parametrize("rows", [1, 5])
def test_loss_is_log_batch_when_features_are_uninformative(rows):
    same = F.normalize(torch.ones(rows, 4), dim=-1)
    loss = GroupedContrastiveLoss()(same, same, torch.tensor([3.0]))
    torch.testing.assert_close(loss, torch.tensor(float(rows)).log())
