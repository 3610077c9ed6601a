"""Small distributed helpers shared by the engine and the losses.

Losses gather features across ranks with gradient. `torch.distributed.nn.all_gather` scatters its
gradient with group-local ranks used as global ranks, which breaks on sub-groups, so the gather
here is an autograd Function of its own: all_gather forward, reduce-scatter backward (emulated
with scatters on gloo, which has no reduce-scatter).

What a gather needs that the loss calling it does not say (the ranks' layout, whether they hold uneven rows, where
to report its waits) is a run's `Collectives`, current while the run trains (`using`), and the whole world with even
rows outside any run.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import timedelta
from typing import NamedTuple, Protocol, TypeVar, cast

import torch
import torch.distributed as dist

from mmpt.errors import ConfigError

log = logging.getLogger(__name__)


def ensure_rendezvous_env() -> None:
    """A plain `python launch/train.py` sets no rendezvous variables: make it a world of one.

    torchrun counts the ranks on a node in LOCAL_WORLD_SIZE, the deepspeed launcher in LOCAL_SIZE, which is
    what DeepSpeed reads (its CPU accelerator's device count; its shared-memory all-reduce, set up only when
    LOCAL_SIZE equals the ranks): under torchrun it is copied over."""
    if "LOCAL_SIZE" not in os.environ and "LOCAL_WORLD_SIZE" in os.environ:
        os.environ["LOCAL_SIZE"] = os.environ["LOCAL_WORLD_SIZE"]
    if "WORLD_SIZE" in os.environ:
        return
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(sock.getsockname()[1])


# With the watchdog off nothing else bounds a wait; long enough for rank 0's universal conversion of a large
# checkpoint while the others wait in a barrier, short enough that a hung job does not hold its nodes for a day.
UNWATCHED_GROUP_TIMEOUT = timedelta(hours=2)


def group_timeout(watchdog_timeout: float) -> timedelta:
    """How long a collective may wait before the process group aborts it, from `train.watchdog_timeout`.

    The watchdog is the one that should speak about a hang: it names the lagging ranks and exits with its
    own code, while a collective's timeout only kills a rank. Rank 0's watchdog acts after `watchdog_timeout`
    seconds, the others up to half as long again (`mmpt.engine.watchdog`); twice the watchdog plus a minute
    stays past both. The same bound covers rank 0's long work outside the watched loop (converting a
    checkpoint to universal form while the other ranks wait in a barrier). DeepSpeed's own default (10
    minutes) is shorter than the watchdog's default of 30.
    """
    if watchdog_timeout <= 0:
        return UNWATCHED_GROUP_TIMEOUT
    return timedelta(seconds=2 * watchdog_timeout + 60)


def set_default_group_timeout(timeout: timedelta) -> None:
    """Give groups created later without a timeout `timeout` too.

    torch gives such a group its backend's default (30 minutes on gloo, 10 on NCCL), not the world group's:
    DeepSpeed's data-parallel group, a copy of the world made with `new_group(ranks)`, is one of them and
    carries the gradient reductions. torch reads the default from two module globals at each `new_group`.
    """
    for name in ("default_pg_timeout", "default_pg_nccl_timeout"):
        setattr(dist.distributed_c10d, name, timeout)


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_rank(group) if is_initialized() else 0


def get_world_size(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_world_size(group) if is_initialized() else 1


def barrier() -> None:
    if is_initialized():
        dist.barrier()


class SpanClock(Protocol):
    def start(self, name: str) -> None: ...

    def stop(self, name: str) -> None: ...


class _GatherWithGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup | None, counts: tuple[int, ...]) -> torch.Tensor:
        ctx.group, ctx.counts = group, counts
        rank, most = dist.get_rank(group), max(counts)
        if tensor.shape[0] != counts[rank]:
            raise ValueError(f"rank {rank} gathers {tensor.shape[0]} rows but the ranks' counts say {counts[rank]}")
        if tensor.shape[0] < most:  # uneven rows: every rank sends as many, padded, and the padding is dropped
            tensor = torch.cat([tensor, tensor.new_zeros((most - tensor.shape[0], *tensor.shape[1:]))])
        # Gathered straight into the output: no per-rank pieces to concatenate (one copy of the result fewer).
        gathered = tensor.new_empty((len(counts) * most, *tensor.shape[1:]))
        spans = collectives().spans
        if spans is not None:
            spans.start("gather")
        dist.all_gather_into_tensor(gathered, tensor.contiguous(), group=group)
        if spans is not None:
            spans.stop("gather")
        if min(counts) == most:
            return gathered
        return gathered.index_select(0, _unpadded_rows(counts, gathered.device))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        counts, most = ctx.counts, max(ctx.counts)
        if min(counts) < most:
            padded = grad.new_zeros((len(counts) * most, *grad.shape[1:]))
            grad = padded.index_copy_(0, _unpadded_rows(counts, grad.device), grad)
        mine = reduce_scatter_rows(grad.contiguous(), ctx.group)
        return mine[: counts[dist.get_rank(ctx.group)]], None, None


def _unpadded_rows(counts: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Where each rank's real rows sit in a gather padded to `max(counts)` rows per rank."""
    most = max(counts)
    return torch.cat([torch.arange(count, device=device) + rank * most for rank, count in enumerate(counts)])


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

    Every rank must call it (group creation is collective), in the same order. A size from
    `local_world_size()` means "one group per node", which is checked against where ranks really run.
    """
    world = get_world_size()
    if isinstance(group_size, RanksPerNode) and is_initialized():
        layout = check_node_major(cast(list[tuple[str, int]], all_gather_objects((node_identity(), int(group_size)))))
        if get_rank() == 0:
            log.info("one group per node: %s", layout)
    if group_size is None or group_size == world or not is_initialized():
        return None
    if group_size < 1 or world % group_size:
        raise ValueError(f"group size {group_size} does not divide the {world} ranks")
    return own_group([list(range(start, start + group_size)) for start in range(0, world, group_size)])


def own_group(rank_lists: list[list[int]]) -> dist.ProcessGroup | None:
    """Form a group of each list of ranks, in order (a collective: every rank forms every group, each rank is in
    one), and return this rank's."""
    mine = None
    for ranks in rank_lists:
        group = dist.new_group(ranks)
        if get_rank() in ranks:
            mine = cast(dist.ProcessGroup, group)
    return mine


