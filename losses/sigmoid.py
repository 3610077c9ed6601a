"""SigLIP's pairwise sigmoid loss (Zhai et al., arXiv 2303.15343), across ranks and tiled.

Every image-text pair of the global batch is an independent binary problem: with logits
`l_ij = t * x_i . y_j + b` (t the logit scale multiplier, b a learnable bias), a rank's loss is
`-(1/b_rank) * sum_i sum_j log sigmoid(z_ij * l_ij)` over its own images i and every rank's texts j, z_ij = 1
for a matching pair and -1 otherwise. Summed over ranks (the engine averages gradients, as DDP does in
open_clip) that is the paper's `1/|B|` normalisation.

Texts reach the other ranks by one of open_clip's exchanges, each exact:
- `gather`: every rank's texts at once (one all-gather; the gradient comes back by reduce-scatter);
- `ring`: the texts move one neighbour a step, N - 1 steps, one block of texts held at a time;
- `bidirectional`: two blocks move at once, one each way round the ring: half the steps.

Tiling (`tile_size`): each block of texts is scored a tile of columns at a time, and the backward recomputes
the tiles, so the loss holds rows x tile logits instead of rows x columns. Precision: features are upcast to
fp32 on entry; logits, sigmoids and their sums are fp32 whatever the model's precision.

Pooled accumulation (`pool`, `slot`): with K micro-batches a step, the pool holds all K micro-batches'
features (without gradient); pass k puts micro-batch k's fresh features in their slot, so every pass computes
the loss of the K-times larger batch with gradient through micro-batch k only, and the K gradients sum to
that batch's gradient. The scale and bias let 1/K of their gradient through in each pass.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mmpt.distributed import gather_rows_with_grad, get_world_size, rows_per_rank
from mmpt.losses.contrastive import full_fp32, upcast
from mmpt.losses.grouped_itc import pass_share, with_slot

Exchange = Literal["bidirectional", "ring", "gather"]
EXCHANGES: tuple[Exchange, ...] = ("bidirectional", "ring", "gather")
INIT_LOGIT_SCALE = math.log(10.0)  # the paper's initialisation: t = exp(t') with t' = log 10, and b = -10
INIT_LOGIT_BIAS = -10.0


@full_fp32()
def sigmoid_block(
    images: torch.Tensor,
    texts: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor,
    positives_at: int | None,
    tile_size: int | None = None,
) -> torch.Tensor:
    """`-sum_ij log sigmoid(z_ij * (scale * images_i . texts_j + bias))`, fp32; the pairs (i, positives_at + i)
    match (None: none do). Tiled over `texts` when 0 < tile_size < len(texts)."""
    if tile_size is not None and tile_size < texts.shape[0]:
        return _TiledSigmoid.apply(images, texts, scale, bias, positives_at, tile_size)
    logits = scale.float() * (images.float() @ texts.float().T) + bias.float()
    signs = -torch.ones_like(logits)
    if positives_at is not None:
        signs.diagonal(positives_at).fill_(1.0)
    return -F.logsigmoid(signs * logits).sum()


class _TiledSigmoid(torch.autograd.Function):
    """`sigmoid_block` a tile of columns at a time. Every pair is first scored as a negative; the matching pairs
    then swap their term: `-log sigmoid(l) = -log sigmoid(-l) - l`. The gradient of a logit is `sigmoid(l)`,
    less 1 where the pair matches; the backward recomputes each tile's logits exactly as the forward did."""

    @staticmethod
    @full_fp32()
    def forward(ctx, images, texts, scale, bias, positives_at: int | None, tile: int):
        rows, s, b = images.float(), scale.float(), bias.float()
        total = torch.zeros((), dtype=torch.float32, device=images.device)
        for start in range(0, texts.shape[0], tile):
            logits = s * (rows @ texts[start : start + tile].float().T) + b
            total = total - F.logsigmoid(-logits).sum()
        if positives_at is not None:
            matching = texts[positives_at : positives_at + rows.shape[0]].float()
            total = total - (s * (rows * matching).sum(-1) + b).sum()
        ctx.save_for_backward(images, texts, scale, bias)
        ctx.positives_at, ctx.tile = positives_at, tile
        return total

    @staticmethod
    @full_fp32()
    def backward(ctx, grad_out):
        images, texts, scale, bias = ctx.saved_tensors
        rows, s, b, tile = images.float(), scale.float(), bias.float(), ctx.tile
        grad_rows = torch.zeros_like(rows)
        grad_cols = torch.zeros(texts.shape, dtype=torch.float32, device=texts.device)
        grad_s = torch.zeros((), dtype=torch.float32, device=images.device)
        grad_b = torch.zeros((), dtype=torch.float32, device=images.device)
        for start in range(0, texts.shape[0], tile):
            block = texts[start : start + tile].float()
            dots = rows @ block.T
            probs = torch.sigmoid(s * dots + b)
            grad_rows += probs @ block
            grad_cols[start : start + tile] += probs.T @ rows
            grad_s += (probs * dots).sum()
            grad_b += probs.sum()
        if ctx.positives_at is not None:
            at, n = ctx.positives_at, rows.shape[0]
            matching = texts[at : at + n].float()
            grad_rows -= matching
            grad_cols[at : at + n] -= rows
            grad_s -= (rows * matching).sum()
            grad_b -= n
        g = grad_out.float()
        return (
            (g * s * grad_rows).to(images.dtype),
            (g * s * grad_cols).to(texts.dtype),
            (g * grad_s).reshape(scale.shape).to(scale.dtype),
            (g * grad_b).reshape(bias.shape).to(bias.dtype),
            None,
            None,
        )


