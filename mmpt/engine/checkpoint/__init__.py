"""Checkpoints: DeepSpeed's model and optimizer shards, each rank's own parts (data position, RNG), and the
consolidated weights at the end.

Layout of a run directory::

    config.yaml                  the resolved config
    checkpoints/step_000100/     DeepSpeed files of every rank + rank_<r>.pt (each rank's registered parts)
    checkpoints/latest           name of the newest complete checkpoint (written last)
    model.safetensors            consolidated weights at the end of training

Where things live: `protocol` (when a checkpoint counts as written, which one to resume from),
`parts` (what a stateful part offers), `rng` (the RNG codec), `deepspeed_io` (DeepSpeed's save and load,
with the workarounds for the DeepSpeed versions named there), `weights` (the safetensors writer and
reader) and `checkpointer` (one run's checkpoints, tying them together).
"""

from mmpt.engine.checkpoint.checkpointer import Checkpointer
from mmpt.engine.checkpoint.protocol import CheckpointError, find_resume, rank_states, saved_step, saved_world_size
from mmpt.engine.checkpoint.rng import RngState
from mmpt.engine.checkpoint.weights import gathered_state_dict, read_weights, write_weights

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "RngState",
    "find_resume",
    "gathered_state_dict",
    "rank_states",
    "read_weights",
    "saved_step",
    "saved_world_size",
    "write_weights",
]
