"""ZeRO++ hierarchical partitioning (hpZ): `train.hpz_partition_size` reaches DeepSpeed validated, and
on 2 nodes x 2 ranks it moves backward's parameter gathers into each node while the training stays the
same as plain ZeRO-3's."""

import json
import logging

import pytest
from test_multinode import node_commands, node_env, run_nodes

from conftest import read_metrics, tiny_config, write_config
from mmpt.config import ConfigError
from mmpt.config_loader import load_config
from mmpt.engine.deepspeed_config import deepspeed_config

WORKER = "tests/hpz_train.py"


def config_dict(digits_root, run_dir, **train):
    return tiny_config(digits_root, run_dir, train={"zero_stage": 3, "max_steps": 2, "save_every": 0, **train})


def zero_section(digits_root, tmp_path, world_size, **train):
    cfg = load_config(write_config(tmp_path / "cfg.yaml", config_dict(digits_root, tmp_path / "run", **train)))
    return deepspeed_config(cfg, world_size)["zero_optimization"]


def test_hpz_settings_are_validated_before_deepspeed_sees_them(digits_root, tmp_path, monkeypatch, caplog):
    assert "zero_hpz_partition_size" not in zero_section(digits_root, tmp_path, 4)
    assert zero_section(digits_root, tmp_path, 4, hpz_partition_size=2)["zero_hpz_partition_size"] == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert zero_section(digits_root, tmp_path, 8, hpz_partition_size="node")["zero_hpz_partition_size"] == 4
    for world, size in ((4, 3), (2, 4)):  # DeepSpeed would fail late on the first and silently cut the second to 2
        with pytest.raises(ConfigError, match=f"'train.hpz_partition_size' = {size} .* must divide the {world} ranks"):
            zero_section(digits_root, tmp_path, world, hpz_partition_size=size)
    with pytest.raises(ConfigError, match="'train.hpz_partition_size' needs train.zero_stage = 3"):
        zero_section(digits_root, tmp_path, 4, hpz_partition_size=2, zero_stage=2)
    with pytest.raises(ConfigError, match="'train.hpz_partition_size' = 1: expected a number of ranks >= 2, or 'node'"):
        zero_section(digits_root, tmp_path, 4, hpz_partition_size=1)
    with caplog.at_level(logging.WARNING):
        zero_section(digits_root, tmp_path, 4, hpz_partition_size="node")
    assert "covers all 4 ranks" in caplog.text


@pytest.mark.distributed
def test_hpz_gathers_backward_inside_the_node_and_trains_as_zero3(module_tmp, digits_root):
    folder = module_tmp("hpz")
    runs = {}
    for name, train in (("zero3", {}), ("hpz", {"hpz_partition_size": "node"})):
        here = folder / name
        here.mkdir()
        config = write_config(here / "cfg.yaml", config_dict(digits_root, here / "run", **train))
        env = node_env(here / "records")
        run_nodes(node_commands("torchrun", 2, 2, here, [WORKER, "--config", str(config)]), env, here / "logs")
        gathers = [json.loads((here / f"records/rank{rank}.json").read_text()) for rank in range(4)]
        runs[name] = (
            [record["loss/total"] for record in read_metrics(here / "run") if "loss/total" in record],
            gathers,
        )
    (zero3_losses, zero3_gathers), (hpz_losses, hpz_gathers) = runs["zero3"], runs["hpz"]
    assert len(hpz_losses) == 2 and hpz_losses == pytest.approx(zero3_losses, abs=1e-6)
    for plain, hierarchical in zip(zero3_gathers, hpz_gathers):
        assert set(plain) == {"4"} and plain["4"] > 0  # plain ZeRO-3 gathers every parameter world-wide
        # hpZ gathers world-wide in forward (filling the node's secondary shards) and, where backward gathers
        # again (the first step here), inside the node
        assert hierarchical.get("2", 0) > 0 and hierarchical["4"] < plain["4"]
