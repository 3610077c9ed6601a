"""Sum and gather through DeepSpeed's shared-memory kernel when every rank is a CPU process on one host.

gloo moves tensors over loopback TCP: on 2 ranks it all-reduces 90 MB in 93 ms, where the shared-memory
kernel DeepSpeed builds for CPU ranks (`torch.ops.deepspeed.inference_all_reduce_`) takes 19 ms. The
kernel only sums, in place, over every rank of the run, in rank order on every rank (so all ranks get the
same bits). A gather is a sum in which each rank brings its own piece and zeros everywhere else: x + 0 is
x exactly (only a negative zero comes back positive), so the result is what a gather returns.

DeepSpeed's kernel works only when the launcher counts every rank on this host (LOCAL_SIZE, which mmpt
copies from torchrun's LOCAL_WORLD_SIZE, equals the ranks): that is when `deepspeed.init_distributed` maps
the shared buffers. Runs on GPUs or on several hosts use the process group as before.

The kernel waits for its peers by spinning, so it pays only when every rank has cores of its own: ranks
times intra-op threads at most the cores this process may use (torchrun's default of one thread per rank,
or OMP_NUM_THREADS set so). With more threads than cores a spinning rank takes the core the rank it waits
for needs: measured on 2 cores, 2 ranks of 2 threads ran a ZeRO-3 test in 112 s through the kernel against
71 s through gloo (and 32 s with one thread per rank either way). Oversubscribed runs keep gloo.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

# vector_kernel_level the kernel's build reports: fp32 needs AVX2 (1), bf16/fp16 AVX-512 BW (2)
_KERNEL_LEVEL = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 2}


def available() -> bool:
    """Whether the kernel serves this run: gloo, every rank on this host as its launcher counts them, a core
    for every thread of every rank, and the kernel built for this CPU."""
    return _kernel_level() >= 1


def _kernel_level() -> int:
    import deepspeed.comm

    if not dist.is_initialized() or dist.get_backend() != "gloo" or dist.get_world_size() == 1:
        return 0
    if os.environ.get("LOCAL_SIZE") != str(dist.get_world_size()):
        return 0
    if dist.get_world_size() * torch.get_num_threads() > len(os.sched_getaffinity(0)):
        return 0
    backend = deepspeed.comm.comm.cdb
    if getattr(backend, "shm_comm_op", None) is None or not hasattr(torch.ops, "deepspeed"):
        return 0
    if not hasattr(torch.ops.deepspeed, "inference_all_reduce_"):
        return 0
    return getattr(backend, "shm_vector_kernel_level", 0)


def all_reduce_sum_(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` (contiguous, on CPU) over every rank, in place."""
    return torch.ops.deepspeed.inference_all_reduce_(tensor)


def all_gather_into_(output: torch.Tensor, piece: torch.Tensor, rank: int, world: int) -> None:
    """`output` (contiguous) becomes every rank's `piece` in rank order; `piece` may be this rank's slot of it."""
    flat = output.view(-1)
    size = piece.numel()
    if flat.numel() != size * world:
        raise ValueError(f"gather of {world} pieces of {size} elements into a tensor of {flat.numel()}")
    mine = flat[rank * size : (rank + 1) * size]
    if mine.data_ptr() != piece.data_ptr():
        mine.copy_(piece.reshape(-1))
    flat[: rank * size].zero_()
    flat[(rank + 1) * size :].zero_()
    all_reduce_sum_(flat)


def route_deepspeed_collectives() -> bool:
    """Send DeepSpeed's synchronous all-reduces (sums) and all-gathers over every rank through the kernel.

    ZeRO 1-2 reduce gradient buckets with `deepspeed.comm.all_reduce` and, after each step, gather the
    updated parameter partitions with `all_gather_into_tensor`; both go through DeepSpeed's torch backend
    (`deepspeed.comm.comm.cdb`) to gloo. Calls the kernel serves exactly as asked (blocking, a sum, every
    rank, a contiguous CPU tensor of a dtype the kernel was built for) go to it; every other call goes on to
    the process group unchanged. Once per process; a no-op where `available()` is false. Returns whether
    DeepSpeed's collectives go through the kernel.
    """
    import deepspeed.comm

    backend = deepspeed.comm.comm.cdb
    level = _kernel_level()
    if level < 1 or getattr(backend, "_mmpt_shm_routed", False):
        return level >= 1
    world = dist.get_world_size()
    plain_all_reduce, plain_all_gather = backend.all_reduce, backend.all_gather_into_tensor

    def servable(tensor: torch.Tensor, group, async_op: bool) -> bool:
        return (
            not async_op
            and tensor.device.type == "cpu"
            and tensor.is_contiguous()
            and tensor.numel() > 0
            and _KERNEL_LEVEL.get(tensor.dtype, 99) <= level
            and (group is None or dist.get_world_size(group) == world)
        )

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if backend._reduce_op(op) == dist.ReduceOp.SUM and servable(tensor, group, async_op):
            return all_reduce_sum_(tensor)
        return plain_all_reduce(tensor, op=op, group=group, async_op=async_op)

    def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
        if servable(output_tensor, group, async_op) and input_tensor.dtype == output_tensor.dtype:
            return all_gather_into_(output_tensor, input_tensor, dist.get_rank(group), world)
        return plain_all_gather(output_tensor=output_tensor, input_tensor=input_tensor, group=group, async_op=async_op)

    # DeepSpeed's backend object is patched in place: its collectives are looked up on it at every call
    backend.all_reduce = all_reduce  # pyright: ignore[reportAttributeAccessIssue]
    backend.all_gather_into_tensor = all_gather_into_tensor
    backend._mmpt_shm_routed = True  # pyright: ignore[reportAttributeAccessIssue]
    return True
