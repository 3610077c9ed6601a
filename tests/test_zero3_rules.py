"""The engine's rules for method code under ZeRO-3 and pooled accumulation, each shown failing when broken."""

import copy
import os
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch
from torch import nn

from conftest import run_on_gloo_ranks, zero3_engine
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


def check_guard_names_a_parameter_used_while_partitioned(rank):
    import deepspeed

    from mmpt.engine.zero3.guard import PartitionedParameterError, partitioned_parameter_guard

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    model = ReadsItsWeightAsATensor()
    engine = zero3_engine(model, torch.optim.AdamW(model.parameters(), lr=0.1), micro_batch=2)
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


def test_pool_pass_leaves_batch_norm_running_statistics_to_the_gradient_pass():
    """Pooled accumulation runs each micro-batch twice; batch norm's running statistics count it once, as they
    would without pooling, and both passes normalise with the batch's own statistics (the same features)."""
    from mmpt.engine.run import TrainingModule

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, momentum=0.3)).train()
    reference = copy.deepcopy(model)
    batches = [torch.randn(5, 4) for _ in range(3)]
    needs = EngineNeeds(pool_features=lambda m, batch: m(batch), step_pool=lambda loss, features: features)
    method = SimpleNamespace(training_step=lambda m, loss, batch, pool, index: (m(batch), pool[index]))
    module = TrainingModule(cast(Any, method), model, nn.Identity(), needs)
    with torch.no_grad():
        pool = module(batches, entry="pool")
    for index, batch in enumerate(batches):
        fresh, pooled = module(batch, pool, index)
        torch.testing.assert_close(fresh, pooled, rtol=0, atol=0)
        reference(batch)
    for name, buffer in reference[1].named_buffers():
        torch.testing.assert_close(getattr(model[1], name), buffer, rtol=0, atol=0, msg=name)
    assert model[1].momentum == 0.3


def test_pooled_accumulation_replays_random_draws_in_the_gradient_pass():
    """Dropout and patch dropout draw the same masks in a micro-batch's pool pass and its gradient pass, so
    the features the pool holds are the ones the gradient flows through; without the replay they differ."""
    from losses.grouped_itc import GroupedContrastiveLoss
    from mmpt.engine.run import TrainingModule
    from mmpt.models.m2_encoder import PRESETS, M2Encoder, M2EncoderConfig

    torch.manual_seed(0)
    arch = {**PRESETS["m2-encoder-demo"], "vocab_size": 50, "patch_dropout": 0.5}
    model = M2Encoder(M2EncoderConfig(**arch)).train()
    model.itc_vl_text_proj.fc = nn.Sequential(nn.Dropout(0.3), model.itc_vl_text_proj.fc)  # drawn after images
    method = get_method("m2_encoder")
    module = TrainingModule(method, model, GroupedContrastiveLoss(), method.engine_needs(model, cast(Any, None)))
    size = arch["image_size"]
    batches = [
        {
            "image": torch.randint(0, 256, (3, 3, size, size), dtype=torch.uint8),
            "input_ids": torch.randint(1, 50, (3, 6)),
            "attention_mask": torch.ones(3, 6, dtype=torch.long),
        }
        for _ in range(3)
    ]
    features: list[torch.Tensor] = []  # image then text features of each micro-batch, in call order
    for head in (model.itc_vl_image_proj, model.itc_vl_text_proj):
        head.register_forward_hook(lambda m, args, out: features.append(out.detach().clone()))
    with torch.no_grad():
        pool = module(batches, entry="pool")
    pooled, features[:] = list(features), []
    for index, batch in enumerate(batches):
        module(batch, pool, index)
    assert len(features) == len(pooled) == 6
    for index, (first, second) in enumerate(zip(pooled, features, strict=True)):
        torch.testing.assert_close(second, first, rtol=0, atol=0, msg=f"micro-batch {index // 2}")
    features.clear()
    method.training_step(model, module.loss, batches[0], pool, 0)  # no replay: the draws go on, other masks
    for tower, (first, second) in enumerate(zip(pooled[:2], features, strict=True)):
        assert not torch.equal(first, second), f"the control drew the same masks (tower {tower}): the test cannot tell"
