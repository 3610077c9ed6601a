"""GBA-ITC: grouped image-text contrastive loss with batch accumulation and tiled logits.

Our definition of M²-Encoder's "Grouped-ITC with Batch Accumulation" (the official code releases no
training code; see docs/gba_itc.md):

- **Grouping.** Ranks form contiguous groups of `group_size`; features are gathered (with gradient)
  inside the group only. With one group of all ranks this is open_clip's
  `ClipLoss(local_loss=True, gather_with_grad=True)`.
- **Batch accumulation.** For K micro-batches per optimizer step, `pool()` embeds all of them
  without gradient and gathers them in the group; micro-batch k then re-embeds with gradient,
  takes its slot in the pool (its fresh features gathered in the group) and the loss is computed
  over the whole pool. Summed over k (no 1/K), the encoder gradient equals that of one K-times
  larger batch. `logit_scale` enters every one of the K losses with its full gradient, so each
  pass lets 1/K of it through (`s.detach() + (s - s.detach()) / K`): the sum is exact. Ranks may hold
  different numbers of rows; a rank's K micro-batches have one size.
- **Tiling.** Each cross-entropy is computed over column tiles with an online log-sum-exp and a
  backward that recomputes the tiles, so the b x columns logits matrix never exists.
- **Precision.** Features are upcast to fp32 on entry (the pool after its gather): logits, softmax and
  log-sum-exp are fp32 whatever the features' dtype, and gradients go back in the features' dtype.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mmpt.distributed import all_gather_with_grad, gather_rows_with_grad
from mmpt.losses.contrastive import full_fp32, scaled_logits, upcast


class _TiledCrossEntropy(torch.autograd.Function):
    """mean_i [ logsumexp_j(s q_i.k_j) - s q_i.k_{t_i} ], never holding more than rows x tile logits.

    Everything is computed in fp32 from fp32 upcasts of the (possibly bf16) inputs, and the backward
    recomputes each tile's logits exactly as the forward did (`s * (rows @ block.T)`, fp32 operands): its softmax
    `exp(logits - lse)` then sums to one against the forward's log-sum-exp. Logits rounded differently in
    the two passes (bf16 products scaled in fp32) left the gradient ~2.5% off at a logit scale of 100.
    """

    @staticmethod
    @full_fp32()
    def forward(ctx, queries, keys, targets, scale, tile: int):
        rows, s = queries.float(), scale.float()
        lse = torch.full((queries.shape[0],), float("-inf"), dtype=torch.float32, device=queries.device)
        for start in range(0, keys.shape[0], tile):
            block = keys[start : start + tile].float()
            lse = torch.logaddexp(lse, torch.logsumexp(s * (rows @ block.T), dim=1))
        positive = s * (rows * keys[targets].float()).sum(-1)
        ctx.save_for_backward(queries, keys, targets, scale, lse)  # the inputs, not fp32 copies of them
        ctx.tile = tile
        return (lse - positive).mean()

    @staticmethod
    @full_fp32()
    def backward(ctx, grad_out):
        queries, keys, targets, scale, lse = ctx.saved_tensors
        rows, s = queries.float(), scale.float()
        coef = grad_out.float() / queries.shape[0]
        grad_q = torch.zeros_like(rows)
        grad_k = torch.zeros(keys.shape, dtype=torch.float32, device=keys.device)
        grad_s = torch.zeros((), dtype=torch.float32, device=queries.device)
        for start in range(0, keys.shape[0], ctx.tile):
            block = keys[start : start + ctx.tile].float()
            dots = rows @ block.T
            probs = torch.exp(s * dots - lse[:, None])  # softmax of this tile's columns, as the forward rounded it
            grad_q += probs @ block
            grad_k[start : start + ctx.tile] += probs.T @ rows
            grad_s += (probs * dots).sum()
        positives = keys[targets].float()
        grad_q -= positives
        grad_k.index_add_(0, targets, -rows)
        grad_s -= (rows * positives).sum()
        return (
            (coef * s * grad_q).to(queries.dtype),
            (coef * s * grad_k).to(keys.dtype),
            None,
            (coef * grad_s).reshape(scale.shape).to(scale.dtype),
            None,
        )


def contrastive_cross_entropy(
    queries: torch.Tensor, keys: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor, tile_size: int = 0
) -> torch.Tensor:
    """Mean CE of `scale * queries @ keys.T` against `targets`, in fp32 (see `scaled_logits`); tiled when
    0 < tile_size < len(keys). The gradients come back in the inputs' dtype."""
    if 0 < tile_size < keys.shape[0]:
        return _TiledCrossEntropy.apply(queries, keys, targets, scale, tile_size)
    return F.cross_entropy(scaled_logits(queries, keys, scale), targets)


