"""The contrastive logits at the real world size.

The measured step runs on one rank, where a loss over all ranks' samples sees only its own: the logits grow
with the number of ranks whose features are gathered (and, for GBA-ITC, with the micro-batches pooled per
step), which one rank cannot show. Their bytes are added here: fp32 (the losses compute logits in fp32),
three matrices alive at once (the logits, their softmax, its gradient), both directions for image-text
losses, one per view for SPACE-2's tree loss; a tiled loss holds one column tile at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from mmpt.losses.grouped_itc import GroupedContrastiveLoss
from mmpt.losses.sigmoid import SigmoidLoss
from mmpt.losses.tree_contrastive import TreeContrastiveLoss

LIVE_MATRICES = 3
FP32 = 4


@dataclass(frozen=True)
class Gathering:
    """How many ranks' features one rank's loss sees, and how many micro-batches a step pools."""

    ranks: int
    group: int  # GBA-ITC's gathering group (ranks per node for `auto`)
    pooled: int  # micro-batches pooled per step (pooled accumulation)
    sources: int = 1  # sub-batches per micro-batch (per_source data)


def logits_bytes(loss: nn.Module, micro: int, g: Gathering) -> int:
    """Bytes of the logits one rank's loss holds for a micro-batch of `micro` samples."""
    if isinstance(loss, GroupedContrastiveLoss):
        columns = g.pooled * micro * g.group
        if 0 < loss.tile_size < columns:
            columns = loss.tile_size
        return 2 * micro * columns * FP32 * LIVE_MATRICES
    if isinstance(loss, SigmoidLoss):  # one direction; the rows are the pooled micro-batches
        rows = g.pooled * micro
        blocks = {"gather": g.ranks, "ring": 1, "bidirectional": min(2, g.ranks - 1) or 1}[loss.exchange]
        columns = rows * blocks
        if loss.tile_size is not None and loss.tile_size < columns:
            columns = loss.tile_size
        return rows * columns * FP32 * LIVE_MATRICES
    tree = getattr(loss, "contrastive", loss)
    if isinstance(tree, TreeContrastiveLoss):
        per_source = max(1, micro // g.sources)
        rows = 2 * per_source  # both dropout copies
        return g.sources * len(tree.views) * rows * rows * g.ranks * FP32 * LIVE_MATRICES
    return 0  # losses over local tensors (memory queues) are in the measured step whole


def extra_logits_bytes(loss: nn.Module, micro: int, g: Gathering) -> int:
    """What the real gathering adds to the logits the one-rank measurement already holds."""
    alone = Gathering(ranks=1, group=1, pooled=1, sources=g.sources)
    return max(0, logits_bytes(loss, micro, g) - logits_bytes(loss, micro, alone))
