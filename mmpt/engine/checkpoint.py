"""Checkpoints: DeepSpeed's model/optimizer shards plus each rank's data position and RNG state.

Layout of a run directory::

    config.yaml                  the resolved config
    checkpoints/step_000100/     DeepSpeed files of every rank + rank_<r>.pt (data position, RNG)
    checkpoints/latest           name of the newest complete checkpoint (written last)
    model.safetensors            consolidated weights at the end of training
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
import struct
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from mmpt import distributed as mdist
from mmpt.config import ConfigError
from mmpt.engine import faults
from mmpt.engine.sharded_copies import ShardedCopies, whole_from_partitions

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
LATEST = "latest"
COMPLETE = "complete.json"
WEIGHTS = "model.safetensors"
PARTITIONED = "partitioned_buffers"  # model-states entry: {name: full shape} of buffers saved as per-rank partitions


class CheckpointError(RuntimeError):
    """A rank could not write its part of a checkpoint (a full disk, permissions): every rank stops, and the
    previous complete checkpoint is the one to resume from."""


def tag_for(step: int) -> str:
    return f"step_{step:09d}"


def rng_state() -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": _numpy_state_to_plain(np.random.get_state()),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(_as_tuple(state["python"]))
    np.random.set_state(_numpy_state_from_plain(state["numpy"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _as_tuple(value: Any) -> Any:
    return tuple(_as_tuple(v) for v in value) if isinstance(value, (list, tuple)) else value


def _numpy_state_to_plain(state: tuple) -> list:
    name, keys, pos, has_gauss, cached = state
    return [name, torch.from_numpy(np.asarray(keys, dtype=np.int64)), int(pos), int(has_gauss), float(cached)]


def _numpy_state_from_plain(state: list) -> tuple:
    name, keys, pos, has_gauss, cached = state
    return (name, keys.numpy().astype(np.uint32), pos, has_gauss, cached)


def save(engine, run_dir: Path, step: int, rank_state: dict[str, Any], keep_last: int,
         sharded: ShardedCopies | None = None) -> Path:
    """Every rank calls this. Each rank writes and fsyncs its files, then all ranks agree, through one
    collective, that every rank's files are down; only then does rank 0 write `complete.json` (a checkpoint
    counts only with it) and move `latest`. A kill at any moment leaves the previous complete checkpoint
    as the one to resume from; a rank that cannot write stops every rank, naming itself."""
    root = run_dir / CHECKPOINTS
    tag = tag_for(step)
    rank = mdist.get_rank()
    if rank == 0:
        (root / tag / COMPLETE).unlink(missing_ok=True)  # re-saving a step: it is incomplete until done
    mdist.barrier()
    failure = None
    try:
        with _fsynced_writes(engine):
            # `universal_checkpoint_info` lets DeepSpeed convert this checkpoint for another number of ranks;
            # `partitioned_buffers` tells readers which buffers each rank saved only its partition of.
            client = {"step": step, "universal_checkpoint_info": {}}
            if sharded is not None:
                client[PARTITIONED] = sharded.shapes(engine.module)
            engine.save_checkpoint(str(root), tag=tag, client_state=client, save_latest=False)
        faults.inject("save:after_engine", step, rank)
        _atomic_torch_save(rank_state, root / tag / f"rank_{rank}.pt")
        faults.inject("save:after_rank_state", step, rank)
    except Exception as exc:  # reported to every rank below, then raised here
        failure = exc
    done = mdist.all_gather_floats([0.0 if failure else 1.0])
    failed = [r for r, (ok,) in enumerate(done) if not ok]
    if failure is not None:
        raise CheckpointError(f"{root / tag}: rank {rank} could not write its files: "
                              f"{type(failure).__name__}: {failure}") from failure
    if failed:
        raise CheckpointError(f"{root / tag}: rank(s) {failed} could not write their files (their own line says "
                              "why); the previous complete checkpoint is the one to resume from")
    if rank == 0:
        _atomic_write(root / tag / COMPLETE, json.dumps({"step": step, "world_size": mdist.get_world_size()}))
        faults.inject("save:before_latest", step, rank)
        _atomic_write(root / LATEST, tag)
        faults.inject("save:before_prune", step, rank)
        _prune(root, step, keep_last)
    mdist.barrier()
    return root / tag


@contextmanager
def _fsynced_writes(engine):
    """Every file DeepSpeed writes for `engine` (through its checkpoint engine) is fsynced by the rank that
    wrote it, before that rank reports its part done: a crash of the machine after `complete.json` cannot
    leave a checkpoint whose parts are still in a page cache."""
    writer = engine.checkpoint_engine
    save = writer.save

    def save_and_sync(state_dict, path, *args, **kwargs):
        result = save(state_dict, path, *args, **kwargs)
        _fsync(Path(path))
        return result

    writer.save = save_and_sync
    try:
        yield
    finally:
        writer.save = save


def _fsync(path: Path) -> None:
    """Flush a file (or a directory's entries) to stable storage."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _atomic_write(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(text)
    _fsync(temporary)
    temporary.replace(path)
    _fsync(path.parent)


def _atomic_torch_save(obj: Any, path: Path) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    torch.save(obj, temporary)
    _fsync(temporary)
    temporary.replace(path)
    _fsync(path.parent)


def is_complete(checkpoint: Path) -> bool:
    """A checkpoint is complete when its `complete.json` is there and readable: rank 0 writes it only after
    every rank reported its files written and synced (no per-rank file is looked at, which on a large job
    would be thousands of metadata reads on a shared filesystem from every rank)."""
    try:
        return int(json.loads((checkpoint / COMPLETE).read_text())["world_size"]) > 0
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _prune(root: Path, step: int, keep_last: int) -> None:
    """Keep the newest `keep_last` checkpoints up to `step`; never touch later ones (another run's)."""
    earlier = sorted(p for p in root.glob("step_*") if p.is_dir() and _step_of(p) < step)
    for old in earlier[: max(0, len(earlier) - (keep_last - 1))]:
        shutil.rmtree(old, ignore_errors=True)
    later = [p.name for p in root.glob("step_*") if _step_of(p) > step]
    if later:
        log.warning("checkpoints later than step %d from an earlier run are left in %s: %s", step, root, sorted(later))


def _step_of(path: Path) -> int:
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
    chosen = max(complete, key=_step_of) if complete else None
    skipped = sorted(p.name for p in root.glob("step_*")
                     if p.is_dir() and not is_complete(p) and (chosen is None or _step_of(p) > _step_of(chosen)))
    if skipped:
        log.warning("skipping incomplete checkpoint(s) %s in %s (a run was stopped while saving)", skipped, root)
    return chosen


def saved_world_size(checkpoint: Path) -> int:
    return int(json.loads((checkpoint / COMPLETE).read_text())["world_size"])


def to_universal(checkpoint: Path, run_dir: Path) -> Path:
    """A DeepSpeed universal copy of a ZeRO checkpoint, loadable by any number of ranks.

    Rank 0 converts once (`deepspeed.checkpoint.ds_to_universal`); every rank calls this and waits.
    """
    target = run_dir / "checkpoints_universal" / checkpoint.name
    if mdist.get_rank() == 0 and not (target / COMPLETE).exists():
        shutil.rmtree(target, ignore_errors=True)
        command = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                   "--input_folder", str(checkpoint), "--output_folder", str(target)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"converting {checkpoint} to a universal checkpoint failed:\n{result.stderr[-2000:]}")
        shutil.copyfile(checkpoint / COMPLETE, target / COMPLETE)
    mdist.barrier()
    return target


