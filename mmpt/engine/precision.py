"""Training precision beyond what DeepSpeed casts: buffers, and modules a method keeps in fp32."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Policy:
    """What a run's precision means for its tensors: `model` is the dtype of parameters, floating buffers and
    batches; `autocast`, when set, the dtype the forward computes in under `torch.autocast`."""

    model: torch.dtype
    autocast: torch.dtype | None = None

    @property
    def deepspeed_casts(self) -> bool:
        """Whether DeepSpeed holds the model in 16 bits (its bf16/fp16 modes, with fp32 master weights)."""
        return self.model != torch.float32


def policy(precision: str, zero_stage: int) -> Policy:
    """bf16 at ZeRO-0 is autocast over an fp32 model (torch AMP): fp32 gradients then take mmpt's bucketed
    all-reduce and the plain fused AdamW, where DeepSpeed's bf16 mode would step through its per-parameter
    FP16_UnfusedOptimizer and accumulate micro-batches in bf16 (it refuses fp32 accumulation without ZeRO).
    At ZeRO 1-3, and for fp16, DeepSpeed casts the model and keeps fp32 master weights."""
    if precision == "bf16" and zero_stage == 0:
        return Policy(torch.float32, torch.bfloat16)
    return Policy(DTYPES[precision])


def match_buffer_precision(module: nn.Module, dtype: torch.dtype, fp32_modules: Sequence[nn.Module] = ()) -> None:
    """Floating buffers (BatchNorm statistics, memory queues) in the training precision, as the parameters
    are; the buffers of `fp32_modules` stay fp32 (e.g. a momentum copy, whose small updates bf16 would lose)."""
    kept = {id(b) for m in fp32_modules for b in m.buffers()}
    for buffer in module.buffers():
        target = torch.float32 if id(buffer) in kept else dtype
        if buffer.is_floating_point() and buffer.dtype != target:
            buffer.data = buffer.data.to(target)


def compute_in(modules: Sequence[nn.Module], dtype: torch.dtype, device_type: str) -> None:
    """Run each module's forward under autocast to `dtype` and hand its floating outputs back in `dtype`:
    a module whose state is kept in fp32 then takes and gives tensors of the training precision."""
    if dtype == torch.float32:
        return
    for module in modules:
        module.forward = _autocast_forward(module.forward, dtype, device_type)


def _autocast_forward(forward, dtype: torch.dtype, device_type: str):
    def run(*args, **kwargs):
        with torch.autocast(device_type, dtype=dtype):
            return _cast(forward(*args, **kwargs), dtype)

    return run


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(_cast(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast(v, dtype) for k, v in value.items()}
    return value


def use_tf32(enabled: bool) -> None:
    """`train.tf32`: TF32 for fp32 matmuls and convolutions on GPUs (torch's default: full fp32 for matmuls, TF32
    for cuDNN convolutions). The losses keep their logits in full fp32 (`mmpt.losses.contrastive.full_fp32`).
    The `allow_tf32` flags, not torch's newer `fp32_precision` ones: reading the older flags (as libraries do)
    after setting the newer raises in torch 2.14, and the two stay consistent this way round."""
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled
