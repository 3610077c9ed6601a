"""Ranks holding different numbers of rows (per-rank batches that follow each rank's speed): every contrastive
loss, each rank's loss weighted by its share of the global batch as the engine weighs it, gives the loss and
gradients of one process computing the whole global batch (open_clip's ClipLoss, SPACE-2's formula
transcribed in float64), on 4 gloo ranks holding 2, 5, 3 and 4 rows."""

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from open_clip.loss import ClipLoss
from test_space2_loss import features_and_labels, reference_view_loss
from tree_score_reference import view_score_matrices

from conftest import run_on_gloo_ranks
from mmpt import distributed as mdist
from mmpt.losses.grouped_itc import GroupedContrastiveLoss
from mmpt.losses.memory_queue import MemoryQueue
from mmpt.losses.tree_contrastive import TreeContrastiveLoss
from mmpt.losses.tree_score import VIEWS

ROWS = (2, 5, 3, 4)
WORLD, TOTAL, DIM = len(ROWS), sum(ROWS), 8
K = 3  # GBA-ITC's micro-batches per step


def mine(rank: int) -> slice:
    start = sum(ROWS[:rank])
    return slice(start, start + ROWS[rank])


def share(rank: int) -> float:
    """What the engine multiplies a rank's loss by: its gradient mean over ranks then weighs rows equally."""
    return WORLD * ROWS[rank] / TOTAL


def unit(seed: int, rows: int = TOTAL) -> torch.Tensor:
    return F.normalize(torch.randn(rows, DIM, generator=torch.Generator().manual_seed(seed)), dim=-1)


def mean_over_ranks(value: torch.Tensor) -> torch.Tensor:
    value = value.detach().clone()
    dist.all_reduce(value)
    return value / WORLD


def with_uneven_rows(check):
    """`check` with the gathers of a run whose ranks hold uneven rows (`Collectives.uneven_rows`)."""

    @functools.wraps(check)
    def checked(*args):
        with mdist.using(mdist.Collectives(uneven_rows=True)):
            return check(*args)

    return checked


@with_uneven_rows
def check_gather(rank):
    everything = torch.arange(TOTAL * 3, dtype=torch.float32).view(TOTAL, 3)
    leaf = everything[mine(rank)].clone().requires_grad_()
    gathered = mdist.gather_rows_with_grad(leaf)
    assert gathered.counts == ROWS and gathered.offset == mine(rank).start
    torch.testing.assert_close(gathered.rows, everything, atol=0, rtol=0)
    weights = torch.randn(TOTAL, 3, generator=torch.Generator().manual_seed(rank))  # a different use on each rank
    (grad,) = torch.autograd.grad((gathered.rows * weights).sum(), leaf)
    summed = weights.clone()
    dist.all_reduce(summed)
    torch.testing.assert_close(grad, summed[mine(rank)], atol=1e-6, rtol=0)


@with_uneven_rows
def check_global_loss(rank):
    images, texts = unit(1), unit(2)
    image, text = images[mine(rank)].clone().requires_grad_(), texts[mine(rank)].clone().requires_grad_()
    scale = torch.tensor(9.0, requires_grad=True)
    loss = share(rank) * GroupedContrastiveLoss()(image, text, scale)
    g_image, g_text, g_scale = torch.autograd.grad(loss, (image, text, scale))
    ref_images, ref_texts = images.clone().requires_grad_(), texts.clone().requires_grad_()
    ref_scale = torch.tensor(9.0, requires_grad=True)
    reference = ClipLoss()(ref_images, ref_texts, ref_scale)
    r_image, r_text, r_scale = torch.autograd.grad(reference, (ref_images, ref_texts, ref_scale))
    torch.testing.assert_close(mean_over_ranks(loss), reference.detach(), atol=1e-6, rtol=0)
    # A rank's features get every rank's loss gradient (the gather's backward): WORLD x the mean's.
    torch.testing.assert_close(g_image, WORLD * r_image[mine(rank)], atol=1e-6, rtol=0)
    torch.testing.assert_close(g_text, WORLD * r_text[mine(rank)], atol=1e-6, rtol=0)
    torch.testing.assert_close(mean_over_ranks(g_scale), r_scale, atol=1e-6, rtol=0)


