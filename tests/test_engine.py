import math

import pytest
import torch
from torch import nn

from conftest import tiny_config, write_config
from mmpt.config import ConfigError, load_config
from mmpt.engine.deepspeed_config import deepspeed_config
from mmpt.engine.optim import param_groups, warmup_cosine
from mmpt.engine.trainer import to_device


def test_warmup_then_cosine_to_floor():
    factor = warmup_cosine(warmup_steps=4, total_steps=14, min_ratio=0.1)
    assert [factor(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert factor(9) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert factor(14) == pytest.approx(0.1) and factor(100) == pytest.approx(0.1)


def test_weight_decay_groups():
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))
    model.logit_scale = nn.Parameter(torch.ones(1))
    model.pos_embed = nn.Parameter(torch.zeros(5, 4))
    decay, plain = param_groups(model, 0.1, ["pos_embed", "logit_scale"])
    assert decay["weight_decay"] == 0.1 and [tuple(p.shape) for p in decay["params"]] == [(4, 3)]
    assert plain["weight_decay"] == 0.0 and len(plain["params"]) == 5


def test_deepspeed_config_is_explicit(tmp_path, digits_root):
    cfg_dict = tiny_config(digits_root, tmp_path / "run", train={"grad_clip": 0.0, "grad_accum": 3, "zero_stage": 3,
                                                                  "offload_optimizer": True, "precision": "bf16"})
    cfg = load_config(write_config(tmp_path / "c.yaml", cfg_dict))
    ds = deepspeed_config(cfg, world_size=2)
    assert ds["gradient_clipping"] == 0.0  # not DeepSpeed's default of 1.0
    assert ds["train_batch_size"] == 16 * 3 * 2 and ds["gradient_accumulation_steps"] == 3
    assert ds["zero_optimization"]["stage"] == 3 and ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds["bf16"]["enabled"] and not ds["fp16"]["enabled"]


def test_offload_needs_a_zero_stage(tmp_path, digits_root):
    cfg = load_config(write_config(tmp_path / "c.yaml", tiny_config(
        digits_root, tmp_path / "run", train={"zero_stage": 0, "offload_optimizer": True})))
    with pytest.raises(ConfigError, match="offload_optimizer"):
        deepspeed_config(cfg, world_size=1)


def test_batches_move_with_training_precision():
    batch = {"image": torch.zeros(2, 3), "ids": torch.ones(2, dtype=torch.long), "meta": ["a", "b"]}
    moved = to_device(batch, torch.device("cpu"), torch.bfloat16)
    assert moved["image"].dtype == torch.bfloat16 and moved["ids"].dtype == torch.long and moved["meta"] == ["a", "b"]


def test_pruning_keeps_the_newest_and_never_later_checkpoints(tmp_path):
    from mmpt.engine.checkpoint import _prune, find_resume

    root = tmp_path / "checkpoints"
    for step in (1, 2, 3, 4, 9):
        (root / f"step_{step:09d}").mkdir(parents=True)
    (root / "latest").write_text("step_000000004")
    _prune(root, step=4, keep_last=2)
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["step_000000003", "step_000000004", "step_000000009"]
    assert find_resume(tmp_path, "auto") == root / "step_000000004"
    assert find_resume(tmp_path, "none") is None
