"""Small distributed helpers shared by the engine and the losses.

Losses gather features across ranks with gradient. `torch.distributed.nn.all_gather` scatters its
gradient with group-local ranks used as global ranks, which breaks on sub-groups, so the gather
here is an autograd Function of its own: all_gather forward, reduce-scatter backward (emulated
with scatters on gloo, which has no reduce-scatter).
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ProcessInfo:
    rank: int
    world_size: int
    local_rank: int


def process_info() -> ProcessInfo:
    """Rank layout from the environment (deepspeed launcher, torchrun) or a single process."""
    return ProcessInfo(
        rank=int(os.environ.get("RANK", 0)),
        world_size=int(os.environ.get("WORLD_SIZE", 1)),
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
    )


def ensure_rendezvous_env() -> None:
    """A plain `python launch/train.py` sets no rendezvous variables: make it a world of one."""
    if "WORLD_SIZE" in os.environ:
        return
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(sock.getsockname()[1])


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_rank(group) if is_initialized() else 0


def get_world_size(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_world_size(group) if is_initialized() else 1


def barrier() -> None:
    if is_initialized():
        dist.barrier()


class GatherClock:
    """Seconds this process spent inside forward gathers: time spent waiting for other ranks,
    which the engine subtracts to see how long a rank itself takes (straggler detection)."""

    seconds = 0.0


class _GatherWithGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        ctx.rank = dist.get_rank(group)
        ctx.rows = tensor.shape[0]
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        started = time.perf_counter()
        dist.all_gather(parts, tensor.contiguous(), group=group)
        GatherClock.seconds += time.perf_counter() - started
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return reduce_scatter_rows(grad.contiguous(), ctx.group), None


def reduce_scatter_rows(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum `tensor` over the group and keep this rank's block of rows.

    NCCL has reduce-scatter; gloo does not, so each rank in turn scatters its blocks and every
    rank sums what it received: the same bytes on the wire, (G-1)/G of the tensor per rank.
    """
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    rows = tensor.shape[0] // size
    mine = torch.empty((rows, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    if dist.get_backend(group) == "nccl":
        dist.reduce_scatter_tensor(mine, tensor, op=dist.ReduceOp.SUM, group=group)
        return mine
    blocks = list(tensor.split(rows))
    total = blocks[rank].clone()
    for source in range(size):
        if source == rank:
            dist.scatter(mine, blocks, src=_global_rank(group, source), group=group)
        else:
            dist.scatter(mine, None, src=_global_rank(group, source), group=group)
            total += mine
    return total


def _global_rank(group: dist.ProcessGroup | None, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def contiguous_group(group_size: int | None) -> dist.ProcessGroup | None:
    """This rank's group when ranks are split into contiguous groups of `group_size` (None: all ranks).

    Every rank must call it (group creation is collective), in the same order.
    """
    world = get_world_size()
    if group_size is None or group_size == world or not is_initialized():
        return None
    if group_size < 1 or world % group_size:
        raise ValueError(f"group size {group_size} does not divide the {world} ranks")
    mine = None
    for start in range(0, world, group_size):
        group = dist.new_group(list(range(start, start + group_size)))
        if start <= get_rank() < start + group_size:
            mine = group
    return mine


def local_world_size() -> int:
    """Ranks on this node, from the launcher's environment (torchrun, deepspeed) or all ranks."""
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        if name in os.environ:
            return int(os.environ[name])
    return get_world_size()


def all_gather_with_grad(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Concatenate `tensor` (same shape on every rank) over the group, rank order, keeping gradient.

    The gradient reaching each rank's input is the sum over ranks of the gradient of their
    output w.r.t. that rank's rows, as if the whole gathered batch were one graph.
    """
    if not is_initialized() or dist.get_world_size(group) == 1:
        return tensor
    return _GatherWithGrad.apply(tensor, group)


def _comm_device() -> torch.device:
    """NCCL only moves CUDA tensors; gloo moves CPU ones."""
    if is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    if not is_initialized() or dist.get_world_size() == 1:
        return values
    reduced = values.detach().to(_comm_device(), copy=True)
    dist.all_reduce(reduced, op=dist.ReduceOp.SUM)
    return reduced.to(values.device)


def all_reduce_mean(values: torch.Tensor) -> torch.Tensor:
    return all_reduce_sum(values) / get_world_size()


def all_gather_floats(values: list[float]) -> list[list[float]]:
    """Each rank's list of floats (same length everywhere), for per-rank logging."""
    local = torch.tensor(values, dtype=torch.float64, device=_comm_device())
    if not is_initialized() or dist.get_world_size() == 1:
        return [local.tolist()]
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, local)
    return [p.cpu().tolist() for p in parts]


def all_gather_objects(value: object) -> list[object]:
    """Every rank's picklable `value`, in rank order (e.g. the labels of each rank's batch)."""
    if not is_initialized() or dist.get_world_size() == 1:
        return [value]
    parts: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, value)
    return parts