@with_uneven_rows
def check_grouped_accumulation(rank, group_size, tile):
    """GBA-ITC: K micro-batches per rank of its own size over a pool, groups of `group_size` ranks; against
    each group's ClipLoss over its ranks' K micro-batches at once, weighted by the group's rows."""
    group = mdist.contiguous_group(group_size)
    torch.manual_seed(0)  # the same encoder weights on every rank
    image_encoder, text_encoder = torch.nn.Linear(6, DIM), torch.nn.Linear(7, DIM)
    log_scale = torch.nn.Parameter(torch.tensor(2.0))
    params = [*image_encoder.parameters(), *text_encoder.parameters(), log_scale]

    def inputs(r):  # rank r's K micro-batches of ROWS[r] rows
        gen = torch.Generator().manual_seed(10 + r)
        return [(torch.randn(ROWS[r], 6, generator=gen), torch.randn(ROWS[r], 7, generator=gen)) for _ in range(K)]

    def embed(x, y):
        return F.normalize(image_encoder(x), dim=-1), F.normalize(text_encoder(y), dim=-1)

    loss = GroupedContrastiveLoss(group, tile_size=tile)
    with torch.no_grad():
        features = [embed(x, y) for x, y in inputs(rank)]
    pool = loss.pool([f[0] for f in features], [f[1] for f in features])
    summed = [torch.zeros_like(p) for p in params]
    micro_losses = []
    for slot, (x, y) in enumerate(inputs(rank)):
        micro_loss = share(rank) * loss(*embed(x, y), log_scale.exp(), pool=pool, slot=slot)
        micro_losses.append(micro_loss.detach())
        for total, g in zip(summed, torch.autograd.grad(micro_loss, params)):
            total += g
    reference = torch.zeros(())
    for start in range(0, WORLD, group_size):
        members = range(start, start + group_size)
        rows = [pair for r in members for pair in inputs(r)]
        group_features = embed(torch.cat([x for x, _ in rows]), torch.cat([y for _, y in rows]))
        group_rows = sum(ROWS[r] for r in members) * K
        reference = reference + group_rows / (TOTAL * K) * ClipLoss()(*group_features, log_scale.exp())
    ref_grads = torch.autograd.grad(reference, params)
    for micro_loss in micro_losses:  # every micro-batch's loss is the loss over the whole pool
        torch.testing.assert_close(mean_over_ranks(micro_loss), reference.detach(), atol=1e-6, rtol=0)
    for ours, theirs in zip(summed, ref_grads):
        torch.testing.assert_close(mean_over_ranks(ours), theirs, atol=1e-5, rtol=0)


@with_uneven_rows
def check_tree_loss(rank):
    views = list(range(len(VIEWS)))
    features, labels = features_and_labels(TOTAL, views=len(views), seed=11)
    features = features.float()
    leaf = features[mine(rank)].clone().requires_grad_(True)
    loss = share(rank) * TreeContrastiveLoss(views)(leaf, labels[mine(rank)])
    (grad,) = torch.autograd.grad(loss, leaf)
    ref_leaf = features.double().clone().requires_grad_(True)
    normed = F.normalize(ref_leaf, dim=-1)
    weights = view_score_matrices(labels, labels).double()
    reference = sum(reference_view_loss(normed[:, :, k], weights[k]) for k in views) / len(views)
    (ref_grad,) = torch.autograd.grad(reference, ref_leaf)
    torch.testing.assert_close(mean_over_ranks(loss).double(), reference, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad.double(), WORLD * ref_grad[mine(rank)], atol=1e-5, rtol=1e-4)


@with_uneven_rows
def check_memory_queue(rank):
    """VICTOR's queue: a push of uneven keys enqueues every rank's, in rank order."""
    queue = MemoryQueue(size=32, dim=DIM)
    keys = unit(3)
    queue.push(keys[mine(rank)])
    torch.testing.assert_close(queue.contents(), keys, atol=0, rtol=0)


def test_every_contrastive_loss_with_uneven_rows_equals_the_global_batch():
    run_on_gloo_ranks(
        __name__,
        [
            ("check_gather", ()),
            ("check_global_loss", ()),
            ("check_grouped_accumulation", (WORLD, 0)),
            ("check_grouped_accumulation", (2, 0)),
            ("check_grouped_accumulation", (2, 4)),
            ("check_tree_loss", ()),
            ("check_memory_queue", ()),
        ],
        WORLD,
    )
