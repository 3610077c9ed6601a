"""VICTOR's proxy tasks: how their inputs are corrupted and the loss of each.

Inputs (all random draws from torch's generator, which the engine seeds and checkpoints):
- `mask_tokens`: BERT masking, 15% of the real tokens ([CLS]/[SEP]/padding never), 80% [MASK],
  10% a random token, 10% kept.
- `permute_sentences` / `permute_frames`: cut the real tokens (between [CLS] and [SEP]) or the T
  frames into 3 contiguous, near-equal segments and reorder them by one of the 3! permutations;
  the permutation index is the 6-way label (MSOM, MFOM).
- `mask_frames`: a fraction of the T frames of each clip (at least one) for masked frame modelling.

Losses (each an independent formula, see tests/test_victor_losses.py):
- `order_loss`: cross-entropy of the 6-way order classifier.
- `intra_mfm_loss`: the output at a masked step t against the clip's own input frame features,
  positive at t, the other steps negatives (InfoNCE on cosine similarity / temperature).
- `inter_mfm_loss`: the output at t against the key network's frame feature at t, the frames
  queue as negatives.
- `queue_nce` / `dual_vsa_loss`: MoCo InfoNCE of a pooled query against its paired key, the other
  modality's queue as negatives; dual-VSA averages video->text and text->video.
- MLM: `losses.mlm.masked_lm_loss` over the masked tokens (labels other than IGNORE).
"""

from __future__ import annotations

import functools
import itertools
from typing import Literal

import torch
import torch.nn.functional as F

from mmpt.losses.mlm import IGNORE

PERMUTATIONS: tuple[tuple[int, ...], ...] = tuple(itertools.permutations(range(3)))