class _Shift(torch.autograd.Function):
    """Each tensor sent `shift` ranks on round the ring and replaced by the one arriving from `shift` ranks back
    (its rows given); the gradient travels the other way."""

    @staticmethod
    def forward(ctx, group, shifts: tuple[int, ...], arriving_rows: tuple[int, ...], *tensors: torch.Tensor):
        ctx.group, ctx.shifts = group, shifts
        ctx.shapes = [t.shape for t in tensors]
        received = [t.new_empty((rows, *t.shape[1:])) for t, rows in zip(tensors, arriving_rows)]
        _exchange(group, shifts, [t.contiguous() for t in tensors], received)
        return tuple(received)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        back = [g.new_empty(shape) for g, shape in zip(grads, ctx.shapes)]
        _exchange(ctx.group, tuple(-shift for shift in ctx.shifts), [g.contiguous() for g in grads], back)
        return (None, None, None, *back)


def _exchange(group, shifts: tuple[int, ...], sends: list[torch.Tensor], receives: list[torch.Tensor]) -> None:
    size, rank = dist.get_world_size(group), dist.get_rank(group)

    def peer(group_rank: int) -> int:
        return dist.get_global_rank(group, group_rank % size) if group is not None else group_rank % size

    ops = []
    for shift, send, receive in zip(shifts, sends, receives):
        ops.append(dist.P2POp(dist.isend, send, peer(rank + shift), group))
        ops.append(dist.P2POp(dist.irecv, receive, peer(rank - shift), group))
    for request in dist.batch_isend_irecv(ops):
        request.wait()


class SigmoidPool(NamedTuple):
    """One step's features without gradient, this rank's K micro-batches in order (a named tuple: see
    `mmpt.losses.grouped_itc.FeaturePool`)."""

    images: torch.Tensor  # [K*b, D] fp32
    texts: torch.Tensor
    micro_batches: int


class SigmoidLoss(nn.Module):
    """Called as `loss(image_features, text_features, logit_scale, logit_bias)` (the scale already exponentiated).

    `exchange`: how texts reach the other ranks (see the module docstring); `tile_size`: columns per tile (None:
    untiled); `group`: the process group (None: all ranks).
    """

    def __init__(self, exchange: Exchange = "bidirectional", tile_size: int | None = None, group=None):
        super().__init__()
        if exchange not in EXCHANGES:
            raise ValueError(f"unknown exchange {exchange!r}; one of {', '.join(EXCHANGES)}")
        if tile_size is not None and tile_size <= 0:
            raise ValueError(f"tile_size must be positive (None: untiled), not {tile_size}")
        self.exchange, self.tile_size, self.group = exchange, tile_size, group

    @torch.no_grad()
    def pool(self, image_features: list[torch.Tensor], text_features: list[torch.Tensor]) -> SigmoidPool:
        return SigmoidPool(upcast(torch.cat(image_features)), upcast(torch.cat(text_features)), len(image_features))

    def forward(
        self,
        image_features: torch.Tensor,
        text_features: torch.Tensor,
        logit_scale: torch.Tensor,
        logit_bias: torch.Tensor,
        pool: SigmoidPool | None = None,
        slot: int = 0,
    ) -> torch.Tensor:
        images, texts, scale, bias = upcast(image_features), upcast(text_features), logit_scale, logit_bias
        if pool is not None:
            k = pool.micro_batches
            mine = (images.shape[0],)
            images, texts = with_slot(pool.images, images, slot, k, mine), with_slot(pool.texts, texts, slot, k, mine)
            scale, bias = pass_share(logit_scale, k), pass_share(logit_bias, k)
        return self._sum_over_texts(images, texts, scale, bias) / images.shape[0]

    def _sum_over_texts(self, images, texts, scale, bias) -> torch.Tensor:
        size, tile = get_world_size(self.group), self.tile_size
        if size == 1:
            return sigmoid_block(images, texts, scale, bias, 0, tile)
        if self.exchange == "gather":
            gathered = gather_rows_with_grad(texts, self.group)
            return sigmoid_block(images, gathered.rows, scale, bias, gathered.offset, tile)
        counts, rank = rows_per_rank(texts.shape[0], self.group), dist.get_rank(self.group)
        total = sigmoid_block(images, texts, scale, bias, 0, tile)
        ahead = behind = texts  # blocks travelling up and down the ring, arrived from `step` ranks away
        both_ways, one_way = divmod(size - 1, 2) if self.exchange == "bidirectional" else (0, size - 1)
        for step in range(1, both_ways + 1):
            rows = (counts[(rank - step) % size], counts[(rank + step) % size])
            ahead, behind = _Shift.apply(self.group, (1, -1), rows, ahead, behind)
            total = total + sigmoid_block(images, ahead, scale, bias, None, tile)
            total = total + sigmoid_block(images, behind, scale, bias, None, tile)
        for step in range(both_ways + 1, both_ways + one_way + 1):
            (ahead,) = _Shift.apply(self.group, (1,), (counts[(rank - step) % size],), ahead)
            total = total + sigmoid_block(images, ahead, scale, bias, None, tile)
        return total
