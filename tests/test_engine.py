import json
import math

import pytest
import torch
from torch import nn

from conftest import REPO, small_clip_demo, tiny_config, train_in_process, write_config
from mmpt.config import ConfigError
from mmpt.config_loader import load_config
from mmpt.engine.deepspeed_config import deepspeed_config
from mmpt.engine.optim import SkippingAdamW, param_groups, warmup_cosine
from mmpt.engine.trainer import to_device


def test_warmup_then_cosine_to_floor():
    factor = warmup_cosine(warmup_steps=4, total_steps=14, min_ratio=0.1)
    assert [factor(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert factor(9) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert factor(14) == pytest.approx(0.1) and factor(100) == pytest.approx(0.1)


def test_schedule_steps_through_open_clip_and_transformers_rates():
    """Warmup and cosine as open_clip_train's `cosine_lr`; after warmup, with a floor, transformers' min-lr cosine."""
    from open_clip_train.scheduler import cosine_lr
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.5)
    open_clip_lr = cosine_lr(optimizer, 0.5, 7, 40)
    ours = warmup_cosine(7, 40)
    assert [0.5 * ours(s) for s in range(40)] == pytest.approx([open_clip_lr(s) for s in range(40)], rel=1e-12)

    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    theirs = get_cosine_with_min_lr_schedule_with_warmup(optimizer, 7, 40, min_lr_rate=0.2)
    rates = []
    for _ in range(40):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        theirs.step()
    ours = warmup_cosine(7, 40, min_ratio=0.2)
    assert [ours(s) for s in range(7, 40)] == pytest.approx(rates[7:], rel=1e-12)
    assert rates[0] == 0.0 and ours(0) == pytest.approx(1 / 7)  # the one difference: no step without learning


def test_skipping_adamw_skips_non_finite_steps_on_the_device():
    torch.manual_seed(0)
    weights = nn.Parameter(torch.randn(5))
    reference = torch.optim.AdamW([nn.Parameter(weights.detach().clone())], lr=0.1, fused=True)
    optimizer = SkippingAdamW([weights], lr=0.1, fused=True)
    for _step, bad in enumerate([False, True, False]):
        gradient = torch.randn(5)
        weights.grad = gradient.clone()
        if bad:
            weights.grad[2] = float("nan")
        before = weights.detach().clone()
        optimizer.step()
        assert float(optimizer.skipped) == float(bad)
        if bad:
            assert torch.equal(weights, before)
            continue
        reference.param_groups[0]["params"][0].grad = gradient
        reference.step()
        assert torch.equal(weights, reference.param_groups[0]["params"][0])  # moments and step count untouched too
    assert int(optimizer.state[weights]["step"]) == 2


def test_weight_decay_groups():
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))
    model.logit_scale = nn.Parameter(torch.ones(1))
    model.pos_embed = nn.Parameter(torch.zeros(5, 4))
    decay, plain = param_groups(model, 0.1, ["pos_embed", "logit_scale"])
    assert decay["weight_decay"] == 0.1 and [tuple(p.shape) for p in decay["params"]] == [(4, 3)]
    assert plain["weight_decay"] == 0.0 and len(plain["params"]) == 5


def test_per_part_rates_step_as_adamw_at_each_parts_rate_through_the_schedule():
    """`optim.lr_scales`: each parameter moves as torch's AdamW moves it alone at lr x its scale (weight decay by
    the usual rule), one step in fp32; the schedule multiplies every group's rate alike."""
    from mmpt.config import OptimConfig
    from mmpt.engine.optim import build_optimizer, warmup_cosine

    torch.manual_seed(0)
    model = nn.ModuleDict({"visual": nn.Linear(3, 4), "text": nn.Linear(4, 2)})
    scales = {"visual.*": 0.1, "text.bias": 3.0}
    cfg = OptimConfig(lr=1e-2, weight_decay=0.2, lr_scales=scales)
    expected = {"visual.weight": (1e-3, 0.2), "visual.bias": (1e-3, 0.0), "text.weight": (1e-2, 0.2)}
    expected["text.bias"] = (3e-2, 0.0)
    start = {name: p.detach().clone() for name, p in model.named_parameters()}
    grads = {name: torch.randn_like(p) for name, p in model.named_parameters()}
    optimizer = build_optimizer(model, cfg)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(2, 10))  # 0.5 at step 0
    for name, p in model.named_parameters():
        p.grad = grads[name].clone()
    optimizer.step()
    for name, p in model.named_parameters():
        lr, decay = expected[name]
        alone = nn.Parameter(start[name].clone())
        alone.grad = grads[name].clone()
        torch.optim.AdamW([alone], lr=0.5 * lr, weight_decay=decay, foreach=False).step()
        torch.testing.assert_close(p.detach(), alone.detach(), rtol=1e-6, atol=1e-7, msg=name)
    schedule.step()  # warmup: 1.0
    assert sorted(g["lr"] for g in optimizer.param_groups) == pytest.approx([1e-3, 1e-3, 1e-2, 3e-2])


