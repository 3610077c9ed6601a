"""When a checkpoint counts as written, and which one a run resumes from.

Each rank writes and fsyncs its files, then all ranks agree, through one collective, that every rank's
files are down; only then does rank 0 write `complete.json` (a checkpoint counts only with it) and move
`latest`. A kill at any moment leaves the previous complete checkpoint as the one to resume from; a rank
that cannot write stops every rank, naming itself.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from mmpt import distributed as mdist
from mmpt.artifacts import atomic_torch_save, atomic_write
from mmpt.errors import ConfigError

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
LATEST = "latest"
COMPLETE = "complete.json"

Reached = Callable[[str, int], None]  # told each point of the protocol (save:after_engine, ...), for the hooks


class CheckpointError(RuntimeError):
    """A rank could not write its part of a checkpoint (a full disk, permissions): every rank stops, and the
    previous complete checkpoint is the one to resume from."""


def tag_for(step: int) -> str:
    return f"step_{step:09d}"


def save(
    root: Path,
    step: int,
    write_engine: Callable[[Path], None],
    rank_state: dict[str, Any],
    keep_last: int,
    reached: Reached,
) -> Path:
    """Every rank calls this: `write_engine(folder)` writes the engine's files, then the rank's own state is
    written, then the completion protocol runs (module docstring)."""
    tag = tag_for(step)
    rank = mdist.get_rank()
    if rank == 0:
        (root / tag / COMPLETE).unlink(missing_ok=True)  # re-saving a step: it is incomplete until done
    mdist.barrier()
    failure = None
    try:
        write_engine(root / tag)
        reached("save:after_engine", step)
        atomic_torch_save(rank_state, root / tag / f"rank_{rank}.pt")
        reached("save:after_rank_state", step)
    except Exception as exc:  # reported to every rank below, then raised here
        failure = exc
    done = mdist.all_gather_floats([0.0 if failure else 1.0])
    failed = [r for r, (ok,) in enumerate(done) if not ok]
    if failure is not None:
        raise CheckpointError(
            f"{root / tag}: rank {rank} could not write its files: {type(failure).__name__}: {failure}"
        ) from failure
    if failed:
        raise CheckpointError(
            f"{root / tag}: rank(s) {failed} could not write their files (their own line says "
            "why); the previous complete checkpoint is the one to resume from"
        )
    if rank == 0:
        atomic_write(root / tag / COMPLETE, json.dumps({"step": step, "world_size": mdist.get_world_size()}))
        reached("save:before_latest", step)
        atomic_write(root / LATEST, tag)
        reached("save:before_prune", step)
        prune(root, step, keep_last)
    mdist.barrier()
    return root / tag


def is_complete(checkpoint: Path) -> bool:
    """A checkpoint is complete when its `complete.json` is there and readable: rank 0 writes it only after
    every rank reported its files written and synced (no per-rank file is looked at, which on a large job
    would be thousands of metadata reads on a shared filesystem from every rank)."""
    try:
        return int(json.loads((checkpoint / COMPLETE).read_text())["world_size"]) > 0
    except (OSError, ValueError, KeyError, TypeError):
        return False


def prune(root: Path, step: int, keep_last: int) -> None:
    """Keep the newest `keep_last` checkpoints up to `step`; never touch later ones (another run's)."""
    earlier = sorted(p for p in root.glob("step_*") if p.is_dir() and step_of(p) < step)
    for old in earlier[: max(0, len(earlier) - (keep_last - 1))]:
        shutil.rmtree(old, ignore_errors=True)
    later = [p.name for p in root.glob("step_*") if step_of(p) > step]
    if later:
        log.warning("checkpoints later than step %d from an earlier run are left in %s: %s", step, root, sorted(later))


def step_of(path: Path) -> int:
    try:
        return int(path.name.split("_", 1)[1])
    except (IndexError, ValueError):
        return -1


def find_resume(run_dir: Path, resume: str) -> Path | None:
    """The checkpoint directory to resume from, or None for a fresh start.

    `auto`: the newest complete checkpoint (`latest` names it too, unless a run was killed between
    completing a checkpoint and moving `latest`); incomplete ones, left by a run killed while
    saving, are skipped with a warning.
    """
    if resume == "none":
        return None
    if resume != "auto":
        path = Path(resume)
        if not is_complete(path):
            raise ConfigError(f"config key 'run.resume': {path} is not a complete checkpoint")
        return path
    root = run_dir / CHECKPOINTS
    complete = [p for p in root.glob("step_*") if p.is_dir() and is_complete(p)]
    chosen = max(complete, key=step_of) if complete else None
    skipped = sorted(
        p.name
        for p in root.glob("step_*")
        if p.is_dir() and not is_complete(p) and (chosen is None or step_of(p) > step_of(chosen))
    )
    if skipped:
        log.warning("skipping incomplete checkpoint(s) %s in %s (a run was stopped while saving)", skipped, root)
    return chosen


def saved_world_size(checkpoint: Path) -> int:
    return int(json.loads((checkpoint / COMPLETE).read_text())["world_size"])


def saved_step(checkpoint: Path) -> int:
    return int(json.loads((checkpoint / COMPLETE).read_text())["step"])


def rank_states(checkpoint: Path) -> list[dict[str, Any]]:
    """Every saved rank's own state, in rank order."""
    return [torch.load(checkpoint / f"rank_{r}.pt", weights_only=True) for r in range(saved_world_size(checkpoint))]
