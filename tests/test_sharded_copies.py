"""Momentum copies partitioned like ZeRO-3's parameters (mmpt/engine/zero3/copies.py), on 2 gloo ranks,
against a whole copy kept by hand: the forward, the EMA step, per-rank memory and re-cutting saved partitions."""

import os

import torch
from torch import nn

from conftest import run_on_gloo_ranks, zero3_engine

MOMENTUM = 0.75


class Towers(nn.Module):
    """Parameters with odd element counts (ZeRO pads the last rank's partition), one read directly by the module
    owning it, and batch-norm statistics (buffers ZeRO does not partition)."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(5, 7)
        self.offset = nn.Parameter(torch.randn(7))
        self.norm = nn.BatchNorm1d(7)
        self.last = nn.Sequential(nn.GELU(), nn.Linear(7, 3), nn.LayerNorm(3))

    def forward(self, x):
        return self.last(self.norm(self.first(x) + self.offset))


class WithKey(nn.Module):
    def __init__(self):
        super().__init__()
        from mmpt.models.momentum import MomentumCopy

        self.towers = Towers()
        self.key = MomentumCopy(self.towers, MOMENTUM)

    def forward(self, x):
        return self.towers(x).square().mean()


def whole_key(model) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.key.network.state_dict().items()}


def check_sharded_copy_matches_a_whole_one(rank):
    import deepspeed

    from mmpt.engine.checkpoint.parts import whole_from_partitions
    from mmpt.engine.zero3.copies import ShardedCopies, momentum_bytes

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")
    torch.manual_seed(0)
    model = WithKey()
    reference = whole_key(model)
    sgd = torch.optim.SGD(model.parameters(), lr=0.5)
    engine = zero3_engine(model, sgd, micro_batch=4, zero_allow_untested_optimizer=True)
    whole_bytes = momentum_bytes([model.key])
    sharded = ShardedCopies([model.key])
    assert momentum_bytes([model.key]) < 0.7 * whole_bytes  # about half, plus the whole batch-norm statistics
    names = dict(model.state_dict(keep_vars=True))
    partitioned = {name[len("key.network.") :] for name, t in names.items() if sharded.is_partition(t)}
    assert partitioned == {
        "first.weight",
        "first.bias",
        "offset",
        "norm.weight",
        "norm.bias",
        "last.1.weight",
        "last.1.bias",
        "last.2.weight",
        "last.2.bias",
    }
    assert tuple(model.key.network.first.weight.shape) == (-(-35 // 2),)  # 35 elements: 18 per rank, 1 padding

    # The forward gathers each module's tensors: the same output as the whole copy, partitions back afterwards.
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(rank))
    expected = torch.func.functional_call(Towers(), reference, (x,))
    torch.testing.assert_close(model.key(x), expected, rtol=0, atol=0)
    assert tuple(model.key.network.first.weight.shape) == (18,)
    reference = whole_key(model)  # the forward in training mode moved the batch-norm statistics
    reference = {k: v for k, v in reference.items() if not sharded.is_partition(getattr_path(model.key.network, k))}
    reference.update({k[len("key.network.") :]: sharded.full(t) for k, t in names.items() if sharded.is_partition(t)})

    # One optimizer step, then the EMA step from this rank's partition only, against the EMA of the whole tensors.
    engine.backward(engine(x))
    engine.step()
    with deepspeed.zero.GatheredParameters(list(model.towers.parameters())):
        query = {k: v.detach().clone() for k, v in model.towers.state_dict().items()}
    sharded.update()
    for name, value in reference.items():
        ema = MOMENTUM * value + (1 - MOMENTUM) * query[name] if value.is_floating_point() else query[name]
        tensor = getattr_path(model.key.network, name)
        got = sharded.full(tensor) if sharded.is_partition(tensor) else tensor
        torch.testing.assert_close(got, ema, rtol=0, atol=1e-7, msg=lambda m: f"{name}: {m}")

    # Partitions saved by 3 ranks (ZeRO's layout: ceil(numel / 3) elements each, zero-padded) are rebuilt whole and
    # cut for 2; so are tensors saved whole (by a run without ZeRO-3).
    wanted = {
        name: torch.randn(t.shape, generator=torch.Generator().manual_seed(7))
        for name, t in reference.items()
        if name in partitioned
    }
    saved = [{} for _ in range(3)]
    for name, value in wanted.items():
        size = -(-value.numel() // 3)
        padded = torch.cat([value.flatten(), torch.zeros(3 * size - value.numel())])
        for r in range(3):
            saved[r][f"key.network.{name}"] = padded[size * r : size * (r + 1)]
    for states, offset in ((saved, 0.0), ([{k: v + 1 for k, v in wanted.items()}], 1.0)):
        if offset:
            states = [{f"key.network.{k}": v for k, v in states[0].items()}]
        sharded.load_whole(
            model,
            {
                f"key.network.{name}": whole_from_partitions(
                    name, [state[f"key.network.{name}"] for state in states], value.shape
                )
                for name, value in wanted.items()
            },
        )
        for name, value in wanted.items():
            got = sharded.full(getattr_path(model.key.network, name))
            torch.testing.assert_close(got, value + offset, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


def getattr_path(module: nn.Module, name: str) -> torch.Tensor:
    path, _, attr = name.rpartition(".")
    return getattr(module.get_submodule(path), attr)


def test_sharded_momentum_copy_matches_a_whole_one():
    run_on_gloo_ranks(__name__, [("check_sharded_copy_matches_a_whole_one", ())], 2)
