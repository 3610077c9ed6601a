"""One run's checkpoints: the engine's state, every rank part registered with it, and the final weights.

A stateful part of a run (the data position, the RNG, anything added later) registers once by name
(`register`) and is saved and restored with every checkpoint; the checkpoint code names none of them.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from mmpt import distributed as mdist
from mmpt.artifacts import WEIGHTS
from mmpt.engine.checkpoint import deepspeed_io, protocol, weights
from mmpt.engine.checkpoint.parts import PartitionedTensors, RankPart

log = logging.getLogger(__name__)

LAYOUT = "layout"  # rank-state entry: the layout the parts were saved in


class Checkpointer:
    """`layout`: what must match for the rank parts to continue exactly (e.g. data ranks and loader workers);
    `reached(point, step)` is told each point of the save protocol; `partitioned`: module tensors kept as
    per-rank partitions outside ZeRO, if any."""

    def __init__(
        self,
        run_dir: Path,
        keep_last: int,
        layout: tuple,
        reached: protocol.Reached,
        partitioned: PartitionedTensors | None = None,
    ):
        self.run_dir, self.root = run_dir, run_dir / protocol.CHECKPOINTS
        self.keep_last, self.layout, self.reached, self.partitioned = keep_last, list(layout), reached, partitioned
        self.parts: dict[str, RankPart] = {}

    def register(self, name: str, part: RankPart) -> None:
        """Save and restore `part` with every checkpoint; parts are restored in the order they registered."""
        if name in self.parts or name == LAYOUT:
            raise ValueError(f"a checkpoint part named {name!r} is already registered")
        self.parts[name] = part

    def save(self, engine, step: int) -> Path:
        """Every rank calls this (see `protocol.save`)."""
        state: dict[str, Any] = {LAYOUT: self.layout, **{name: part.state_dict() for name, part in self.parts.items()}}
        return protocol.save(
            self.root,
            step,
            lambda folder: deepspeed_io.save_engine(engine, folder, step, self.partitioned),
            state,
            self.keep_last,
            self.reached,
        )

    def restore(self, engine, checkpoint: Path, engine_checkpoint: Path) -> tuple[int, list]:
        """Load `checkpoint` into the engine (from `engine_checkpoint`, its universal copy when the number of
        ranks changed) and every part; returns (step, the layout the parts were saved in)."""
        step = deepspeed_io.load_engine(engine, engine_checkpoint)
        if engine_checkpoint != checkpoint:  # a universal copy: it lacks the buffers
            deepspeed_io.load_buffers(engine, checkpoint, self.partitioned)
        states = protocol.rank_states(checkpoint)
        saved_layout = list(states[0][LAYOUT])
        for name, part in self.parts.items():
            if name not in states[0]:  # a part this checkpoint was saved without (e.g. a setting turned on since)
                log.info("checkpoint %s holds no '%s': it starts afresh", checkpoint, name)
                continue
            if saved_layout == self.layout:
                part.load_state_dict(states[mdist.get_rank()][name])
            else:
                part.load_resharded([s[name] for s in states], step)
        return step, saved_layout

    def write_weights(self, model) -> Path:
        """The consolidated fp32 weights (every rank calls it; rank 0 writes)."""
        path = self.run_dir / WEIGHTS
        weights.write_weights(model, path, self.partitioned)
        return path
