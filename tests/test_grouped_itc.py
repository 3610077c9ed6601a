"""GBA-ITC against independent computations: open_clip's ClipLoss and a K-times-larger batch (4 gloo ranks)."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from open_clip.loss import ClipLoss

from conftest import run_on_gloo_ranks
from mmpt.distributed import contiguous_group
from mmpt.losses.grouped_itc import GroupedContrastiveLoss, contrastive_cross_entropy

WORLD, ROWS, DIM = 4, 5, 8


def unit(seed, rows=ROWS, dim=DIM):
    return F.normalize(torch.randn(rows, dim, generator=torch.Generator().manual_seed(seed)), dim=-1)


def leaf(t):
    return t.clone().requires_grad_()


def grads_of(loss, *tensors):
    return torch.autograd.grad(loss, tensors)


def check_global_matches_clip_loss(rank):
    image, text, scale = leaf(unit(rank)), leaf(unit(100 + rank)), torch.tensor([9.0], requires_grad=True)
    for tile in (0, 3):
        ours = GroupedContrastiveLoss(tile_size=tile)(image, text, scale)
        mine = (ours, *grads_of(ours, image, text, scale))
        ref = ClipLoss(local_loss=True, gather_with_grad=True, rank=rank, world_size=WORLD)(image, text, scale)
        theirs = (ref, *grads_of(ref, image, text, scale))
        for a, b in zip(mine, theirs):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def check_groups_match_clip_loss_inside_each_group(rank):
    group = contiguous_group(2)
    size, group_rank = dist.get_world_size(group), dist.get_rank(group)
    image, text, scale = leaf(unit(rank)), leaf(unit(100 + rank)), torch.tensor([7.0], requires_grad=True)
    ours = GroupedContrastiveLoss(group)(image, text, scale)
    g_image, g_text, g_scale = grads_of(ours, image, text, scale)
    # Reference: one process's ClipLoss over the group's whole batch, from plainly gathered copies.
    members = [r for r in range(WORLD) if r // 2 == rank // 2]
    all_images = leaf(torch.cat([unit(r) for r in members]))
    all_texts = leaf(torch.cat([unit(100 + r) for r in members]))
    ref_scale = torch.tensor([7.0], requires_grad=True)
    reference = ClipLoss()(all_images, all_texts, ref_scale)
    r_image, r_text, r_scale = grads_of(reference, all_images, all_texts, ref_scale)
    mean_loss = ours.detach().clone()
    dist.all_reduce(mean_loss, group=group)
    torch.testing.assert_close(mean_loss / size, reference.detach(), atol=1e-6, rtol=0)
    rows = slice(group_rank * ROWS, (group_rank + 1) * ROWS)
    # Each rank's loss is its rows' share; the group's summed gradient is size x the group mean's.
    torch.testing.assert_close(g_image, size * r_image[rows], atol=1e-6, rtol=0)
    torch.testing.assert_close(g_text, size * r_text[rows], atol=1e-6, rtol=0)
    dist.all_reduce(g_scale, group=group)
    torch.testing.assert_close(g_scale, size * r_scale, atol=1e-6, rtol=0)


def check_accumulation_equals_one_big_batch(rank, group_size, tile):
    group = contiguous_group(group_size)
    micro, k_steps = 4, 3
    torch.manual_seed(0)  # identical encoder weights on every rank
    image_encoder, text_encoder = torch.nn.Linear(6, DIM), torch.nn.Linear(7, DIM)
    log_scale = torch.nn.Parameter(torch.tensor([2.0]))
    params = [*image_encoder.parameters(), *text_encoder.parameters(), log_scale]
    gen = torch.Generator().manual_seed(10 + rank)
    xs = [torch.randn(micro, 6, generator=gen) for _ in range(k_steps)]
    ys = [torch.randn(micro, 7, generator=gen) for _ in range(k_steps)]
    loss = GroupedContrastiveLoss(group, tile_size=tile)

    def embed(x, y):
        return F.normalize(image_encoder(x), dim=-1), F.normalize(text_encoder(y), dim=-1)

    # One batch of K x micro rows per rank.
    big = loss(*embed(torch.cat(xs), torch.cat(ys)), log_scale.exp())
    big_grads = [g.clone() for g in torch.autograd.grad(big, params)]
    # K micro-batches over a pool, gradients summed.
    with torch.no_grad():
        features = [embed(x, y) for x, y in zip(xs, ys)]
    pool = loss.pool([f[0] for f in features], [f[1] for f in features])
    summed = [torch.zeros_like(p) for p in params]
    for slot, (x, y) in enumerate(zip(xs, ys)):
        micro_loss = loss(*embed(x, y), log_scale.exp(), pool=pool, slot=slot)
        torch.testing.assert_close(micro_loss.detach(), big.detach(), atol=1e-6, rtol=0)
        for total, g in zip(summed, torch.autograd.grad(micro_loss, params)):
            total += g
    for a, b in zip(summed, big_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def run_on_four_ranks(checks):
    run_on_gloo_ranks(__name__, checks, WORLD)


def test_gba_itc_on_four_gloo_ranks():
    run_on_four_ranks(
        [
            ("check_global_matches_clip_loss", ()),
            ("check_groups_match_clip_loss_inside_each_group", ()),
            ("check_accumulation_equals_one_big_batch", (4, 0)),
            ("check_accumulation_equals_one_big_batch", (2, 0)),
            ("check_accumulation_equals_one_big_batch", (2, 5)),
        ]
    )


@pytest.mark.parametrize("tile", [1, 4, 7])
def test_tiled_equals_untiled(tile):
    queries, keys = leaf(unit(1, rows=6, dim=5)), leaf(unit(2, rows=11, dim=5))
    targets = torch.tensor([0, 3, 5, 7, 9, 10])
    scale = torch.tensor([11.0], requires_grad=True)
    tiled = contrastive_cross_entropy(queries, keys, targets, scale, tile_size=tile)
    plain = F.cross_entropy(scale * queries @ keys.T, targets)
    torch.testing.assert_close(tiled, plain, atol=1e-5, rtol=0)
    for a, b in zip(grads_of(tiled, queries, keys, scale), grads_of(plain, queries, keys, scale)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
