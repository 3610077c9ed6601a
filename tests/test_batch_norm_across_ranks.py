"""Batch norm over the global batch (`EngineNeeds.batch_norm_across_ranks`): on 2 gloo ranks, each with
half a batch, outputs, input gradients, summed parameter gradients and running statistics equal torch's
own BatchNorm run on the whole batch in one process."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from conftest import run_on_gloo_ranks
from mmpt.engine.batch_norm import batch_norm_across_ranks

CASES = {
    "1d, no affine (VICTOR's projection heads)": (nn.BatchNorm1d, (8, 5), {"affine": False}),
    "2d, affine": (nn.BatchNorm2d, (8, 3, 4, 4), {}),
    "1d over a length, cumulative average": (nn.BatchNorm1d, (8, 3, 6), {"momentum": None}),
}


def compare_with_whole_batch(rank, case):
    kind, shape, options = CASES[case]
    world = dist.get_world_size()
    generator = torch.Generator().manual_seed(0)
    whole = torch.randn(*shape, generator=generator) * 3 + 1
    weights = torch.randn(*shape, generator=generator)  # the loss: a weighted sum of the outputs
    reference, mine = kind(shape[1], **options), kind(shape[1], **options)
    if mine.affine:
        with torch.no_grad():
            for module in (reference, mine):
                module.weight.copy_(torch.linspace(0.5, 2.0, shape[1]))
                module.bias.copy_(torch.linspace(-1.0, 1.0, shape[1]))
    assert batch_norm_across_ranks(nn.Sequential(mine)) == 1
    rows = slice(rank * shape[0] // world, (rank + 1) * shape[0] // world)
    for _ in range(2):  # the second step starts from the running statistics the first left
        x_whole, x_mine = whole.clone().requires_grad_(), whole[rows].clone().requires_grad_()
        expected = reference(x_whole)
        (expected * weights).sum().backward()
        y = mine(x_mine)
        (y * weights[rows]).sum().backward()
        torch.testing.assert_close(y, expected.detach()[rows], rtol=0, atol=1e-5)
        torch.testing.assert_close(x_mine.grad, x_whole.grad[rows], rtol=0, atol=1e-5)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(mine, name), getattr(reference, name), rtol=0, atol=1e-5)
    if mine.affine:  # each rank's share; the data-parallel all-reduce adds them up
        for name in ("weight", "bias"):
            grad = getattr(mine, name).grad.clone()
            dist.all_reduce(grad)
            torch.testing.assert_close(grad, getattr(reference, name).grad, rtol=0, atol=1e-4)
    mine.eval()  # evaluation uses the running statistics, no collective
    torch.testing.assert_close(mine(whole[rows]), reference.eval()(whole[rows]), rtol=0, atol=1e-5)


@pytest.mark.parametrize("case", sorted(CASES))
def test_two_ranks_normalise_as_one_process_with_the_whole_batch(case):
    run_on_gloo_ranks(__name__, [("compare_with_whole_batch", (case,))], world=2)


def test_without_a_process_group_it_is_torchs_batch_norm():
    plain, mine = nn.BatchNorm1d(4), nn.BatchNorm1d(4)
    batch_norm_across_ranks(mine)
    x = torch.randn(6, 4)
    torch.testing.assert_close(mine(x), plain(x), rtol=0, atol=0)
    assert type(mine).__name__ == "BatchNorm1dAcrossRanks" and batch_norm_across_ranks(mine) == 0
    assert set(mine.state_dict()) == set(plain.state_dict())
