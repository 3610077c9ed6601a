"""SPACE-2's soft supervised contrastive loss over all ranks' examples (spec §4).

Each example is encoded twice (dropout makes the copies differ). For every tree view k, anchor r
weighs every other copy c by the tree score W_k of their examples (the other copy of itself by 1)
and the loss is the score-weighted mean of log-softmax over all other copies, scaled by
τ/τ_base. Unlabelled examples score 0 against everything, so for them this is the self-supervised
(SimCSE-style) loss; with every label empty it is exactly that.

Distributed, as our design: each rank scores its own anchors against every rank's copies (gathered
with gradient) using scores of its labels against all gathered labels, and takes the mean over its
anchors; averaging over ranks (the engine's gradient mean) gives the loss of the global batch. The
official code computes the loss per GPU only. Labels travel as tensors (`tree_score.LabelCodes`, made
by the data pipeline) and are scored on the device, so the step gathers no Python objects.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from mmpt.distributed import all_gather_with_grad, gather_rows_with_grad
from mmpt.losses.tree_score import MAX_LABEL_ELEMENTS, LabelCodes, code_score_matrices, encode_labels


def soft_supcon(
    anchors: torch.Tensor,
    candidates: torch.Tensor,
    weights: torch.Tensor,
    row_offset: int,
    temperature: float,
    base_temperature: float,
) -> torch.Tensor:
    """Per-view loss of n local examples against N gathered ones, mean over the 2n local anchors.

    anchors [K, n, 2, d] and candidates [K, N, 2, d] are L2-normalised; weights [K, n, N] are the
    example-level scores with 1 at (i, row_offset + i).
    """
    views, n, _, dim = anchors.shape
    total = candidates.shape[1]
    rows = anchors.transpose(1, 2).reshape(views, 2 * n, dim)  # copy 1 of every example, then copy 2
    cols = candidates.transpose(1, 2).reshape(views, 2 * total, dim)
    logits = rows @ cols.transpose(1, 2) / temperature  # [K, 2n, 2N]
    local = torch.arange(n, device=anchors.device)
    self_col = torch.cat([local + row_offset, local + row_offset + total])  # where each anchor sits among columns
    # A comparison, not an indexed write of True (that copies the scalar to the GPU and waits for the device).
    is_self = torch.arange(2 * total, device=anchors.device)[None, :] == self_col[:, None]  # [2n, 2N]
    logits = logits.masked_fill(is_self, float("-inf"))
    log_prob = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    tiled = weights.float().repeat(1, 2, 2).masked_fill(is_self, 0.0)
    per_anchor = (tiled * log_prob.masked_fill(is_self, 0.0)).sum(-1) / tiled.sum(-1)
    return -(temperature / base_temperature) * per_anchor.mean()


class TreeContrastiveLoss(nn.Module):
    """`loss(features [n, 2, K, d], labels)`: mean over the K views of the soft SupCon loss.

    `views` are indices into `tree_score.VIEWS` in the order of the feature's K axis; `combined`
    uses one feature and the combined tree score instead (SPACE-2 without projection heads).
    """

    def __init__(
        self, views: Sequence[int], *, combined: bool = False, temperature: float = 0.07, base_temperature: float = 0.07
    ):
        super().__init__()
        if combined and len(views) != 1:
            raise ValueError("the combined tree score goes with exactly one feature")
        self.views, self.combined = list(views), combined
        self.temperature, self.base_temperature = temperature, base_temperature

    def scores(self, labels: LabelCodes) -> tuple[torch.Tensor, int]:
        """Scores [K, n, N] of this rank's labels against every rank's, and where this rank's rows start."""
        frames = gather_rows_with_grad(labels.frames)
        everyone = LabelCodes(all_gather_with_grad(labels.views), frames.rows)
        return code_score_matrices(labels, everyone, frames.offset, self.views, combined=self.combined), frames.offset

    def forward(self, features: torch.Tensor, labels: LabelCodes | list[dict]) -> torch.Tensor:
        """`labels`: the batch's encoded labels, or the label dicts themselves (encoded here)."""
        n, copies, views, dim = features.shape
        if copies != 2 or views != len(self.views):
            raise ValueError(f"features must be [n, 2, {len(self.views)}, d], got {list(features.shape)}")
        if not isinstance(labels, LabelCodes):
            labels = encode_labels(labels, MAX_LABEL_ELEMENTS)
        features = F.normalize(features.float(), dim=-1)  # the loss in fp32 whatever the training precision
        gathered = all_gather_with_grad(features.reshape(n, -1)).view(-1, copies, views, dim)
        weights, offset = self.scores(LabelCodes(labels.views.to(features.device), labels.frames.to(features.device)))
        return soft_supcon(
            features.permute(2, 0, 1, 3),
            gathered.permute(2, 0, 1, 3),
            weights,
            offset,
            self.temperature,
            self.base_temperature,
        )
