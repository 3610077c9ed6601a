import json
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


def make_checkpoint(root, step, complete=True, world_size=2):
    folder = root / f"step_{step:09d}"
    folder.mkdir(parents=True)
    for rank in range(world_size if complete else 1):
        (folder / f"rank_{rank}.pt").write_bytes(b"")
    if complete:
        (folder / "complete.json").write_text(json.dumps({"step": step, "world_size": world_size}))
    return folder


def test_pruning_keeps_the_newest_and_never_later_checkpoints(tmp_path):
    from mmpt.engine.checkpoint import _prune

    root = tmp_path / "checkpoints"
    for step in (1, 2, 3, 4, 9):
        make_checkpoint(root, step)
    _prune(root, step=4, keep_last=2)
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["step_000000003", "step_000000004", "step_000000009"]


def test_resume_picks_the_newest_complete_checkpoint(tmp_path, caplog):
    from mmpt.engine.checkpoint import find_resume

    root = tmp_path / "checkpoints"
    make_checkpoint(root, 4)
    make_checkpoint(root, 8)
    make_checkpoint(root, 12, complete=False)  # killed while saving
    (root / "latest").write_text("step_000000008")
    assert find_resume(tmp_path, "auto") == root / "step_000000008"
    assert "step_000000012" in caplog.text
    (root / "latest").write_text("step_000000012")  # a pointer to an incomplete one is not trusted
    assert find_resume(tmp_path, "auto") == root / "step_000000008"
    (root / "step_000000008" / "rank_1.pt").unlink()  # a rank's part missing: incomplete too
    assert find_resume(tmp_path, "auto") == root / "step_000000004"
    assert find_resume(tmp_path, "none") is None
    from mmpt.config import ConfigError

    with pytest.raises(ConfigError, match="not a complete checkpoint"):  # a one-line config stop, exit 2
        find_resume(tmp_path, str(root / "step_000000012"))
