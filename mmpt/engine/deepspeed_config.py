"""The DeepSpeed config, built from the typed config: nothing is left to DeepSpeed's defaults."""

from __future__ import annotations

from typing import Any

import torch

from mmpt.config import Config, ConfigError


def check_precision(cfg: Config) -> None:
    if cfg.train.precision == "fp16" and not torch.cuda.is_available():
        raise ConfigError("config key 'train.precision' = 'fp16' needs a GPU; use bf16 or fp32 on CPU")


def deepspeed_config(cfg: Config, world_size: int, load_universal: bool = False) -> dict[str, Any]:
    train = cfg.train
    micro = cfg.data.train.batch_size
    zero: dict[str, Any] = {"stage": train.zero_stage}
    if train.offload_optimizer:
        if train.zero_stage == 0:
            raise ConfigError("config key 'train.offload_optimizer' needs train.zero_stage >= 1")
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": train.grad_accum,
        "train_batch_size": micro * train.grad_accum * world_size,
        # DeepSpeed's own default is 1.0: always say what we mean (0 = no clipping).
        "gradient_clipping": train.grad_clip,
        "zero_optimization": zero,
        # Non-finite gradients skip the step (ZeRO 1-3 check the global norm; on by default for fp32 only).
        "bf16": {"enabled": train.precision == "bf16", "check_grad_overflow": True},
        "fp16": {"enabled": train.precision == "fp16", "loss_scale": 0, "initial_scale_power": 16},
        # The engine passes a torch optimizer; with offload that is a deliberate choice.
        "zero_force_ds_cpu_optimizer": False,
        # Loading a checkpoint written by another number of ranks goes through its universal copy.
        "checkpoint": {"load_universal": load_universal},
        "steps_per_print": 2**62,
        "wall_clock_breakdown": False,
    }