def test_layer_decay_steps_each_group_as_adamw_at_its_decayed_rate():
    """`optim.layer_decay` 0.5: a tower's group k blocks below its last moves as AdamW alone at lr x 0.5^k (times its
    `lr_scales` scale); a parameter outside the towers at lr."""
    from mmpt.config import OptimConfig
    from mmpt.engine.optim import build_optimizer

    torch.manual_seed(0)
    model = nn.ModuleDict({f"layer{i}": nn.Linear(3, 3, bias=False) for i in range(5)})
    towers = {"image": [[model["layer0"].weight], [model["layer1"].weight], [model["layer2"].weight]]}
    towers["text"] = [[model["layer3"].weight], []]
    cfg = OptimConfig(lr=1e-2, weight_decay=0.0, layer_decay=0.5, lr_scales={"layer1.*": 3.0})
    rates = {"layer0": 1e-2 * 0.25, "layer1": 1e-2 * 0.5 * 3.0, "layer2": 1e-2, "layer3": 1e-2 * 0.5, "layer4": 1e-2}
    start = {name: p.detach().clone() for name, p in model.named_parameters()}
    grads = {name: torch.randn_like(p) for name, p in model.named_parameters()}
    optimizer = build_optimizer(model, cfg, towers=towers)
    for name, p in model.named_parameters():
        p.grad = grads[name].clone()
    optimizer.step()
    for name, p in model.named_parameters():
        alone = nn.Parameter(start[name].clone())
        alone.grad = grads[name].clone()
        torch.optim.AdamW([alone], lr=rates[name.split(".")[0]], weight_decay=0.0, foreach=False).step()
        torch.testing.assert_close(p.detach(), alone.detach(), rtol=1e-6, atol=1e-7, msg=name)


def test_layer_decay_follows_each_image_text_methods_towers(corpora, tmp_path):
    """On the transformers CLIP (2 blocks a tower): embeddings at decay^3, the blocks at decay^2 and decay, the final
    norm and projection at lr, the logit scale (no tower's) at lr."""
    from test_locking import tiny

    from mmpt.engine.optim import build_optimizer

    cfg, method, model = tiny("transformers", corpora, tmp_path, "optim.layer_decay=0.5", "optim.lr=1.0")
    optimizer = build_optimizer(model, cfg.optim, towers=method.tower_groups(model))
    rate = {id(p): g.get("lr", 1.0) for g in optimizer.param_groups for p in g["params"]}
    named = dict(model.named_parameters())
    for tower in ("vision_model", "text_model"):
        assert rate[id(named[f"hf.{tower}.embeddings.position_embedding.weight"])] == 0.125
        assert rate[id(named[f"hf.{tower}.encoder.layers.0.mlp.fc1.weight"])] == 0.25
        assert rate[id(named[f"hf.{tower}.encoder.layers.1.mlp.fc1.weight"])] == 0.5
    assert rate[id(named["hf.text_projection.weight"])] == rate[id(named["hf.logit_scale"])] == 1.0


def test_a_rate_pattern_matching_nothing_is_a_config_error():
    from mmpt.config import ConfigError, OptimConfig
    from mmpt.engine.optim import build_optimizer

    model = nn.ModuleDict({"visual": nn.Linear(3, 4)})
    with pytest.raises(ConfigError, match="config key 'optim.lr_scales': 'vision.\\*' matches no trainable"):
        build_optimizer(model, OptimConfig(lr=1e-3, lr_scales={"vision.*": 0.1}))