def load_engine(engine, checkpoint: Path) -> int:
    """Restore model, optimizer and schedule; returns the step."""
    if not checkpoint.is_dir():
        raise FileNotFoundError(f"checkpoint {checkpoint} does not exist")
    _, client = engine.load_checkpoint(str(checkpoint.parent), tag=checkpoint.name)
    if client is None:
        raise RuntimeError(f"DeepSpeed could not load the checkpoint in {checkpoint}")
    _unshare_step_counters(engine.optimizer)
    return int(client["step"])


def load_buffers(engine, checkpoint: Path, sharded: ShardedCopies | None = None) -> None:
    """The module's buffers (BatchNorm statistics, VICTOR's queues and key network) as `checkpoint` saved them.

    DeepSpeed 0.19.8's universal checkpoint carries parameters and optimizer state only: a resume on
    another number of ranks would otherwise start every buffer again from its initial value. Partitions of
    momentum copies under ZeRO-3 (`sharded`) are cut for this rank from the whole tensors.
    """
    saved, _ = saved_buffers(checkpoint)
    partitioned = {name for name, t in engine.module.state_dict(keep_vars=True).items()
                   if sharded is not None and sharded.is_partition(t)}
    restore_buffers(engine.module, {k: v for k, v in saved.items() if k not in partitioned})
    if partitioned:
        sharded.load_whole(engine.module, saved)