@dataclass(frozen=True)
class ParallelLayout:
    """How ranks divide the work when sequence parallelism is on: `sequence_parallel` consecutive ranks split
    one batch's sequences (`sequence_group`) and read the same samples; the ranks with the same place in
    their sequence group (`data_group`: every `sequence_parallel`-th rank) read different samples."""

    sequence_parallel: int = 1
    sequence_group: dist.ProcessGroup | None = None  # None: sequence parallelism off
    data_group: dist.ProcessGroup | None = None  # None: all ranks
    data_rank: int = 0
    data_size: int = 1

    @classmethod
    def whole_world(cls) -> ParallelLayout:
        """Every rank reads its own samples (sequence parallelism off)."""
        return cls(data_rank=get_rank(), data_size=get_world_size())


def set_sequence_parallel(size: int) -> ParallelLayout:
    """Form the sequence and data-parallel groups for `size` ranks per sequence (a collective; every rank calls
    it once, after the process group starts)."""
    world, rank = get_world_size(), get_rank()
    if size < 1 or world % size:
        raise ConfigError(f"config key 'train.sequence_parallel': {size} must divide the {world} ranks")
    if size == 1:
        return ParallelLayout.whole_world()
    sequence_group = own_group([list(range(start, start + size)) for start in range(0, world, size)])
    data_group = own_group([list(range(offset, world, size)) for offset in range(size)])  # one rank if size == world
    return ParallelLayout(size, sequence_group, data_group, rank // size, world // size)


@dataclass
class Collectives:
    """A run's settings for the gathers its losses make: the ranks' layout (a queue without a group of its own
    gathers over its data-parallel ranks), whether ranks hand gathers different numbers of rows (each rank's
    share of the global batch following its speed: each gather then first exchanges the ranks' row counts, one
    8-byte-per-rank collective read on the host), and the clock forward gathers report their span to ("gather":
    mostly waiting for other ranks, which the engine subtracts from its forward time to see how long a rank
    itself takes)."""

    layout: ParallelLayout = field(default_factory=ParallelLayout.whole_world)
    uneven_rows: bool = False
    spans: SpanClock | None = None


_current: ContextVar[Collectives | None] = ContextVar("mmpt_collectives", default=None)


@contextmanager
def using(settings: Collectives) -> Iterator[Collectives]:
    """Make `settings` the gathers' for the block (a run's training loop, a test's checks)."""
    token = _current.set(settings)
    try:
        yield settings
    finally:
        _current.reset(token)


def collectives() -> Collectives:
    """The current run's `Collectives`; outside any: the whole world, even rows, no clock."""
    return _current.get() or Collectives()


class RanksPerNode(int):
    """A group size that stands for "the ranks of one node", so that `contiguous_group` verifies the
    node layout for it (and not for a size the user chose, whose groups may span nodes on purpose)."""


def local_world_size() -> RanksPerNode:
    """Ranks on this node, from the launcher's environment (torchrun, deepspeed) or all ranks."""
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        if name in os.environ:
            return RanksPerNode(os.environ[name])
    return RanksPerNode(get_world_size())


def node_identity() -> str:
    """Which node this process runs on: the host name, plus the launcher's node rank (torchrun's
    GROUP_RANK, the deepspeed launcher's CROSS_RANK), which tells apart "nodes" sharing one host."""
    node_rank = os.environ.get("GROUP_RANK", os.environ.get("CROSS_RANK"))
    host = socket.gethostname()
    return host if node_rank is None else f"{host}/node{node_rank}"


class NodeLayoutError(ConfigError):
    """Per-node groups would not match the nodes, so a loss would silently gather across them.
    A config error: every rank finds it alike, and restarting the same launch cannot help."""


def check_node_major(ranks: list[tuple[str, int]]) -> str:
    """The layout in a line, or an error unless rank r runs on node r // L for every rank, L the ranks
    per node that all ranks report.

    `ranks[r]` is rank r's (node identity, ranks per node). Launchers number ranks node-major
    (node n holds ranks n*L .. n*L+L-1); a launcher that interleaves nodes, or a ranks-per-node
    variable that is missing or wrong, would make "per-node" groups span nodes.
    """
    sizes = sorted({size for _, size in ranks})
    by_node: dict[str, list[int]] = {}
    for rank, (node, _) in enumerate(ranks):
        by_node.setdefault(node, []).append(rank)
    layout = "; ".join(f"{node}: ranks {_spans(members)}" for node, members in by_node.items())
    if len(sizes) > 1:
        raise NodeLayoutError(
            f"group_size auto (one group per node) needs the same number of ranks on every node, "
            f"but ranks report {sizes} ranks on their node; the ranks run as {layout}"
        )
    per_node = sizes[0]
    expected = [list(range(start, start + per_node)) for start in range(0, len(ranks), per_node)]
    if sorted(by_node.values()) != expected:
        raise NodeLayoutError(
            f"group_size auto (one group per node, {per_node} ranks each by LOCAL_WORLD_SIZE or LOCAL_SIZE) needs "
            f"ranks numbered node after node, node n holding ranks n*{per_node}..n*{per_node}+{per_node - 1}, but "
            f"the {len(ranks)} ranks run as {layout}; launch them node-major or set method.loss.group_size to a "
            f"number or world"
        )
    return layout


def _spans(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5': a node's ranks in a line that stays short on large jobs."""
    runs = [[rank for _, rank in run] for _, run in itertools.groupby(enumerate(ranks), lambda pair: pair[1] - pair[0])]
    return ",".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)


def rows_per_rank(rows: int, group: dist.ProcessGroup | None = None) -> tuple[int, ...]:
    """Every rank's row count, in group rank order, when this rank holds `rows` (see `Collectives.uneven_rows`)."""
    size = get_world_size(group)
    if not collectives().uneven_rows or size == 1:
        return (rows,) * size
    mine = torch.tensor([rows], dtype=torch.int64, device=_comm_device())
    every = torch.empty(size, dtype=torch.int64, device=mine.device)
    dist.all_gather_into_tensor(every, mine, group=group)
    return tuple(every.tolist())


class GatheredRows(NamedTuple):
    """Every rank's rows in rank order, and this rank's place among them."""

    rows: torch.Tensor
    counts: tuple[int, ...]  # rows per rank
    rank: int

    @property
    def offset(self) -> int:
        """Where this rank's own rows start in `rows`."""
        return sum(self.counts[: self.rank])


def gather_rows_with_grad(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> GatheredRows:
    """Concatenate `tensor` over the group, rank order, keeping gradient; with the ranks' row counts.

    The gradient reaching each rank's input is the sum over ranks of the gradient of their
    output w.r.t. that rank's rows, as if the whole gathered batch were one graph.
    """
    counts = rows_per_rank(tensor.shape[0], group)
    if not is_initialized() or len(counts) == 1:
        return GatheredRows(tensor, counts, 0)
    return GatheredRows(_GatherWithGrad.apply(tensor, group, counts), counts, dist.get_rank(group))


def all_gather_with_grad(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """`gather_rows_with_grad`'s rows alone."""
    return gather_rows_with_grad(tensor, group).rows


def _comm_device() -> torch.device:
    """NCCL only moves CUDA tensors; gloo moves CPU ones."""
    if is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum(values: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    if not is_initialized() or dist.get_world_size(group) == 1:
        return values
    reduced = values.detach().to(_comm_device(), copy=True)
    dist.all_reduce(reduced, op=dist.ReduceOp.SUM, group=group)
    return reduced.to(values.device)


def all_reduce_mean(values: torch.Tensor) -> torch.Tensor:
    return all_reduce_sum(values) / get_world_size()


def all_gather_floats(values: list[float]) -> list[list[float]]:
    """Each rank's list of floats (same length everywhere), for per-rank logging."""
    if not is_initialized() or dist.get_world_size() == 1:
        return [[float(v) for v in values]]  # nothing to gather: no round trip through the device
    local = torch.tensor(values, dtype=torch.float64, device=_comm_device())
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


Picklable = TypeVar("Picklable")


def broadcast_object(value: Picklable, source: int = 0) -> Picklable:
    """Rank `source`'s picklable `value` on every rank."""
    if not is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=source)
    return box[0]


def broadcast_tensor(tensor: torch.Tensor, source: int = 0) -> torch.Tensor:
    """Rank `source`'s `tensor` on every rank (same shape and dtype everywhere), on `tensor`'s device."""
    if not is_initialized() or dist.get_world_size() == 1:
        return tensor
    moved = tensor.to(_comm_device())
    dist.broadcast(moved, src=source)
    return moved.to(tensor.device)
