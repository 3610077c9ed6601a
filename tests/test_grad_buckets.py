"""The engine's ZeRO-0 gradient all-reduce (mmpt/engine/grad_buckets.py) on 2 gloo ranks: after a step of
two accumulated micro-batches every gradient is the average over the ranks of the summed micro-batch
gradients, computed here by hand; with one bucket, with small buckets, and with a parameter that gets no
gradient."""

import torch
from torch import nn

from conftest import run_on_gloo_ranks


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 2))
        self.unused = nn.Linear(3, 3)  # no gradient in any step: its bucket must still be reduced (to zeros)

    def forward(self, x):
        return self.layers(x).square().mean()


def batches(rank: int, step: int) -> list[torch.Tensor]:
    return [torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + 10 * rank + i)) for i in range(2)]


def expected_gradients(model: nn.Module, step: int) -> dict[str, torch.Tensor]:
    """Average over both ranks of each rank's gradient summed over its two micro-batches, computed on one
    process from every rank's batches."""
    grads = {}
    for rank in range(2):
        for x in batches(rank, step):
            parts = torch.autograd.grad(model(x), list(model.layers.parameters()))
            for (name, _), g in zip(model.layers.named_parameters(), parts):
                grads[name] = grads.get(name, 0) + g / 2
    return grads


def check_bucketed_all_reduce(rank, bucket_bytes):
    from mmpt.engine import grad_buckets

    torch.manual_seed(0)
    model = Model()
    reduction = grad_buckets.BucketedAllReduce(model.parameters(), bucket_bytes=bucket_bytes)
    assert len(reduction.buckets) == (3 if bucket_bytes < 1024 else 1), len(reduction.buckets)
    for step in range(2):
        reduction.start_step()
        for index, x in enumerate(batches(rank, step)):
            reduction.reduce_during_backward(index == 1)
            model(x).backward()
        found_inf = reduction.finish()
        assert found_inf.item() == 0.0
        expected = expected_gradients(model, step)
        for name, param in model.layers.named_parameters():
            torch.testing.assert_close(param.grad, expected[name], rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}")
        assert all(not p.grad.any() for p in model.unused.parameters())
        with torch.no_grad():  # an optimizer step, then the gradients dropped as DeepSpeed's zero_grad does
            for param in model.parameters():
                param -= 0.1 * param.grad
                param.grad = None


def check_non_finite_gradient_is_flagged(rank):
    from mmpt.engine import grad_buckets

    model = Model()
    reduction = grad_buckets.BucketedAllReduce(model.parameters(), bucket_bytes=100)
    reduction.start_step()
    reduction.reduce_during_backward(True)
    (model(batches(rank, 0)[0]) * (float("inf") if rank == 1 else 1.0)).backward()
    assert reduction.finish().item() == 1.0  # every rank learns it: the all-reduce spread the inf


def test_bucketed_all_reduce_averages_accumulated_gradients():
    run_on_gloo_ranks(
        __name__,
        [("check_bucketed_all_reduce", (size,)) for size in (25 * 2**20, 100)]
        + [("check_non_finite_gradient_is_flagged", ())],
        2,
    )
