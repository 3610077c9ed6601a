"""The DeepSpeed config, built from the typed config: nothing is left to DeepSpeed's defaults."""

from __future__ import annotations

import logging
from typing import Any

import torch

from mmpt import distributed as mdist
from mmpt.config import Config, ConfigError, TrainConfig
from mmpt.engine.optim import skips_on_device
from mmpt.engine.precision import policy

log = logging.getLogger(__name__)

# GPUs, ZeRO 1-2: gradients reduce in buckets while backward still runs (`overlap_comm`) only when
# backward fills several of them: one bucket larger than the model is reduced after backward ends, at
# two buckets of memory for nothing. So the bucket is a quarter of the model, held between 5e7 elements
# (below it NCCL's calls run short of the link's bandwidth) and 2e8 (DeepSpeed's guidance for overlap);
# overlap is on when the model spans more than one bucket. train.reduce_bucket_size and
# train.overlap_comm override either.
GPU_BUCKET_RANGE = (50_000_000, 200_000_000)


def check_precision(cfg: Config) -> None:
    if cfg.train.precision == "fp16" and not torch.cuda.is_available():
        raise ConfigError("config key 'train.precision' = 'fp16' needs a GPU; use bf16 or fp32 on CPU")


def hpz_partition_size(setting: int | str, world_size: int) -> int:
    """ZeRO++'s group size for `train.hpz_partition_size`; DeepSpeed itself would cut a size above the world
    size down silently and fail late on one that does not divide it."""
    size = int(mdist.local_world_size()) if setting == "node" else int(setting)
    if size > world_size or world_size % size:
        raise ConfigError(
            f"config key 'train.hpz_partition_size' = {setting!r} ({size} ranks) must divide the {world_size} ranks"
        )
    if size == world_size and world_size > 1:
        log.warning(
            "train.hpz_partition_size covers all %d ranks: every gather is still world-wide, and each rank "
            "keeps a secondary shard for nothing",
            world_size,
        )
    return size


