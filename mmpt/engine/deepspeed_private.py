"""Every use mmpt makes of DeepSpeed's private API (underscored and name-mangled attributes, internal modules,
its communication backend object), in one place. Each was written against one DeepSpeed release, `EXPECTED`
(the version pyproject.toml pins); a run checks at its start that this is the release installed
(`check_version`), so another one fails in one line instead of deep inside a private call.
"""

from __future__ import annotations

import logging
import os
import sys
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


def accept_zero_optimizer(kind: type) -> None:
    """Let ZeRO take `kind` (a subclass of an optimizer it supports) without its "untested optimizer" refusal."""
    from deepspeed.runtime.zero import utils

    if kind not in utils.ZERO_SUPPORTED_OPTIMIZERS:
        utils.ZERO_SUPPORTED_OPTIMIZERS.append(kind)


def skip_on_device(zero_optimizer: Any, inner: Any) -> None:
    """ZeRO 1-2 without a host read in the step: a non-finite step is skipped by `inner` (a `SkippingAdamW`),
    on the device, from the global gradient norm DeepSpeed computed (an inf/NaN norm is masked to -1 there).

    DeepSpeed 0.19.8 decides on the host instead: `has_overflow` reads a flag back (`.item()`, turned off with
    bf16's `check_grad_overflow: false`), `is_invalid_grad_norm` reads the norm's validity (ZeRO-1/2's and
    BF16_Optimizer's step, and ZeRO-1/2's clipping), and BF16_Optimizer's clipping compares the clip factor
    with 1 on the host. Each read stalls a GPU until the step's backward has run. For `zero_optimizer`
    those two functions, as those two modules bound them, see every norm as valid and clip by a device-side
    factor (the same values: 1 where the stock code would not clip); the skip itself is `inner`'s. Any other
    optimizer calling them (ZeRO-3's stage3.py binds its own) gets DeepSpeed's.
    """
    from deepspeed.runtime import bf16_optimizer
    from deepspeed.runtime.zero import stage_1_and_2

    inner.global_norm = lambda: zero_optimizer._global_grad_norm  # set by the step before the optimizer runs
    setattr(zero_optimizer, _SKIPS, True)
    for module, name, on_device in (
        (stage_1_and_2, "is_invalid_grad_norm", _valid_on_device),
        (bf16_optimizer, "is_invalid_grad_norm", _valid_on_device),
        (bf16_optimizer, "clip_tensors_by_global_norm", _clip_on_device),
    ):
        setattr(module, name, _for_skipping_callers(getattr(module, name), on_device))


_SKIPS = "mmpt_skips_on_device"  # marks the ZeRO optimizers `skip_on_device` took, and its replacements


def _for_skipping_callers(stock: Callable, on_device: Callable) -> Callable:
    """`on_device` when the calling method's `self` is an optimizer `skip_on_device` took, else `stock`."""
    if getattr(stock, _SKIPS, False):
        return stock

    def chosen(*args: Any, **kwargs: Any) -> Any:
        caller = sys._getframe(1).f_locals.get("self")
        return (on_device if getattr(caller, _SKIPS, False) else stock)(*args, **kwargs)

    setattr(chosen, _SKIPS, True)
    return chosen


def _valid_on_device(norm: Any) -> bool:
    """DeepSpeed's `is_invalid_grad_norm` for a skip made on the device: no norm is refused on the host."""
    return False


def _clip_on_device(input_tensors, max_norm=1.0, global_norm: Any = None, mpu=None, eps=1e-6):
    """`deepspeed.runtime.utils.clip_tensors_by_global_norm` given the global norm (BF16_Optimizer always gives
    it), with the factor's `< 1` test made on the device."""
    factor = torch.clamp(max_norm / (global_norm + eps), max=1.0)
    for tensor in input_tensors:
        tensor.detach().mul_(factor)
    return global_norm
