"""Model-state bytes per rank by ZeRO stage, in DeepSpeed's own layout for Adam.

Mixed precision (bf16/fp16) keeps, per trainable parameter: 16-bit weights (2 bytes) and gradients (2),
fp32 gradients for the step (4), fp32 master weights (4) and two fp32 moments (8), the split DeepSpeed's
estimators use (`estimate_zero2_model_states_mem_needs`, `estimate_zero3_model_states_mem_needs`; tests hold
this module to them). fp32 training keeps 4-byte weights and gradients, and ZeRO 1-3 still keep an fp32
partition of the weights beside the moments. ZeRO-1 partitions the optimizer state, ZeRO-2 also the
gradients, ZeRO-3 also the weights (plus the largest layer gathered whole, 4 bytes per parameter as DeepSpeed
counts it, and ZeRO++'s secondary shard of `hpz` ranks). Offload moves the optimizer state and the fp32
gradients to host memory.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from mmpt.plan.build import Counts


@dataclass(frozen=True)
class Layout:
    """How a run is spread: ranks, precision, ZeRO stage and its options."""

    world: int
    precision: str = "bf16"
    stage: int = 2
    offload: bool = False
    hpz: int = 1  # ZeRO++ secondary partition group size (1: none)


@dataclass(frozen=True)
class States:
    """Bytes per rank on the GPU by part, and on the host."""

    parameters: int
    gathered_layer: int  # ZeRO-3: the largest layer gathered whole
    hpz_shard: int  # ZeRO++: the secondary copy of the weights within the hpZ group
    gradients: int
    optimizer: int
    momentum: int  # the method's momentum copies (fp32; partitioned under ZeRO-3)
    buffers: int  # model buffers and the loss's (memory queues), in the training precision
    host: int  # offloaded optimizer state and fp32 gradients

    @property
    def gpu(self) -> int:
        return sum(v for k, v in asdict(self).items() if k != "host")

    @property
    def deepspeed_parts(self) -> int:
        """Parameters, gathered layer, gradients and optimizer: what DeepSpeed's estimators count."""
        return self.parameters + self.gathered_layer + self.gradients + self.optimizer


def model_states(counts: Counts, layout: Layout) -> States:
    p, n, stage = counts.trainable, layout.world, layout.stage
    mixed = layout.precision != "fp32"
    width = 2 if mixed else 4
    params = (p + counts.frozen) * width
    grad16 = p * 2 if mixed else 0  # mixed precision's 16-bit gradients; fp32 training has only the fp32 ones
    grad32 = p * 4
    optimizer = p * (12 if (mixed or stage > 0) else 8)  # master copy (mixed, or any ZeRO partition) + moments
    if stage == 0:
        gradients = grad16 + grad32
    elif stage == 1:
        gradients, optimizer = grad16 + grad32 // n, optimizer // n
    elif stage == 2:
        gradients, optimizer = grad16 // n + grad32 // n, optimizer // n
    else:  # ZeRO-3 reduces straight into the fp32 partition
        gradients, optimizer = grad32 // n, optimizer // n
    host = 0
    if layout.offload and stage > 0:
        host = optimizer + grad32 // n
        gradients -= grad32 // n
        optimizer = 0
    sharded = stage == 3
    return States(
        parameters=params // n if sharded else params,
        gathered_layer=4 * counts.largest_layer if sharded else 0,
        hpz_shard=params // layout.hpz if sharded and layout.hpz > 1 else 0,
        gradients=gradients,
        optimizer=optimizer,
        momentum=4 * counts.momentum // (n if sharded else 1),
        buffers=width * (counts.buffers + counts.loss_buffers),
        host=host,
    )