class FeaturePool(NamedTuple):
    """One optimizer step's features, without gradient: local rows and the group's columns. A named tuple, so
    that ZeRO-3's module hooks, which look for tensors in every module's inputs, find these (and leave them be:
    they take no part in backward) instead of warning about an unknown input type."""

    images: torch.Tensor  # [K*b, D] fp32, this rank's micro-batches in order
    texts: torch.Tensor
    group_images: torch.Tensor  # [G*K*b, D], ordered (group rank, micro-batch, row)
    group_texts: torch.Tensor
    micro_batches: int


class GroupedContrastiveLoss(nn.Module):
    """Called like open_clip's ClipLoss: `loss(image_features, text_features, logit_scale)`.

    `group`: the process group to gather in (None = all ranks). Build it with
    `mmpt.distributed.contiguous_group(group_size)`.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, tile_size: int = 0):
        super().__init__()
        self.group, self.tile_size = group, tile_size

    @torch.no_grad()
    def pool(self, image_features: list[torch.Tensor], text_features: list[torch.Tensor]) -> FeaturePool:
        """The negative pool of a step from its K micro-batches' features (computed without gradient)."""
        images, texts = torch.cat(image_features), torch.cat(text_features)
        # Gathered in the features' dtype (half the bytes of fp32), upcast after: the same values.
        return FeaturePool(
            upcast(images),
            upcast(texts),
            upcast(all_gather_with_grad(images, self.group)),
            upcast(all_gather_with_grad(texts, self.group)),
            len(image_features),
        )

    def forward(
        self,
        image_features: torch.Tensor,
        text_features: torch.Tensor,
        logit_scale: torch.Tensor,
        pool: FeaturePool | None = None,
        slot: int = 0,
    ) -> torch.Tensor:
        image_features, text_features = upcast(image_features), upcast(text_features)
        gathered = gather_rows_with_grad(image_features, self.group)
        group_images, group_texts = gathered.rows, all_gather_with_grad(text_features, self.group)
        rows_i, rows_t, scale, offset = image_features, text_features, logit_scale, gathered.offset
        if pool is not None:
            k, mine = pool.micro_batches, (len(image_features),)
            rows_i = with_slot(pool.images, image_features, slot, k, mine)
            rows_t = with_slot(pool.texts, text_features, slot, k, mine)
            group_images = with_slot(pool.group_images, group_images, slot, k, gathered.counts)
            group_texts = with_slot(pool.group_texts, group_texts, slot, k, gathered.counts)
            scale = pass_share(logit_scale, k)
            offset *= k  # a rank's K micro-batches sit together in the pool
        targets = torch.arange(len(rows_i), device=rows_i.device) + offset
        return 0.5 * (
            contrastive_cross_entropy(rows_i, group_texts, targets, scale, self.tile_size)
            + contrastive_cross_entropy(rows_t, group_images, targets, scale, self.tile_size)
        )


def pass_share(value: torch.Tensor, micro_batches: int) -> torch.Tensor:
    """`value` unchanged, with 1/K of its gradient: a parameter that enters every one of a pooled step's K
    losses whole then gets its gradient once in the sum."""
    return value.detach() + (value - value.detach()) / micro_batches


def with_slot(
    pool: torch.Tensor, fresh: torch.Tensor, slot: int, micro_batches: int, counts: tuple[int, ...]
) -> torch.Tensor:
    """`pool` laid out (rank, micro-batch, row) with every rank's micro-batch `slot` replaced by `fresh`
    (`counts[r]` rows of rank r, in rank order; a rank's micro-batches are all that size)."""
    if pool.shape[0] != micro_batches * sum(counts):
        raise ValueError(f"the pool has {pool.shape[0]} rows, not {micro_batches} micro-batches of {counts} rows")
    device = pool.device  # the rows' places made there from the host's counts: no tensor is read or copied over
    if len(set(counts)) == 1:
        rows = counts[0]
        ranks = torch.arange(len(counts), device=device)[:, None]
        where = (ranks * (micro_batches * rows) + slot * rows + torch.arange(rows, device=device)).reshape(-1)
    else:
        starts = [sum(counts[:rank]) for rank in range(len(counts))]
        where = torch.cat(
            [torch.arange(n, device=device) + (micro_batches * start + slot * n) for start, n in zip(starts, counts)]
        )
    return pool.index_copy(0, where, fresh)
