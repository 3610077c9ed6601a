"""Compiled towers (`train.compile`): the modules a method lists in `EngineNeeds.compilable`, compiled with
torch.compile (inductor) in place, block by block where a tower stacks blocks (`regions`).

`module.compile()` keeps parameter and buffer names, so checkpoints and exports read and write an eager run's keys
and a run may resume with compilation switched on or off. What composes with it, ZeRO-3's hooks and what `auto`
chooses: docs/performance.md ("Compiled steps").
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from mmpt.config import Config, ConfigError
from mmpt.methods import EngineNeeds

log = logging.getLogger(__name__)

# torch.compile keeps up to `recompile_limit` compiled variants per Python function, then runs it eagerly.
# Towers of one class share their `forward`, and each runs in several variants (see above): this many
# leaves room for every tower of a method, in training and in evaluation.
RECOMPILE_LIMIT = 64


def compiles(cfg: Config, needs: EngineNeeds, gpu: bool) -> bool:
    """Whether this run compiles its towers: `train.compile` true, or "auto" on a GPU where it is supported."""
    train = cfg.train
    if train.compile != "auto":
        return train.compile
    return gpu and bool(needs.compilable) and train.zero_stage < 3 and train.sequence_parallel == 1


def check_compile(cfg: Config) -> None:
    """Refuse the combinations compiled towers do not support (before anything is built); "auto" refuses nothing."""
    train = cfg.train
    if train.compile is not True:
        return
    if train.sequence_parallel > 1:
        raise ConfigError(
            "config key 'train.compile': compiled towers are not supported with train.sequence_parallel="
            f"{train.sequence_parallel} (its collectives run inside the split transformers); set one of them off"
        )


def compile_towers(needs: EngineNeeds, method_name: str, zero_stage: int) -> int:
    """Compile every region (`regions`) of `needs.compilable` in place; returns how many. Call `check_compile`
    first."""
    if not needs.compilable:
        raise ConfigError(
            f"config key 'train.compile': method '{method_name}' declares no tower to compile; set it to false"
        )
    if zero_stage == 3:
        import deepspeed

        for module in (m for tower in needs.compilable for m in tower.modules()):
            if isinstance(module, nn.MultiheadAttention):
                for parameter in module.out_proj.parameters():
                    deepspeed.zero.register_external_parameter(module, parameter)
    dynamo = torch._dynamo.config
    dynamo.recompile_limit = max(dynamo.recompile_limit, RECOMPILE_LIMIT)
    seen: set[int] = set()
    for tower in needs.compilable:
        for module in regions(tower):
            if id(module) not in seen:
                seen.add(id(module))
                module.compile()
    return len(seen)


def regions(tower: nn.Module) -> list[nn.Module]:
    """What is compiled of `tower`: each block of its outermost repeated stacks (a ModuleList or Sequential of
    two or more modules of one class), else the tower whole. Blocks of one class share their code, so dynamo
    compiles one and reuses it for the others (parameters are graph inputs): the first step's compilation
    no longer grows with depth. What lies between the stacks (embeddings, norms, pooling) runs eagerly."""
    found = _stacked_blocks(tower)
    return found or [tower]


def _stacked_blocks(module: nn.Module) -> list[nn.Module]:
    children = list(module.children())
    stacked = isinstance(module, nn.ModuleList | nn.Sequential) and len(children) >= 2
    if stacked and len({type(child) for child in children}) == 1:
        return children
    return [block for child in children for block in _stacked_blocks(child)]


def is_compiled(module: nn.Module) -> bool:
    """Whether `module` was compiled in place (`nn.Module.compile`)."""
    return getattr(module, "_compiled_call_impl", None) is not None