def test_deepspeed_config_is_explicit(tmp_path, digits_root):
    cfg_dict = tiny_config(
        digits_root,
        tmp_path / "run",
        train={"grad_clip": 0.0, "grad_accum": 3, "zero_stage": 3, "offload_optimizer": True, "precision": "bf16"},
    )
    cfg = load_config(write_config(tmp_path / "c.yaml", cfg_dict))
    ds = deepspeed_config(cfg, world_size=2)
    assert ds["gradient_clipping"] == 0.0  # not DeepSpeed's default of 1.0
    assert ds["train_batch_size"] == 16 * 3 * 2 and ds["gradient_accumulation_steps"] == 3
    assert ds["zero_optimization"]["stage"] == 3 and ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds["bf16"]["enabled"] and not ds["fp16"]["enabled"]


@pytest.mark.parametrize(
    "parameters, bucket, overlap",
    [(22_000_000, 50_000_000, False), (730_000_000, 182_500_000, True), (10_180_000_000, 200_000_000, True)],
)
def test_gpu_buckets_follow_the_model_so_that_reduction_can_overlap_backward(parameters, bucket, overlap):
    from mmpt.config import TrainConfig
    from mmpt.engine.deepspeed_config import zero_optimization

    train = TrainConfig(max_steps=10, grad_clip=1.0, zero_stage=2)
    zero = zero_optimization(train, use_cuda=True, world_size=8, parameters=parameters)
    assert (zero["reduce_bucket_size"], zero["overlap_comm"]) == (bucket, overlap)
    # Set in the config, either wins; CPU ranks keep DeepSpeed's defaults.
    chosen = train.model_copy(update={"reduce_bucket_size": 123, "overlap_comm": False})
    zero = zero_optimization(chosen, use_cuda=True, world_size=8, parameters=parameters)
    assert (zero["reduce_bucket_size"], zero["overlap_comm"]) == (123, False)
    assert zero_optimization(train, use_cuda=False, world_size=8, parameters=parameters) == {"stage": 2}
    # One rank has nothing to overlap.
    assert not zero_optimization(train, use_cuda=True, world_size=1, parameters=parameters)["overlap_comm"]


def test_offload_needs_a_zero_stage(tmp_path, digits_root):
    cfg = load_config(
        write_config(
            tmp_path / "c.yaml",
            tiny_config(digits_root, tmp_path / "run", train={"zero_stage": 0, "offload_optimizer": True}),
        )
    )
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
    from mmpt.engine.checkpoint.protocol import prune

    root = tmp_path / "checkpoints"
    for step in (1, 2, 3, 4, 9):
        make_checkpoint(root, step)
    prune(root, step=4, keep_last=2)
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == [
        "step_000000003",
        "step_000000004",
        "step_000000009",
    ]


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
    (root / "step_000000008" / "complete.json").write_text("{")  # a marker cut short: incomplete too
    assert find_resume(tmp_path, "auto") == root / "step_000000004"
    assert find_resume(tmp_path, "none") is None
    from mmpt.config import ConfigError

    with pytest.raises(ConfigError, match="not a complete checkpoint"):  # a one-line config stop, exit 2
        find_resume(tmp_path, str(root / "step_000000012"))


def test_streamed_weights_are_a_safetensors_file_of_the_full_state(tmp_path):
    from safetensors.torch import load_file

    from mmpt.engine.checkpoint import write_weights

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(7, 3), nn.Linear(3, 7), nn.BatchNorm1d(7))
    model[1].weight = model[0].weight  # tied: saved under both names
    model.scale = nn.Parameter(torch.tensor(2.5))  # 0-D
    model.register_buffer("nothing", torch.zeros(0, 4))
    path = tmp_path / "model.safetensors"
    write_weights(model, path)
    loaded = load_file(str(path))
    expected = model.state_dict()
    assert set(loaded) == set(expected)
    for name, value in expected.items():
        assert loaded[name].dtype == torch.float32 and torch.equal(loaded[name], value.float()), name
    assert path.stat().st_mode & 0o777 == 0o666 & ~_umask()


