"""Every use mmpt makes of DeepSpeed's private API (underscored and name-mangled attributes, internal modules,
its communication backend object), in one place. Each was written against one DeepSpeed release, `EXPECTED`
(the version pyproject.toml pins); a run checks at its start that this is the release installed
(`check_version`), so another one fails in one line instead of deep inside a private call.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mmpt.errors import ConfigError

log = logging.getLogger(__name__)

EXPECTED = "0.19.8"


def check_version() -> None:
    """Refuse any DeepSpeed release but `EXPECTED`: the calls below depend on its internals."""
    import deepspeed

    if deepspeed.__version__ != EXPECTED:
        raise ConfigError(
            f"mmpt needs DeepSpeed {EXPECTED} (it uses that release's private API), but DeepSpeed "
            f"{deepspeed.__version__} is installed: pip install deepspeed=={EXPECTED}"
        )


def comm_backend() -> Any:
    """DeepSpeed's communication backend object (`deepspeed.comm.comm.cdb`), whose methods ZeRO calls for its
    collectives; None before DeepSpeed's process group starts."""
    import deepspeed.comm.comm as ds_comm

    return getattr(ds_comm, "cdb", None)


def release_cpu_allreduce_buffer(rank: int) -> None:
    """Unlink this rank's CPU all-reduce buffer from /dev/shm once every rank has mapped it.

    On CPU ranks DeepSpeed's communication backend creates one ~70 MB shared-memory file per rank and run,
    named after the rendezvous port, and never removes it: every run, killed ones most of all, would leave
    its buffers behind until /dev/shm fills memory. Call after a barrier that follows the process group's
    start (every peer has then mapped every buffer); the memory goes when the last rank exits.
    """
    name = (
        f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
        f"{os.environ.get('MASTER_PORT', '')}_{rank}"
    )
    Path("/dev/shm", name).unlink(missing_ok=True)


def pool_coordinator(offload: Any) -> Any:
    """A second ZeRO-3 parameter coordinator with the settings DeepSpeed gave its own
    (`DeepSpeedZeRoOffload.__init__`), sharing its gather stream and in-flight registry; None where this
    DeepSpeed keeps them elsewhere."""
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    try:
        return PartitionedParameterCoordinator(
            prefetch_bucket_sz=offload._prefetch_bucket_sz,
            max_reuse_distance_in_numel=offload._max_reuse_distance_in_numel,
            max_available_parameters_in_numel=offload._max_available_parameters_in_numel,
            allgather_stream=offload._DeepSpeedZeRoOffload__allgather_stream,
            inflight_param_registry=offload._DeepSpeedZeRoOffload__inflight_param_registry,
            prefetch_nvme=offload.offload_device == OffloadDeviceEnum.nvme,
            timers=offload.timers,
            zero_quantized_weights=offload.zero_quantized_weights,
            zero_quantized_nontrainable_weights=offload.zero_quantized_nontrainable_weights,
            fast_sharding_for_leaf_module=offload.fast_sharding_for_leaf_module,
            log_trace_cache_warnings=offload.log_trace_cache_warnings,
        )
    except (AttributeError, TypeError) as exc:
        log.warning("ZeRO-3: the pool pass shares the training pass's prefetch trace (%s)", exc)
        return None


def zero2_fp32_state_dict(ranks: int, groups: list, model_states: list) -> dict[str, torch.Tensor]:
    """`zero_to_fp32`'s merge of ZeRO-1/2 fp32 partitions, gathered by the caller, into whole tensors by name."""
    from deepspeed.utils import zero_to_fp32

    return zero_to_fp32._get_fp32_state_dict_from_zero2_checkpoint(ranks, groups, model_states, False, None)


def partitioned_init(module_built: Callable[[nn.Module], None]) -> type:
    """`deepspeed.zero.Init` that leaves 0-D parameters whole (DeepSpeed 0.19 fails on them while building: it
    broadcasts each parameter as bytes) and calls `module_built(module)` once each module is partitioned."""
    import deepspeed

    class InitPartitioned(deepspeed.zero.Init):
        def _post_init_method(self, module):  # each module is built whole before it is partitioned
            super()._post_init_method(module)
            module_built(module)

        def _zero_init_param(self, param):
            if param.dim() > 0:
                super()._zero_init_param(param)

    return InitPartitioned
