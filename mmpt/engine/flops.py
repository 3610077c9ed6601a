"""What the trainer's steps cost in FLOPs, counted once, and the device's peak to hold them against.

The count runs the method's training step once over a second build of the model on fake tensors
(`FakeTensorMode`): the model is built on the meta device and given fake storage, the batch is fake tensors
of the first micro-batch's shapes and dtypes, and `FlopCounterMode` adds up the matmuls and convolutions of
the forward pass, the backward pass (about twice the forward) and whatever the step runs besides: the step
pool's forward when the method pools, the recomputed forward where gradient checkpointing is on. No kernel
runs and no memory is taken, so a 10B model counts in seconds. The contrastive logits are counted at one
rank's batch (the gathered columns are a small share of a step).

`perf/tflops` in the metrics is then the counted FLOPs per sample x the samples of a logging window / its
wall time / the number of GPUs; `perf/mfu` that over the peak. With recompute counted, this is the
utilisation of the work the device does (hardware FLOPs), not of the model's own 3x forward.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map
from torch.utils.flop_counter import FlopCounterMode

from mmpt.config import Config
from mmpt.engine.pool_pass import step_pooling
from mmpt.engine.precision import policy
from mmpt.methods import EngineNeeds, Method
from mmpt.methods.base import loss_terms

log = logging.getLogger(__name__)

# Dense bf16 tensor-core peaks (TFLOP/s per GPU) from the vendors' data sheets, by a part of the device name.
# The first match wins: the PCIe H100 before the SXM one.
BF16_PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0),
    ("H100", 989.4),
    ("H200", 989.4),
    ("H800", 989.4),
    ("A100", 312.0),
    ("A800", 312.0),
)


def peak_tflops(configured: float | None, precision: str, device: torch.device) -> float | None:
    """The peak `perf/mfu` is stated against: `train.peak_tflops` when set, else the bf16 dense peak of a known
    GPU for a bf16 run, else None (nothing is claimed: no CPU, no other precision, no unknown GPU)."""
    if configured is not None:
        return configured
    if device.type != "cuda" or precision != "bf16":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for part, peak in BF16_PEAK_TFLOPS if part in name), None)


def materialize(model: nn.Module, loss: nn.Module, needs: EngineNeeds, dtype: torch.dtype, device: str = "cpu") -> None:
    """Give a meta-built model and loss storage on `device` (fake storage inside FakeTensorMode), in the training
    precision as the engine sets it: floating parameters and buffers in `dtype`, declared fp32 modules and
    momentum copies fp32. Tied parameters stay tied."""
    kept = {id(t) for m in (*needs.fp32_modules, *needs.momentum_copies) for t in (*m.parameters(), *m.buffers())}
    done: dict[int, torch.Tensor] = {}

    def fresh(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in done:
            target = torch.float32 if id(tensor) in kept else dtype
            made = torch.empty(
                tensor.shape, device=device, dtype=target if tensor.is_floating_point() else tensor.dtype
            )
            if isinstance(tensor, nn.Parameter):
                made = nn.Parameter(made, requires_grad=tensor.requires_grad)
            done[id(tensor)] = made
        return done[id(tensor)]

    for root in (model, loss):
        for module in root.modules():
            for table in (module._parameters, module._buffers):
                for name, tensor in table.items():
                    if tensor is not None:
                        table[name] = fresh(tensor)  # type: ignore[assignment]


def run_step(
    method: Method,
    model: nn.Module,
    loss: nn.Module,
    needs: EngineNeeds,
    batch: Any,
    autocast: torch.dtype | None,
    pool_pass: bool = True,
) -> None:
    """What the engine runs for one micro-batch: the method's step pool (no gradient) when it declares one and
    `pool_pass` (the engine pools only over several micro-batches), the training step, the backward pass."""
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        pool = None
        if needs.step_pool is not None and pool_pass:
            with torch.no_grad():
                pool = needs.pool(model, loss, [batch])
        terms = method.training_step(model, loss, batch, pool, 0)
    torch.stack([t.float() for t in loss_terms(terms).values()]).sum().backward()


def step_flops(method: Method, cfg: Config, run_dir: Path, batch: Any) -> int:
    """FLOPs of one training micro-batch shaped like `batch` (forward, backward, recompute, and the pool pass where
    the step runs one: `mmpt.engine.pool_pass`), counted on
    a fake-tensor build of `cfg`'s model: nothing runs on the device and `batch`'s values are not read."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    try:
        with torch.device("meta"):
            model = method.build_model(cfg, run_dir)
            loss = method.build_loss(cfg)
    except (NotImplementedError, RuntimeError):  # a model that moves its weights itself (open_clip): on the host
        model, loss = method.build_model(cfg, run_dir), method.build_loss(cfg)
    needs = method.engine_needs(model, cfg)
    precision = policy(cfg.train.precision, cfg.train.zero_stage)
    counter = FlopCounterMode(display=False)
    with FakeTensorMode(allow_non_fake_inputs=True):
        materialize(model, loss, needs, precision.model)
        fake = tree_map(lambda t: empty_like_on_cpu(t) if isinstance(t, torch.Tensor) else t, batch)
        model.train()
        with counter:
            pool_pass = step_pooling(cfg, needs, model) == "separate"
            run_step(method, model, loss, needs, fake, precision.autocast, pool_pass=pool_pass)
    return counter.get_total_flops()


def empty_like_on_cpu(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")


def flops_per_sample(count: Callable[[], int], samples: int) -> float | None:
    """`count()` / `samples`, or None (with a warning) when the count fails: the run trains on without MFU."""
    try:
        return count() / max(1, samples)
    except Exception as exc:  # a model the fake build cannot run: no figure rather than no run
        log.warning("FLOPs not counted (%s: %s): perf/tflops and perf/mfu are left out", type(exc).__name__, exc)
        return None