def _umask() -> int:
    import os

    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_a_step_pools_where_the_method_and_accumulation_ask_and_merges_where_the_towers_checkpoint():
    from types import SimpleNamespace
    from typing import Any, cast

    from mmpt.engine.pool_pass import step_pooling
    from mmpt.methods import EngineNeeds

    def pooling(choice: str, accum: int, needs: EngineNeeds, checkpointing: bool) -> str | None:
        cfg = SimpleNamespace(train=SimpleNamespace(pool_pass=choice, grad_accum=accum))
        return step_pooling(cast(Any, cfg), needs, cast(Any, SimpleNamespace(grad_checkpointing=checkpointing)))

    pool = dict(pool_features=lambda m, b: b, step_pool=lambda loss, f: f)
    mergeable, separate_only = EngineNeeds(**pool, merged_step=lambda m, loss, b: {}), EngineNeeds(**pool)
    assert pooling("auto", 4, mergeable, checkpointing=True) == "merged"
    assert pooling("auto", 4, mergeable, checkpointing=False) == "separate"
    assert pooling("merged", 4, mergeable, checkpointing=False) == "merged"
    assert pooling("separate", 4, mergeable, checkpointing=True) == "separate"
    assert pooling("auto", 4, separate_only, checkpointing=True) == "separate"
    assert pooling("auto", 1, mergeable, checkpointing=True) is None  # one micro-batch: nothing to pool
    assert pooling("auto", 4, EngineNeeds(), checkpointing=True) is None  # no step pool
    for needs, accum in ((EngineNeeds(), 4), (mergeable, 1), (separate_only, 4)):
        with pytest.raises(ConfigError, match="config key 'train.pool_pass'"):
            pooling("merged", accum, needs, checkpointing=True)


def test_the_run_summary_says_when_warmup_or_checkpoints_outlast_the_run():
    """A demo shrunk by overrides keeps its 30 warmup steps: over 3 steps the learning rate never reaches its value."""
    from mmpt.config_loader import load_config
    from mmpt.engine.summary import checkpoint_line, learning_rate_line

    short = load_config(REPO / "configs/victor/demo.yaml", ["train.max_steps=3"])
    assert learning_rate_line(short).endswith(", never reached: optim.warmup_steps 30 > train.max_steps 3")
    assert "never reached" not in learning_rate_line(load_config(REPO / "configs/victor/demo.yaml"))
    assert checkpoint_line(short) == "checkpoints at the end (keep 2)"  # save_every 100 on a 3-step run
    assert checkpoint_line(load_config(REPO / "configs/victor/demo.yaml")).startswith("checkpoints every 100 steps and")


def test_resuming_with_a_config_that_builds_another_model_is_one_line(tmp_path, digits_root, process_group_of_one):
    """A finished step's checkpoint and a config changed since (a wider text tower): a config error naming the
    checkpoint and the run's own config, not torch's load traceback."""
    from mmpt.config import ConfigError
    from mmpt.config_loader import load_config

    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "cfg.yaml", tiny_config(digits_root, run_dir, train={"max_steps": 2}))
    train_in_process(load_config(config, ["train.save_every=2", "train.max_steps=2"]))
    with pytest.raises(ConfigError) as stopped:
        train_in_process(load_config(config, ["train.max_steps=3", "method.text.width=48"]))
    said = str(stopped.value)
    assert "\n" not in said and said.startswith(f"{run_dir / 'checkpoints/step_000000002'} does not fit the model")
    assert "size mismatch for " in said and f"resume with the run's own ({run_dir / 'config.yaml'})" in said


def test_a_run_gives_its_gathers_its_own_settings_while_it_trains_and_leaves_none_behind(
    tmp_path, digits_root, process_group_of_one
):
    """The layout, row counts and clock a loss's gathers read are the run's (`Run.collectives`) while it trains, and
    the defaults again once it ends: nothing of one run stays in the process for the next."""
    from mmpt import distributed as mdist
    from mmpt.engine.hooks import observing

    seen: list = []
    with observing(lambda point, step: seen.append(mdist.collectives()) if point == "forward" else None):
        train_in_process(small_clip_demo(digits_root, tmp_path / "run", "train.max_steps=2", "data.eval=[]"))
    assert len(seen) == 2 and seen[0] is seen[1]
    assert seen[0].spans is not None and seen[0].layout.data_size == 1 and not seen[0].uneven_rows
    assert mdist.collectives().spans is None and mdist.collectives() is not seen[0]