def gpu_reduction(train: TrainConfig, parameters: int, world_size: int) -> tuple[int, bool]:
    """(reduce_bucket_size, overlap_comm) of ZeRO 1-2 on GPUs for a model of `parameters` elements: buckets
    overlap backward where there are several (and several ranks: a world of one reduces nothing, and
    DeepSpeed's overlap then only adds a wait for the whole device after every micro-batch)."""
    low, high = GPU_BUCKET_RANGE
    bucket = train.reduce_bucket_size or min(high, max(low, parameters // 4))
    overlap = train.overlap_comm if train.overlap_comm is not None else parameters > bucket and world_size > 1
    return bucket, overlap


def zero_optimization(train: TrainConfig, use_cuda: bool, world_size: int = 1, parameters: int = 0) -> dict[str, Any]:
    """The `zero_optimization` section: the stage, offload, and how ZeRO 1-2 reduce gradients.

    ZeRO 1-2 on GPUs keep DeepSpeed's defaults, written out, but for the bucket and overlap, sized from the
    model (`gpu_reduction`). CPU ranks and ZeRO-3 keep DeepSpeed's defaults unless `train.reduce_bucket_size`
    or `train.overlap_comm` is set; ZeRO-3 takes ZeRO++'s hierarchical partitioning
    (`zero_hpz_partition_size`) from `train.hpz_partition_size`.
    """
    stage = train.zero_stage
    zero: dict[str, Any] = {"stage": stage}
    if train.offload_optimizer:
        if stage == 0:
            raise ConfigError("config key 'train.offload_optimizer' needs train.zero_stage >= 1")
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": use_cuda}
    for key in ("reduce_bucket_size", "overlap_comm"):
        if getattr(train, key) is None:
            continue
        if stage == 0:
            raise ConfigError(
                f"config key 'train.{key}' needs train.zero_stage >= 1 (ZeRO-0 all-reduces every gradient at once)"
            )
        zero[key] = getattr(train, key)
    if stage in (1, 2) and use_cuda:
        bucket, overlap = gpu_reduction(train, parameters, world_size)
        zero.update(
            {
                "reduce_scatter": True,
                "contiguous_gradients": True,
                "overlap_comm": overlap,
                "reduce_bucket_size": bucket,
                # DeepSpeed's default; it only reads it where the backend lacks all_gather_into_tensor (gloo
                # and NCCL have it: the updated partitions are gathered in one call whatever this says).
                "allgather_bucket_size": 500_000_000,
            }
        )
    if train.hpz_partition_size is not None and stage != 3:
        raise ConfigError(
            "config key 'train.hpz_partition_size' needs train.zero_stage = 3 (ZeRO++ partitions "
            "parameters, which only ZeRO-3 does)"
        )
    if stage == 3 and train.hpz_partition_size is not None:
        zero["zero_hpz_partition_size"] = hpz_partition_size(train.hpz_partition_size, world_size)
    return zero


def precision(train: TrainConfig) -> dict[str, Any]:
    """The precision keys: bf16 or fp16 training, and under bf16 gradients reduced and accumulated in fp32.

    DeepSpeed 0.19.8 leaves both at the model's dtype. A bf16 sum of the ranks' gradients, or of K
    micro-batches' (a GBA-ITC step sums K=4), rounds each partial sum to 8 bits of mantissa. fp32 costs
    twice the bytes on the wire and one fp32 gradient buffer:

    - `communication_data_type: fp32` is honoured by every stage: ZeRO-0's all-reduce (the engine casts each
      bucket), ZeRO 1-2's buckets and ZeRO-3's reduce-scatter.
    - `data_types.grad_accum_dtype: fp32` at ZeRO 1-3: ZeRO-1 then runs DeepSpeed's BF16_Optimizer (fp32
      gradients beside the fp32 master weights; with offload, its ZeRO optimizer's fp32 `grad_accum`),
      ZeRO-2 accumulates the reduced partitions in fp32, ZeRO-3 its fp32 gradient partitions. ZeRO-0 refuses
      it (bf16 parameters with fp32 accumulation and no ZeRO is "unsupported"), so bf16 at ZeRO-0 does not
      use DeepSpeed's bf16 mode: the model stays fp32 and its forward runs under autocast
      (`precision.policy`), gradients are fp32 throughout and the plain optimizer steps.
    """
    bf16 = train.precision == "bf16" and policy(train.precision, train.zero_stage).deepspeed_casts
    keys: dict[str, Any] = {
        # Non-finite gradients skip the step: on the device (`SkippingAdamW`) where `skips_on_device`, else by
        # DeepSpeed's check of the global norm (on by default for fp32 only).
        "bf16": {"enabled": bf16, "check_grad_overflow": not skips_on_device(train)},
        "fp16": {"enabled": train.precision == "fp16", "loss_scale": 0, "initial_scale_power": 16},
    }
    if bf16:
        keys["communication_data_type"] = "fp32"
        if train.zero_stage > 0:
            keys["data_types"] = {"grad_accum_dtype": "fp32"}
    return keys


def deepspeed_config(
    cfg: Config, world_size: int, load_universal: bool = False, parameters: int = 0, one_pass: bool = False
) -> dict[str, Any]:
    """`parameters`: the model's element count, which sizes the gradient buckets on GPUs (`gpu_reduction`).
    `one_pass`: a step is one forward and backward over its K micro-batches (a merged pool pass), so DeepSpeed
    sees one micro-batch of K times the rows and no accumulation."""
    train = cfg.train
    micro, accum = cfg.data.train.batch_size, train.grad_accum
    if one_pass:
        micro, accum = micro * accum, 1
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "train_batch_size": micro * accum * world_size,
        # DeepSpeed's own default is 1.0: always say what we mean (0 = no clipping).
        "gradient_clipping": train.grad_clip,
        "zero_optimization": zero_optimization(train, torch.cuda.is_available(), world_size, parameters),
        **precision(train),
        # The engine passes a torch optimizer; with offload that is a deliberate choice.
        "zero_force_ds_cpu_optimizer": False,
        # Loading a checkpoint written by another number of ranks goes through its universal copy.
        "checkpoint": {"load_universal": load_universal},
        "steps_per_print": 2**62,
        "wall_clock_breakdown": False,
        # DeepSpeed's throughput timer waits for the whole device at every forward and step by default; mmpt
        # times its own spans (mmpt.engine.timing) and never reads it.
        "timers": {"throughput": {"enabled": False}},
    }
