"""DeepSpeed's checkpoint save and load, and what mmpt adds around them (each workaround names the DeepSpeed
release it was written against: 0.19.8).

- Durability: every file DeepSpeed writes is fsynced by the rank that wrote it (`fsynced_writes`).
- Another number of ranks: DeepSpeed's universal checkpoint, converted once by rank 0 (`to_universal`).
- DeepSpeed 0.19.8's universal checkpoint carries parameters and optimizer state only: the module's
  buffers are read back from the original checkpoint (`load_buffers`).
- DeepSpeed 0.19.8's ZeRO-3 universal loader shares one Adam `step` tensor between sub-groups
  (`unshare_step_counters`).
- DeepSpeed 0.19.8's `zero_to_fp32` refuses the optimizer files of bf16 at ZeRO-1 (its BF16_Optimizer):
  `fp32_weights` consolidates them.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mmpt import distributed as mdist
from mmpt.artifacts import fsync
from mmpt.engine import deepspeed_private
from mmpt.engine.checkpoint.parts import PartitionedTensors, whole_from_partitions
from mmpt.engine.checkpoint.protocol import COMPLETE
from mmpt.errors import ConfigError

PARTITIONED = "partitioned_buffers"  # model-states entry: {name: full shape} of buffers saved as per-rank partitions


def save_engine(engine, folder: Path, step: int, partitioned: PartitionedTensors | None) -> None:
    """The engine's files for `step` into `folder`, each synced to disk by this rank.

    `universal_checkpoint_info` lets DeepSpeed convert the checkpoint for another number of ranks;
    `partitioned_buffers` tells readers which buffers each rank saved only its partition of.
    """
    client: dict[str, Any] = {"step": step, "universal_checkpoint_info": {}}
    if partitioned is not None:
        client[PARTITIONED] = partitioned.shapes(engine.module)
    with fsynced_writes(engine):
        engine.save_checkpoint(str(folder.parent), tag=folder.name, client_state=client, save_latest=False)


@contextmanager
def fsynced_writes(engine) -> Iterator[None]:
    """Every file DeepSpeed writes for `engine` (through its checkpoint engine) is fsynced by the rank that
    wrote it, before that rank reports its part done: a crash of the machine after `complete.json` cannot
    leave a checkpoint whose parts are still in a page cache."""
    writer = engine.checkpoint_engine
    save = writer.save

    def save_and_sync(state_dict, path, *args, **kwargs):
        result = save(state_dict, path, *args, **kwargs)
        fsync(Path(path))
        return result

    writer.save = save_and_sync
    try:
        yield
    finally:
        writer.save = save


def to_universal(checkpoint: Path, run_dir: Path) -> Path:
    """A DeepSpeed universal copy of a ZeRO checkpoint, loadable by any number of ranks.

    Rank 0 converts once (`deepspeed.checkpoint.ds_to_universal`); every rank calls this and waits.
    """
    target = run_dir / "checkpoints_universal" / checkpoint.name
    if mdist.get_rank() == 0 and not (target / COMPLETE).exists():
        shutil.rmtree(target, ignore_errors=True)
        command = [
            sys.executable,
            "-m",
            "deepspeed.checkpoint.ds_to_universal",
            "--input_folder",
            str(checkpoint),
            "--output_folder",
            str(target),
        ]
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
    try:
        _, client = engine.load_checkpoint(str(checkpoint.parent), tag=checkpoint.name)
    except RuntimeError as exc:  # torch's strict load: the config builds another model than the one saved
        if "Error(s) in loading state_dict" not in str(exc):
            raise
        lines = str(exc).strip().splitlines()
        run_dir = checkpoint.parent.parent
        raise ConfigError(
            f"{checkpoint} does not fit the model this config builds ({(lines[1:] or lines)[0].strip()}): the config "
            f"changed since it was saved; resume with the run's own ({run_dir / 'config.yaml'}), or set "
            "run.output_dir to start another run"
        ) from None
    if client is None:
        raise RuntimeError(f"DeepSpeed could not load the checkpoint in {checkpoint}")
    unshare_step_counters(engine.optimizer)
    return int(client["step"])


def load_buffers(engine, checkpoint: Path, partitioned: PartitionedTensors | None = None) -> None:
    """The module's buffers (BatchNorm statistics, queues, momentum copies) as `checkpoint` saved them.

    DeepSpeed 0.19.8's universal checkpoint carries parameters and optimizer state only: a resume on
    another number of ranks would otherwise start every buffer again from its initial value. Buffers kept
    as per-rank partitions (`partitioned`) are cut for this rank from the whole tensors.
    """
    saved, _ = saved_buffers(checkpoint)
    cut = {
        name
        for name, t in engine.module.state_dict(keep_vars=True).items()
        if partitioned is not None and partitioned.is_partition(t)
    }
    restore_buffers(engine.module, {k: v for k, v in saved.items() if k not in cut})
    if cut and partitioned is not None:
        partitioned.load_whole(engine.module, saved)


def saved_buffers(checkpoint: Path) -> tuple[dict[str, torch.Tensor], set[str]]:
    """Every buffer `checkpoint` holds, whole, and the names of those its ranks saved as partitions.

    Buffers are whole on every rank at every ZeRO stage, so rank 0's model-states file holds them all,
    except the tensors named in its `partitioned_buffers`: those are put back together from every rank's
    file. (Rank 0's module state also holds parameters, or ZeRO-3's placeholders for them: readers take
    the buffers they know.)
    """
    files = model_state_files(checkpoint)
    first = torch.load(files[0], map_location="cpu", weights_only=False)
    state, shapes = first["module"], first.get(PARTITIONED) or {}
    if shapes:
        ranks = [state] + [torch.load(f, map_location="cpu", weights_only=False)["module"] for f in files[1:]]
        state.update(
            {name: whole_from_partitions(name, [r[name] for r in ranks], shape) for name, shape in shapes.items()}
        )
    return state, set(shapes)


def fp32_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The fp32 master weights of a ZeRO 1-3 checkpoint, whole, by parameter name (the module's names).

    DeepSpeed's `zero_to_fp32` reads them, except from the files of bf16 at ZeRO-1 (DeepSpeed's
    BF16_Optimizer), which carry no `zero_stage` and which 0.19.8 refuses as "not a zero checkpoint". Their
    layout is ZeRO-1/2's: per parameter group one flat fp32 tensor, padded and cut into one equal partition
    per rank, parameters packed in the order the model-states file lists their shapes; `zero_to_fp32`'s own
    ZeRO-2 merge reads them once they are gathered here.
    """
    from deepspeed.utils import zero_to_fp32

    def optimizer_state(path: Path) -> dict:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=False)["optimizer_state_dict"]

    files = sorted(checkpoint.glob("*_optim_states.pt"), key=_saving_rank)
    if not files or "zero_stage" in optimizer_state(files[0]):  # a ZeRO optimizer's (or none: DeepSpeed says so)
        state = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(checkpoint.parent), tag=checkpoint.name)
        assert state is not None  # None only with lazy_mode, not asked for here
        return dict(state)
    states = [optimizer_state(f) for f in files]
    counts = states[0]["partition_count"]
    ranks = max(counts) if isinstance(counts, list) else int(counts)
    if ranks != len(files):
        raise FileNotFoundError(f"checkpoint {checkpoint}: {len(files)} optimizer files for {ranks} ranks")
    groups = [state["single_partition_of_fp32_groups"] for state in states]
    model_states = zero_to_fp32.parse_model_states([str(f) for f in model_state_files(checkpoint)])
    return deepspeed_private.zero2_fp32_state_dict(ranks, groups, model_states)


def _saving_rank(path: Path) -> int:
    """The rank in a per-rank file name (`[bf16_]zero_pp_rank_<r>_...`); 0 for the one shared file."""
    parts = path.name.split("_")
    return int(parts[parts.index("rank") + 1]) if "zero_pp" in path.name else 0


def model_state_files(checkpoint: Path) -> list[Path]:
    """DeepSpeed's model-states files of a checkpoint in the order of the ranks that wrote them (under ZeRO-3
    each rank writes `zero_pp_rank_<r>_mp_rank_00_model_states.pt`; otherwise there is one file)."""

    files = sorted(checkpoint.glob("*model_states.pt"), key=_saving_rank)
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


def unshare_step_counters(optimizer) -> None:
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