def segment_order(length: int, permutation: tuple[int, ...]) -> list[int]:
    """Indices that reorder `length` items cut into len(permutation) contiguous near-equal segments:
    segment permutation[0] first, then permutation[1], ... (segment i covers [i*L//S, (i+1)*L//S))."""
    count = len(permutation)
    bounds = [i * length // count for i in range(count + 1)]
    return [index for segment in permutation for index in range(bounds[segment], bounds[segment + 1])]


def random_permutations(batch: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """One permutation index in [0, 6) per example, uniformly."""
    return torch.randint(len(PERMUTATIONS), (batch,), device=device)


@functools.cache
def _table(steps: int | None, device: torch.device) -> torch.Tensor:
    """On `device`, made once: the 6 permutations [6, 3] (steps None) or their frame orders [6, steps]."""
    rows = PERMUTATIONS if steps is None else [segment_order(steps, p) for p in PERMUTATIONS]
    return torch.tensor(rows, dtype=torch.long, device=device)


def permute_frames(frames: torch.Tensor, permutation_ids: torch.Tensor) -> torch.Tensor:
    """frames [B, T, ...] with each clip's T steps reordered by its permutation."""
    order = _table(frames.shape[1], frames.device)[permutation_ids]
    index = order.view(*order.shape, *([1] * (frames.ndim - 2))).expand_as(frames)
    return frames.gather(1, index)


def permute_sentences(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, permutation_ids: torch.Tensor, *aligned: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """Reorder the real tokens of each row (positions 1 .. n-2, between [CLS] and [SEP]) by its permutation.

    `aligned` tensors of the same shape (e.g. MLM labels) get the same reordering. Returns the
    reordered input_ids followed by the reordered aligned tensors. Rows have different lengths, so the
    source of every position is computed with tensor ops on the device (no per-row loop, no host read):
    output position j of the inner tokens lies in the o-th placed segment, which is original segment
    perm[o], at the same offset from its start.
    """
    rows, width = input_ids.shape
    inner = (attention_mask.sum(1, keepdim=True) - 2).clamp(min=0)  # [B, 1] tokens between [CLS] and [SEP]
    cuts = torch.cat([inner * i // 3 for i in range(4)], dim=1)  # [B, 4] bounds of the original segments
    sizes = cuts[:, 1:] - cuts[:, :-1]
    placed = _table(None, input_ids.device)[permutation_ids]  # [B, 3] original segment shown 1st, 2nd, 3rd
    placed_ends = sizes.gather(1, placed).cumsum(1)  # [B, 3] where each placed segment ends in the output
    position = torch.arange(width, device=input_ids.device).expand(rows, width)
    j = position - 1  # index among the inner tokens
    o = (j >= placed_ends[:, :1]).long() + (j >= placed_ends[:, 1:2]).long()
    o = o.clamp(max=2)
    source_segment = placed.gather(1, o)
    offset = j - (placed_ends.gather(1, o) - sizes.gather(1, source_segment))
    source = 1 + cuts.gather(1, source_segment) + offset
    index = torch.where((j >= 0) & (j < inner), source, position)
    return tuple(t.gather(1, index) for t in (input_ids, *aligned))


def mask_tokens(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    mask_id: int,
    vocab_size: int,
    probability: float = 0.15,
    first_regular_id: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(masked input_ids, labels): labels hold the original id where a token was chosen, IGNORE elsewhere.

    Candidates are the real tokens except the first ([CLS]) and last ([SEP]) of each row. Random
    replacements are drawn from [first_regular_id, vocab_size), so no special token is inserted.
    """
    lengths = attention_mask.sum(1, keepdim=True)
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
    candidate = (positions >= 1) & (positions < lengths - 1)
    chosen = candidate & (torch.rand(input_ids.shape, device=input_ids.device) < probability)
    labels = torch.where(chosen, input_ids, torch.full_like(input_ids, IGNORE))
    draw = torch.rand(input_ids.shape, device=input_ids.device)
    random_ids = torch.randint(first_regular_id, vocab_size, input_ids.shape, device=input_ids.device)
    masked = torch.where(chosen & (draw < 0.8), torch.full_like(input_ids, mask_id), input_ids)
    masked = torch.where(chosen & (draw >= 0.8) & (draw < 0.9), random_ids, masked)
    return masked, labels


def mask_frames(batch: int, steps: int, ratio: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """Boolean [B, T]: round(ratio * T) frames per clip (at least one), chosen uniformly without replacement."""
    count = max(1, round(ratio * steps))
    ranks = torch.rand(batch, steps, device=device).argsort(1).argsort(1)
    return ranks < count


def order_loss(logits: torch.Tensor, permutation_ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), permutation_ids)


def intra_mfm_loss(
    outputs: torch.Tensor, frame_inputs: torch.Tensor, frame_mask: torch.Tensor, temperature: float
) -> torch.Tensor:
    """outputs, frame_inputs [B, T, D]; frame_mask [B, T]. Mean over masked (b, t) of
    -log softmax_s(cos(out[b, t], in[b, s]) / temperature)[s = t]."""
    out = F.normalize(outputs.float(), dim=-1)
    inputs = F.normalize(frame_inputs.float(), dim=-1)
    logits = out @ inputs.transpose(1, 2) / temperature  # [B, T, T]: step t against every step s of its clip
    targets = torch.arange(outputs.shape[1], device=outputs.device).expand(outputs.shape[0], -1)
    per_step = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
    return masked_mean(per_step, frame_mask.flatten())


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` where `mask` is True (0 where it is nowhere), as a masked sum over every element
    divided by the count: selecting the elements first would size a tensor by a value on the device, which a
    GPU step must stop and read back."""
    weights = mask.to(values.dtype)
    return (values * weights).sum() / weights.sum().clamp(min=1)


def queue_nce(
    queries: torch.Tensor,
    keys: torch.Tensor,
    queue: torch.Tensor,
    scale: torch.Tensor | float,
    reduction: Literal["mean", "none"] = "mean",
) -> torch.Tensor:
    """MoCo InfoNCE: queries [N, D] against their keys [N, D] (positives) and queue [K, D] (negatives);
    all L2-normalised; `scale` = 1 / temperature. The mean over the N queries, or each one's term."""
    positive = (queries * keys).sum(-1, keepdim=True)
    negative = queries @ queue.to(queries.dtype).T
    logits = torch.cat([positive, negative], dim=1).float() * scale
    targets = torch.zeros(queries.shape[0], dtype=torch.long, device=queries.device)
    return F.cross_entropy(logits, targets, reduction=reduction)


def inter_mfm_loss(
    outputs: torch.Tensor, key_frames: torch.Tensor, frame_mask: torch.Tensor, queue: torch.Tensor, temperature: float
) -> torch.Tensor:
    """outputs, key_frames [B, T, D]; at each masked (b, t): key_frames[b, t] positive, queue [K, D] negatives.
    Every step is scored and the masked ones averaged (`masked_mean`)."""
    out = F.normalize(outputs.flatten(0, 1).float(), dim=-1)
    keys = F.normalize(key_frames.flatten(0, 1).float(), dim=-1)
    per_step = queue_nce(out, keys, F.normalize(queue.float(), dim=-1), 1.0 / temperature, reduction="none")
    return masked_mean(per_step, frame_mask.flatten())


def dual_vsa_loss(
    video: torch.Tensor,
    text: torch.Tensor,
    video_keys: torch.Tensor,
    text_keys: torch.Tensor,
    text_queue: torch.Tensor,
    video_queue: torch.Tensor,
    scale: torch.Tensor | float,
) -> torch.Tensor:
    """0.5 * (video query vs its text key, textual queue negatives + text query vs its video key, visual queue)."""
    return 0.5 * (queue_nce(video, text_keys, text_queue, scale) + queue_nce(text, video_keys, video_queue, scale))
