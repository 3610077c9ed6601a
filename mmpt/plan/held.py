"""The model-state bytes one rank actually holds in a DeepSpeed engine, counted from the tensors themselves:
what the planner's `states` predicts, measured.

The engine is built as training builds it (`mmpt.engine.run.build_engine`) and runs one full optimizer step
through the engine's own loop (so every optimizer state exists), then a second one, counted twice: after its
last backward, before DeepSpeed's step, and as the innermost torch optimizer starts stepping (where
DeepSpeed's unfused bf16 optimizer has made an fp32 copy of every gradient). The larger count is the rank's
peak. Counted, each storage once: the module's parameters (under ZeRO-3 their `ds_tensor` partitions and the
persistent parameters kept whole), its floating buffers, the parameters' `.grad`, and every tensor (and its
`.grad`) the optimizer reaches through its attributes, nested lists and dicts and wrapped optimizers:
DeepSpeed's flat 16-bit groups, fp32 master partitions, gradient partitions, accumulators and reduce buckets,
and the inner AdamW's `exp_avg` and `exp_avg_sq`. Storages of no bytes (ZeRO-3's released parameters) count
nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

DEPTH = 4  # attribute and container levels followed inside an optimizer


@dataclass(frozen=True)
class Held:
    """Bytes per rank by where they are reached first: module parameters and buffers, `.grad`, the optimizer."""

    parameters: int
    buffers: int
    gradients: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.parameters + self.buffers + self.gradients + self.optimizer


class _Storages:
    def __init__(self) -> None:
        self.seen: set[int] = set()

    def add(self, tensor: Any) -> int:
        """Bytes of `tensor`'s storage if not seen before (0 otherwise, and for what is not a tensor)."""
        if not isinstance(tensor, torch.Tensor) or tensor.is_meta:
            return 0
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in self.seen:
            return 0
        self.seen.add(storage.data_ptr())
        return storage.nbytes()


def _tensors(value: Any, depth: int, visited: set[int]) -> Iterator[torch.Tensor]:
    """Tensors reachable from `value` through containers, optimizers' attributes and their state."""
    if isinstance(value, torch.Tensor):
        yield value
        return
    if depth == 0 or id(value) in visited or isinstance(value, (str, bytes, int, float, bool, nn.Module)):
        return
    visited.add(id(value))
    if isinstance(value, dict):
        items: Any = list(value.keys()) + list(value.values())
    elif isinstance(value, (list, tuple, set)):
        items = list(value)
    elif hasattr(value, "__dict__") and _is_optimizer_part(value):
        items = list(vars(value).values())
        if isinstance(value, torch.optim.Optimizer):
            items += list(value.state.values())
    else:
        return
    for item in items:
        yield from _tensors(item, depth - 1 if not isinstance(item, torch.Tensor) else depth, visited)


def _is_optimizer_part(value: Any) -> bool:
    """Optimizers and the objects DeepSpeed keeps their partitions in (not the engine, modules or groups)."""
    module = type(value).__module__
    return isinstance(value, torch.optim.Optimizer) or module.startswith("deepspeed.runtime")


def held_bytes(engine: Any) -> Held:
    """What this rank of `engine` holds now (see the module's docstring for when to call it)."""
    storages = _Storages()
    module: nn.Module = engine.module
    parameters = 0
    for param in module.parameters():
        parameters += storages.add(getattr(param, "ds_tensor", None)) + storages.add(param)
    buffers = sum(storages.add(b) for b in module.buffers() if b.is_floating_point())
    gradients = sum(storages.add(p.grad) for p in module.parameters())
    optimizer = 0
    for tensor in _tensors(engine.optimizer, DEPTH, set()):
        optimizer += storages.add(tensor) + storages.add(tensor.grad if tensor.is_leaf else None)
    return Held(parameters, buffers, gradients, optimizer)


def engine_for(cfg: Any, run_dir: Path) -> Any:
    """A DeepSpeed engine for `cfg` on the started process group, built as training builds it."""
    from mmpt import distributed as mdist
    from mmpt.engine.run import build_engine
    from mmpt.methods import get_method

    method = get_method(cfg.method_name)
    run_dir.mkdir(parents=True, exist_ok=True)
    method.prepare(cfg, run_dir)
    layout = mdist.set_sequence_parallel(cfg.train.sequence_parallel)
    engine, _, _ = build_engine(cfg, method, layout, mdist.get_world_size())
    return engine


HELD_BUCKET = 1_000_000  # a small DeepSpeed gradient bucket (elements), so that it does not hide the partitions


def held_and_planned(config: Path | str, tokenizer: str, stage: int, precision: str) -> tuple[Held, int]:
    """(what this rank holds at its peak, what the planner predicts) for `config` at a ZeRO stage and precision,
    on the started 2-rank process group; the run's folder is removed afterwards."""
    import shutil
    import tempfile

    from mmpt.config_loader import load_config
    from mmpt.plan.build import built, count
    from mmpt.plan.states import Layout, model_states

    run_dir = Path(tempfile.mkdtemp(prefix="mmpt-held-"))
    overrides = [
        f"method.tokenizer={tokenizer}",
        f"train.zero_stage={stage}",
        f"train.precision={precision}",
        f"run.output_dir={run_dir}",
        *([f"train.reduce_bucket_size={HELD_BUCKET}"] if stage else []),
    ]
    cfg = load_config(config, overrides)
    try:
        held = held_after_backward(engine_for(cfg, run_dir), cfg)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    with built(cfg) as b:
        counts = count(b)
    layout = Layout(world=2, precision=precision, stage=stage, reduce_bucket=HELD_BUCKET if stage else 0)
    states = model_states(counts, layout)
    return held, states.gpu - states.gathered_layer  # the gathered layer is released after each use


def held_after_backward(engine: Any, cfg: Any, batch_size: int = 2) -> Held:
    """One full optimizer step, then the next one's micro-batches through the engine's own loop
    (`mmpt.engine.trainer.optimizer_step`): what the rank holds after the last backward, before that step."""
    from mmpt.engine.hooks import StepHooks
    from mmpt.engine.precision import policy
    from mmpt.engine.trainer import optimizer_step, to_device
    from mmpt.plan.batches import micro_batch
    from mmpt.plan.build import Built

    wrapped = engine.module
    b = Built(cfg, wrapped.method, wrapped.model, wrapped.loss, wrapped.needs)
    accum = cfg.train.grad_accum
    dtype = policy(cfg.train.precision, cfg.train.zero_stage).model
    batches = [to_device(micro_batch(b, batch_size), engine.device, dtype) for _ in range(accum)]
    optimizer_step(engine, batches)
    before: list[Held] = []
    inside: list[Held] = []

    def observe(point: str, step: int) -> None:
        if point == "step":
            before.append(held_bytes(engine))

    hook = _innermost(engine.optimizer).register_step_pre_hook(lambda *_: inside.append(held_bytes(engine)))
    try:
        optimizer_step(engine, batches, StepHooks([observe]), step=2)
    finally:
        hook.remove()
    return max([before[accum - 1], *inside], key=lambda h: h.total)


def _innermost(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer DeepSpeed's wrappers step in the end."""
    inner = getattr(optimizer, "optimizer", None)
    while inner is not None and (isinstance(inner, torch.optim.Optimizer) or hasattr(inner, "optimizer")):
        optimizer, inner = inner, getattr(inner, "optimizer", None)
    return optimizer
