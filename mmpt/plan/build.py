"""The model a config trains, built through its method as the engine builds it, but on the meta device:
no weights are allocated, so a 10B model counts in a second."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mmpt.config import Config, ConfigError
from mmpt.errors import first_line
from mmpt.methods import EngineNeeds, Method, get_method
from mmpt.methods.teacher import teacher_of

PERSISTENCE_THRESHOLD = 100_000  # DeepSpeed's stage3_param_persistence_threshold: ZeRO-3 keeps these whole


@dataclass(frozen=True)
class Counts:
    """Element counts of a built model; bytes follow from the precision and the ZeRO stage (`states`)."""

    trainable: int  # parameters the optimizer steps
    frozen: int  # parameters with requires_grad off (kept, never stepped)
    largest_layer: int  # trainable parameters of the largest leaf module (ZeRO-3 gathers one at a time)
    momentum: int  # elements of the momentum copies the method declares (kept fp32 by the engine)
    buffers: int  # floating buffers of the model outside momentum copies (e.g. batch-norm statistics)
    loss_buffers: int  # floating buffers of the loss module (e.g. memory queues)
    persistent: int = 0  # parameters small enough that ZeRO-3 keeps them whole on every rank (`states`)


@dataclass
class Built:
    """A built model with its loss and what its method asks of the engine."""

    cfg: Config
    method: Method
    model: nn.Module
    loss: nn.Module
    needs: EngineNeeds


@contextmanager
def built(cfg: Config, device: str | torch.device = "meta") -> Iterator[Built]:
    """Build `cfg`'s model and loss through its method on `device`, with the method's files in a scratch run
    directory that is removed afterwards. A missing input the build reads is a ConfigError naming its key."""
    method = get_method(cfg.method_name)
    if cfg.data.prepare:  # a demo config's tokenizer comes with its corpus, built on first use as training does
        from mmpt import demo

        demo.build(cfg.data.prepare, cfg.data.root)
    with tempfile.TemporaryDirectory(prefix="mmpt-plan-") as scratch:
        run_dir = Path(scratch)
        missing = None  # the file `prepare` could not copy: its message names it and the config key naming it
        try:
            method.prepare(cfg, run_dir)
        except FileNotFoundError as exc:
            missing = exc  # fine when the build reads none of its files (a preset with its vocabulary size)
        try:
            try:
                with torch.device(device):
                    model, loss = method.build_model(cfg, run_dir), with_teacher(cfg, method, run_dir)
            except (NotImplementedError, RuntimeError):  # a model that moves its weights itself (open_clip)
                model, loss = method.build_model(cfg, run_dir), with_teacher(cfg, method, run_dir)
        except Exception as exc:
            # The architecture is read from that file (a vocabulary size, a checkpoint's config.json): say which
            # one, not what the build tripped over without it (a tokenizer's os error, a hub repo-id error).
            reason = first_line(missing) if missing is not None else first_line(exc)
            raise ConfigError(f"cannot build the model of {cfg.method_name} to plan it: {reason}") from None
        yield Built(cfg, method, model, loss, method.engine_needs(model, cfg))


def with_teacher(cfg: Config, method: Method, run_dir: Path) -> nn.Module:
    """The method's loss, around the frozen teacher the config names (`method.distill`), built as the engine
    builds it: its parameters count as frozen ones."""
    loss = method.build_loss(cfg)
    teacher = teacher_of(cfg, run_dir)
    return loss if teacher is None else teacher.around(loss, teacher.build())


def count(b: Built) -> Counts:
    """Counts of `b`'s model, tied parameters once."""
    params = {id(p): p for p in [*b.model.parameters(), *b.loss.parameters()]}.values()  # a teacher: frozen
    copies = {id(t) for copy in b.needs.momentum_copies for t in copy.buffers()}
    momentum = sum(t.numel() for copy in b.needs.momentum_copies for t in copy.buffers() if t.is_floating_point())
    largest = max(
        (sum(p.numel() for p in m.parameters(recurse=False) if p.requires_grad) for m in b.model.modules()), default=0
    )
    return Counts(
        trainable=sum(p.numel() for p in params if p.requires_grad),
        frozen=sum(p.numel() for p in params if not p.requires_grad),
        largest_layer=largest,
        momentum=momentum,
        buffers=sum(t.numel() for t in b.model.buffers() if t.is_floating_point() and id(t) not in copies),
        loss_buffers=sum(t.numel() for t in b.loss.buffers() if t.is_floating_point()),
        persistent=sum(p.numel() for p in params if p.numel() <= PERSISTENCE_THRESHOLD),
    )


def describe(model: nn.Module) -> dict[str, Any]:
    """Parameter counts of the top-level children: what the plan lists as the model's parts."""
    return {name: sum(p.numel() for p in child.parameters()) for name, child in model.named_children()}