def saved_buffers(checkpoint: Path) -> tuple[dict[str, torch.Tensor], set[str]]:
    """Every buffer `checkpoint` holds, whole, and the names of those its ranks saved as partitions.

    Buffers are whole on every rank at every ZeRO stage, so rank 0's model-states file holds them all,
    except the tensors named in its `partitioned_buffers` (momentum copies under ZeRO-3): those are put
    back together from every rank's file. (Rank 0's module state also holds parameters, or ZeRO-3's
    placeholders for them: readers take the buffers they know.)
    """
    files = model_state_files(checkpoint)
    first = torch.load(files[0], map_location="cpu", weights_only=False)
    state, shapes = first["module"], first.get(PARTITIONED) or {}
    if shapes:
        ranks = [state] + [torch.load(f, map_location="cpu", weights_only=False)["module"] for f in files[1:]]
        state.update({name: whole_from_partitions(name, [r[name] for r in ranks], shape)
                      for name, shape in shapes.items()})
    return state, set(shapes)


def model_state_files(checkpoint: Path) -> list[Path]:
    """DeepSpeed's model-states files of a checkpoint in the order of the ranks that wrote them (under ZeRO-3
    each rank writes `zero_pp_rank_<r>_mp_rank_00_model_states.pt`; otherwise there is one file)."""
    def saving_rank(path: Path) -> int:
        return int(path.name.split("_")[3]) if path.name.startswith("zero_pp_rank_") else 0

    files = sorted(checkpoint.glob("*model_states.pt"), key=saving_rank)
    if not files:
        raise FileNotFoundError(f"checkpoint {checkpoint} has no model states file")
    return files


def restore_buffers(module: nn.Module, saved: dict[str, torch.Tensor]) -> None:
    """Load the buffers of `saved` into `module`, leaving its parameters as they are.

    Through `load_state_dict`, not copies into the buffers: modules that keep host-side state derived from
    their buffers (a memory queue's write position) refresh it as they would on a full load.
    """
    buffers = {name: saved[name] for name, _ in module.named_buffers() if name in saved}
    module.load_state_dict(buffers, strict=False)


def _unshare_step_counters(optimizer) -> None:
    """Give every optimizer state its own `step` tensor.

    DeepSpeed 0.19.8's ZeRO-3 universal-checkpoint loader puts one `step` tensor into the state of
    every parameter sub-group. Adam increments its step in place, once per sub-group, so a shared
    counter advanced by the number of sub-groups per optimizer step: Adam's bias correction ran ahead
    after every resume on another number of ranks.
    """
    states = getattr(optimizer, "optimizer", optimizer).state.values()
    seen: set[int] = set()
    for state in states:
        step = state.get("step")
        if isinstance(step, torch.Tensor):
            if id(step) in seen:
                state["step"] = step.clone()
            seen.add(id(step))


def rank_states(checkpoint: Path) -> list[dict[str, Any]]:
    """Every saved rank's own state (data position, RNG), in rank order."""
    return [torch.load(checkpoint / f"rank_{r}.pt", weights_only=True) for r in range(saved_world_size(checkpoint))]


