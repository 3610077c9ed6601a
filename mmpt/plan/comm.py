"""Bytes one rank sends per optimizer step, for ring collectives: an all-gather or a reduce-scatter of S bytes
over n ranks sends S (n - 1) / n per rank, an all-reduce twice that.

ZeRO-0 all-reduces the gradients once per step; ZeRO-1 reduce-scatters them once per step and ZeRO-2 after
every micro-batch, both then all-gather the updated 16-bit weights; ZeRO-3 gathers the weights for the forward
and again for the backward of every micro-batch (the backward's within the hpZ group when ZeRO++ is on) and
reduce-scatters the gradients after each. Feature gathers: a global loss all-gathers both modalities'
features every micro-batch (and their gradients back); GBA-ITC gathers the pooled features of a step once and
each micro-batch's fresh features again, inside its group.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Traffic:
    """Bytes per rank per step, and how much of it crosses nodes."""

    zero: int
    features: int
    zero_inter_node: bool  # False when every ZeRO collective stays inside a node

    @property
    def total(self) -> int:
        return self.zero + self.features


def ring(size: float, ranks: int) -> float:
    return size * (ranks - 1) / ranks if ranks > 1 else 0.0


def zero_bytes(params: int, width: int, stage: int, world: int, micro_batches: int, hpz: int = 1) -> int:
    weights = params * width
    if stage == 0:
        return int(2 * ring(weights, world))
    if stage == 1:
        return int(ring(weights, world) + ring(weights, world))
    if stage == 2:
        return int(micro_batches * ring(weights, world) + ring(weights, world))
    backward_gather = ring(weights, hpz) if hpz > 1 else ring(weights, world)
    return int(micro_batches * (ring(weights, world) + backward_gather + ring(weights, world)))


def feature_bytes(kind: str, micro: int, dim: int, width: int, group: int, micro_batches: int) -> int:
    """`kind`: "global" (every rank's features each micro-batch), "grouped" (GBA-ITC) or "none"."""
    one = 2 * micro * dim * width  # both modalities of one micro-batch
    if kind == "global":
        return int(micro_batches * 2 * ring(one * group, group))  # forward gather, gradients back
    if kind == "grouped":
        return int(ring(one * micro_batches * group, group) + micro_batches * 2 * ring(one * group, group))
    return 0
