"""The engine's rules for method code under ZeRO-3 and pooled accumulation, each shown failing when broken."""

import os
from types import SimpleNamespace

import pytest
import torch
from timm.layers.patch_dropout import PatchDropout
from torch import nn

from conftest import run_on_gloo_ranks
from mmpt.config import ConfigError
from mmpt.engine.run import check_pooled_accumulation
from mmpt.methods import get_method
from mmpt.methods.base import EngineNeeds


class ReadsItsWeightAsATensor(nn.Module):
    """Adds a parameter read outside any submodule call, as M2's position table once was."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.table = nn.Embedding(6, 4)

    def forward(self, x):
        return self.linear(x) + self.table.weight[: x.shape[0]]


def zero3_engine(model):
    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3},
        "gradient_clipping": 0.0,
        "steps_per_print": 2**62,
    }
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.1), config=config
    )
    return engine


def check_guard_names_a_parameter_used_while_partitioned(rank):
    import deepspeed

    from mmpt.engine.zero3_guard import PartitionedParameterError, partitioned_parameter_guard

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    engine = zero3_engine(ReadsItsWeightAsATensor())
    x = torch.randn(3, 4)
    with partitioned_parameter_guard(engine.module, "step 1"):
        engine.backward(engine(x).sum())  # inside the engine's forward ZeRO-3 gathers even a bare read
        engine.step()
        with deepspeed.zero.GatheredParameters([engine.module.table.weight]):
            torch.testing.assert_close(engine.module.table.weight.sum(), engine.module.table.weight.sum())
        with pytest.raises(PartitionedParameterError, match=r"parameter 'table.weight' \(shape \(6, 4\)\).* step 1"):
            engine.module.table.weight[:3] + x  # outside: a 0-element placeholder
    # Without the guard the same read fails far from its cause, as it did in M2's pool pass.
    with pytest.raises(RuntimeError, match="size of tensor"):
        engine.module.table.weight[:3] + x


def test_zero3_guard_names_a_parameter_used_while_partitioned():
    run_on_gloo_ranks(__name__, [("check_guard_names_a_parameter_used_while_partitioned", ())], 1)


@pytest.fixture
def m2():
    from mmpt.models.m2_encoder import PRESETS, M2Encoder, M2EncoderConfig

    return get_method("m2_encoder"), M2Encoder(M2EncoderConfig(**{**PRESETS["m2-encoder-demo"], "vocab_size": 50}))


@pytest.mark.parametrize(
    "stochastic, reason",
    [
        (nn.Dropout(0.1), "dropout p=0.1"),
        (nn.BatchNorm1d(4), "batch norm in training mode"),
        (nn.MultiheadAttention(4, 1, dropout=0.2), "attention dropout 0.2"),
        (PatchDropout(0.5), "patch dropout 0.5"),
    ],
)
def test_pooled_accumulation_refuses_modules_whose_two_passes_differ(m2, stochastic, reason):
    method, model = m2
    check_pooled_accumulation(method, model.train(), grad_accum=4)  # the M2-Encoder itself is deterministic
    model.backbone_vl.layers[0].extra = stochastic
    with pytest.raises(ConfigError, match=f"'backbone_vl.layers.0.extra' has {reason}: .*train.grad_accum=1"):
        check_pooled_accumulation(method, model.train(), grad_accum=4)
    check_pooled_accumulation(method, model.train(), grad_accum=1)  # no pool, nothing to differ
    averaging = SimpleNamespace(engine_needs=lambda model: EngineNeeds())  # a method that averages micro-batches
    check_pooled_accumulation(averaging, model.train(), grad_accum=4)  # is unaffected


def test_pooled_accumulation_accepts_inert_modules(m2):
    method, model = m2
    model.backbone_vl.layers[0].extra = nn.ModuleList([nn.Dropout(0.0), nn.BatchNorm1d(4).eval()])
    check_pooled_accumulation(method, model.eval(), grad_accum=2)