def _full_weights(model: nn.Module, sharded: ShardedCopies | None = None) -> Iterator[tuple[str, torch.Tensor | None]]:
    """(name, full fp32 tensor on the CPU of rank 0, None elsewhere) of every state-dict entry, one at a time;
    every rank iterates (a parameter partitioned by ZeRO-3, or a momentum copy's partition in `sharded`, is
    gathered as it comes).

    Parameters come from the optimizer's fp32 master copy where one exists (bf16/fp16, any ZeRO stage),
    so no rank ever holds more than one full parameter besides its own shard.
    """
    from deepspeed.utils import safe_get_full_fp32_param

    params = dict(model.named_parameters(remove_duplicate=False))  # tied weights under every name
    for name, value in model.state_dict(keep_vars=True).items():
        if name in params:
            tensor = safe_get_full_fp32_param(params[name])
            if tensor is None:
                tensor = value  # a parameter without a master copy (fp32 at ZeRO 0)
        elif sharded is not None and sharded.is_partition(value):
            tensor = sharded.full(value)
        else:
            tensor = value
        yield name, tensor.detach().float().cpu().contiguous() if mdist.get_rank() == 0 else None


def _full_shapes(model: nn.Module, sharded: ShardedCopies | None = None) -> dict[str, tuple[int, ...]]:
    """Every state-dict entry's full shape, known without gathering (ZeRO-3 keeps it in `ds_shape`)."""
    shapes = {}
    for name, value in model.state_dict(keep_vars=True).items():
        if sharded is not None and sharded.is_partition(value):
            shapes[name] = tuple(sharded.full_shape(value))
        else:
            shapes[name] = tuple(getattr(value, "ds_shape", value.shape))
    return shapes


def gathered_state_dict(model: nn.Module, sharded: ShardedCopies | None = None) -> dict[str, torch.Tensor] | None:
    """Full fp32 weights on rank 0 (None elsewhere); every rank calls it."""
    full = {name: tensor.clone() for name, tensor in _full_weights(model, sharded) if tensor is not None}
    return full if mdist.get_rank() == 0 else None


def read_weights(model: nn.Module, path: Path) -> nn.Module:
    """`model` with the weights `write_weights` wrote to `path` (every state-dict entry, tied ones too)."""
    from safetensors.torch import load_file

    model.load_state_dict(load_file(str(path)), strict=True)
    return model


def write_weights(model: nn.Module, path: Path, sharded: ShardedCopies | None = None) -> None:
    """Consolidated fp32 weights as safetensors, streamed: rank 0 writes each tensor as it is gathered, so
    neither the accelerator nor the host ever holds a second full model. Every rank calls it.

    The safetensors layout is written directly: an 8-byte little-endian header length, a JSON header naming
    every tensor's dtype, shape and byte range (known up front from the shapes), then the bytes in that order.
    """
    shapes = _full_shapes(model, sharded)
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes.items():
        size = 4 * math.prod(shape)
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    handle = None
    if mdist.get_rank() == 0:
        temporary = path.with_name(f".{path.name}.tmp")
        handle = open(temporary, "wb")
    try:
        if handle is not None:
            handle.write(struct.pack("<Q", len(encoded)) + encoded)
        for name, tensor in _full_weights(model, sharded):
            if handle is None:
                continue
            if tuple(tensor.shape) != shapes[name]:
                raise RuntimeError(f"{name}: gathered shape {tuple(tensor.shape)} differs from {shapes[name]}")
            handle.write(tensor.reshape(-1).numpy().view(np.uint8))
    finally:
        if handle is not None:
            handle.close()
    if handle is not None:
        _fsync(temporary)
        temporary.replace(path)
        shareable(path)


def shareable(path: Path) -> None:
    """Give a written file the permissions the umask allows (safetensors writes 0600 through a temporary
    file): weights are handed to other users, jobs and hubs."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)
