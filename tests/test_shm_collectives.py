"""DeepSpeed's collectives routed through the shared-memory kernel (mmpt/engine/shm_collectives.py), on 2 gloo
ranks that count as one host: sums and gathers equal what is computed here from every rank's inputs, calls
the kernel cannot serve still reach gloo, and ZeRO-2 training through the routed path takes the same steps as
plain AdamW on one process over both ranks' batches."""

import os

import torch
from torch import nn

from conftest import run_on_gloo_ranks


def rank_tensor(rank: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(1000 + rank))


def start(rank: int):
    """A 2-rank DeepSpeed process group with the kernel's buffers, routed; returns a list that counts the
    kernel's calls."""
    import deepspeed

    from mmpt.engine import shm_collectives

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_SIZE="2")
    deepspeed.init_distributed(dist_backend="gloo")
    # the kernel spins while it waits: only with a core for every thread of every rank
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    assert not shm_collectives.available()
    torch.set_num_threads(1)
    assert shm_collectives.available() == (len(os.sched_getaffinity(0)) >= 2)
    calls = []
    kernel = shm_collectives.all_reduce_sum_

    def counted(tensor):
        calls.append(tensor.numel())
        return kernel(tensor)

    shm_collectives.all_reduce_sum_ = counted
    shm_collectives.route_deepspeed_collectives()
    shm_collectives.route_deepspeed_collectives()  # a second call must not wrap twice
    return calls


def check_sums_and_gathers(rank):
    import deepspeed.comm as dcomm
    import torch.distributed as dist

    calls = start(rank)
    numel = 3 * 2**20 + 7  # above the kernel's 1 MB small-message path and not a multiple of its vector width
    summed = rank_tensor(rank, numel)
    dcomm.all_reduce(summed)
    torch.testing.assert_close(summed, rank_tensor(0, numel) + rank_tensor(1, numel), rtol=0, atol=0)
    assert calls == [numel], calls

    whole = torch.cat([rank_tensor(0, 1001), rank_tensor(1, 1001)])
    into = torch.full((2002,), float("nan"))
    dcomm.all_gather_into_tensor(into, rank_tensor(rank, 1001))  # a piece of its own
    assert torch.equal(into, whole)
    into = torch.full((2002,), float("nan"))
    own = into[rank * 1001 : (rank + 1) * 1001]
    own.copy_(rank_tensor(rank, 1001))
    dcomm.all_gather_into_tensor(into, own)  # the piece is this rank's slot, as ZeRO 1-2 call it
    assert torch.equal(into, whole)
    assert len(calls) == 3, calls

    # what the kernel does not do goes to gloo, and is still right
    largest = rank_tensor(rank, 100)
    dcomm.all_reduce(largest, op=dcomm.ReduceOp.MAX)
    assert torch.equal(largest, torch.maximum(rank_tensor(0, 100), rank_tensor(1, 100)))
    integers = torch.arange(10) * (rank + 1)
    dcomm.all_reduce(integers)
    assert torch.equal(integers, torch.arange(10) * 3)
    pending = rank_tensor(rank, 100)
    dcomm.all_reduce(pending, async_op=True).wait()
    torch.testing.assert_close(pending, rank_tensor(0, 100) + rank_tensor(1, 100), rtol=0, atol=0)
    strided = rank_tensor(rank, 200).view(10, 20).t()
    dcomm.all_reduce(strided)
    expected = (rank_tensor(0, 200) + rank_tensor(1, 200)).view(10, 20).t()
    torch.testing.assert_close(strided, expected, rtol=0, atol=0)
    assert len(calls) == 3, calls
    assert dist.get_backend() == "gloo"


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))

    def forward(self, x):
        return self.layers(x).square().mean()


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(10 * step + rank))


def check_zero2_steps(rank):
    import deepspeed

    from mmpt.config import TrainConfig
    from mmpt.engine.deepspeed_config import zero_optimization

    calls = start(rank)
    torch.manual_seed(0)
    model, reference = Model(), Model()
    reference.load_state_dict(model.state_dict())
    adamw = {"lr": 1e-2, "betas": (0.9, 0.98), "eps": 1e-6, "weight_decay": 0.1}
    zero = zero_optimization(
        TrainConfig(max_steps=3, grad_clip=0.0, zero_stage=2, reduce_bucket_size=2000), use_cuda=False, world_size=2
    )
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=torch.optim.AdamW(model.parameters(), **adamw),
        config={
            "train_micro_batch_size_per_gpu": 8,
            "gradient_accumulation_steps": 1,
            "train_batch_size": 16,
            "gradient_clipping": 0.0,
            "zero_optimization": zero,
            "steps_per_print": 2**62,
        },
    )
    plain = torch.optim.AdamW(reference.parameters(), **adamw)
    for step in range(3):
        calls.clear()
        engine.backward(engine(batch(rank, step)))
        engine.step()
        assert sum(calls) >= 2 * sum(p.numel() for p in model.parameters()), calls  # buckets and the gather
        plain.zero_grad()
        (reference(batch(0, step)) / 2 + reference(batch(1, step)) / 2).backward()
        plain.step()
        for (name, trained), expected in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(
                trained, expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"step {step} {name}: {m}"
            )


def test_routed_collectives_match_gloo_results():
    run_on_gloo_ranks(__name__, [("check_sums_and_gathers", ()), ("check_zero2_steps", ())], 2)
