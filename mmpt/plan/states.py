"""Model-state bytes per rank by ZeRO stage, in the layout DeepSpeed allocates for Adam under the engine's
DeepSpeed config (`mmpt.engine.deepspeed_config`: bf16 gradients accumulated in fp32 at ZeRO 1-3).

Mixed precision (bf16/fp16) keeps, per trainable parameter: 16-bit weights (2 bytes), fp32 master weights (4)
and two fp32 moments (8), and its gradients by stage: ZeRO-1 the 16-bit `.grad` (2) plus a
full-size fp32 accumulator (4, not partitioned: ZeRO-1 reduces once per step); ZeRO-2 and 3 only the fp32
partition (4 / n) that each bucket is reduced into. bf16 at ZeRO-0 is autocast over an fp32 model
(`mmpt.engine.precision.policy`): its states are fp32 training's. fp16 at ZeRO-0 keeps the 16-bit `.grad`
(2) plus the fp32 copy of each that DeepSpeed's unfused optimizer makes for the step (4). fp32 training
keeps 4-byte weights and gradients, and
ZeRO 1-3 still keep an fp32 partition of the weights beside the moments; at its step, fp32 ZeRO 1-2 holds the
reduced gradient partition twice (DeepSpeed flattens it into the master partition's `.grad` while the
contiguous buffer it was reduced into is still referenced). ZeRO-1 partitions the optimizer
state, ZeRO-2 also the gradients, ZeRO-3 also the weights, except the parameters of at most
`PERSISTENCE_THRESHOLD` elements, which every rank keeps whole; plus the largest layer gathered whole (4 bytes
per parameter as DeepSpeed's estimator counts it) and ZeRO++'s secondary shard of `hpz` ranks. DeepSpeed's
gradient bucket is a state too: ZeRO-3 allocates `reduce_bucket_size` elements in the communication dtype
(fp32) once; ZeRO 1-2 with contiguous gradients (GPUs) one per step, two with `overlap_comm`. Offload moves
the optimizer state and the fp32 gradients to host memory.

`benchmarks/memory_plan.py` and tests/test_plan.py hold these numbers to the bytes a rank actually holds in a
DeepSpeed engine (`mmpt.plan.held`); the estimators of DeepSpeed
(`estimate_zero2_model_states_mem_needs`, `estimate_zero3_model_states_mem_needs`) are held as a second check.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from mmpt.engine.precision import policy
from mmpt.plan.build import Counts

ZERO3_REDUCE_BUCKET = 500_000_000  # DeepSpeed's reduce_bucket_size default, which ZeRO-3 keeps unless set


@dataclass(frozen=True)
class Layout:
    """How a run is spread: ranks, precision, ZeRO stage and its options."""

    world: int
    precision: str = "bf16"
    stage: int = 2
    offload: bool = False
    hpz: int = 1  # ZeRO++ secondary partition group size (1: none)
    reduce_bucket: int = 0  # DeepSpeed's reduce_bucket_size in elements (0: no bucket counted)
    contiguous_gradients: bool = False  # ZeRO 1-2 copy gradients into the bucket (the engine's choice on GPUs)
    overlap_comm: bool = False  # ZeRO 1-2: a second bucket


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
    reduce_bucket: int  # DeepSpeed's gradient bucket(s)
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
    mixed = policy(layout.precision, stage).deepspeed_casts  # bf16 at ZeRO-0 is autocast over fp32 states
    width = 2 if mixed else 4
    params = (p + counts.frozen) * width
    grad16 = p * 2 if mixed else 0  # mixed precision's 16-bit gradients; fp32 training has only the fp32 ones
    grad32 = p * 4
    optimizer = p * (12 if (mixed or stage > 0) else 8)  # master copy (mixed, or any ZeRO partition) + moments
    if stage == 0:
        gradients = grad16 + grad32
    elif stage == 1:  # mixed: a full fp32 accumulator beside the 16-bit .grad; fp32: reduced into the partition
        gradients, optimizer = (grad16 + grad32 if mixed else grad32 // n), optimizer // n
    else:  # ZeRO 2-3 reduce each bucket straight into the fp32 partition
        gradients, optimizer = grad32 // n, optimizer // n
    if stage in (1, 2) and not mixed:
        # fp32: the step hands the optimizer a flat copy of the reduced partition, which is still held
        gradients += grad32 // n
    host = 0
    if layout.offload and stage > 0:
        host = optimizer + grad32 // n
        gradients -= grad32 // n
        optimizer = 0
    sharded = stage == 3
    bucket = 0
    if sharded:
        bucket = 4 * (layout.reduce_bucket or ZERO3_REDUCE_BUCKET)
    elif stage in (1, 2) and layout.contiguous_gradients:
        accumulate = 4 if stage == 1 and mixed else width  # ZeRO-1 stages its fp32 accumulator there
        bucket = layout.reduce_bucket * accumulate * (2 if layout.overlap_comm else 1)
    persistent = counts.persistent * width if n > 1 else 0
    return States(
        parameters=(params // n + persistent) if sharded else params,
        gathered_layer=4 * counts.largest_layer if sharded else 0,
        hpz_shard=params // layout.hpz if sharded and layout.hpz > 1 else 0,
        gradients=gradients,
        optimizer=optimizer,
        momentum=4 * counts.momentum // (n if sharded else 1),
        buffers=width * (counts.buffers + counts.loss_buffers),
        reduce_bucket=bucket,
        host=host,
    )
