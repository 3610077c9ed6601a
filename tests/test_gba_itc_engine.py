"""Pooled accumulation through the real engine, on tiny image-text models and 2 gloo ranks.

The claim users rely on: one optimizer step over K pooled micro-batches of b rows is the step of one
K*b-row batch. Checked where it can break: the full gradient (gathered from the ZeRO partitions) after
the engine's own backward and reduction, before the optimizer consumes it; then the parameters after a few
AdamW steps. Gradients, not only parameters: Adam's first update is about lr*sign(g) and would hide a
gradient off by K. The M²-Encoder's GBA-ITC at ZeRO-2 and ZeRO-3, for K = 2 and 4 and groups of 1 and 2 ranks;
`clip` and `open_clip` with the contrastive and the sigmoid loss at ZeRO-0 and ZeRO-3.
"""

import json
import os

import pytest
import torch
import torch.distributed as dist

from conftest import run_on_gloo_ranks, tiny_m2_arch

WORLD, ROWS, STEPS = 2, 3, 3
ARCH = tiny_m2_arch(vocab_size=40, context_length=8)


def m2_section(group_size, tile):
    return {
        "name": "m2_encoder",
        "model": "m2-encoder-demo",
        "arch": ARCH,
        "tokenizer": "unused.json",
        "loss": {"group_size": group_size, "tile_size": tile},
    }


M2_TILED = m2_section(2, 5)

TINY_OPEN_CLIP = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 16, "layers": 1, "width": 32, "head_width": 16, "patch_size": 8},
    "text_cfg": {"context_length": ARCH["context_length"], "vocab_size": 40, "width": 32, "heads": 2, "layers": 1},
}


def image_text_section(method, loss, tmp_path):
    """A tiny `clip` (a ViT image tower: batch norm would make a micro-batch's features depend on its
    neighbours) or `open_clip` model, 16 px images and 8 tokens from 40."""
    if method == "open_clip":
        config = tmp_path / "tiny-open-clip.json"
        config.write_text(json.dumps(TINY_OPEN_CLIP))
        return {"name": "open_clip", "model": str(config), "loss": loss}
    vit = {"img_size": 16, "patch_size": 8, "depth": 1, "num_heads": 2, "embed_dim": 32}
    return {
        "name": "clip",
        "tokenizer": "unused.json",
        "embed_dim": 16,
        "image": {"timm_name": "vit_tiny_patch16_224", "image_size": 16, "timm_kwargs": vit},
        "text": {"vocab_size": 40, "width": 32, "layers": 1, "heads": 2, "context_length": 8},
        "loss": loss,
    }


def make_config(run_dir, stage, accum, micro_rows, method, pool_pass="auto"):
    from mmpt.config_loader import validate_config

    train = {"max_steps": STEPS, "zero_stage": stage, "grad_accum": accum, "grad_clip": 1.0, "pool_pass": pool_pass}
    return validate_config(
        {
            "method": method,
            "data": {"train": {"sources": [{"shards": "unused.tar"}], "batch_size": micro_rows}},
            "optim": {"lr": 1e-3, "weight_decay": 0.05, "warmup_steps": 0},
            "train": train,
            "run": {"output_dir": str(run_dir), "progress_bar": False, "tensorboard": False},
        }
    )


def step_batch(rank, step, rows, size=16):
    """This rank's rows for one optimizer step, the same whichever way they are split into micro-batches."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    lengths = torch.randint(2, ARCH["context_length"] + 1, (rows,), generator=gen)
    mask = (torch.arange(ARCH["context_length"])[None, :] < lengths[:, None]).long()
    return {
        "image": torch.randn(rows, 3, size, size, generator=gen),
        "input_ids": torch.randint(1, ARCH["vocab_size"], (rows, ARCH["context_length"]), generator=gen) * mask,
        "attention_mask": mask,
    }


def split(batch, parts):
    return [dict(zip(batch, values)) for values in zip(*(v.chunk(parts) for v in batch.values()))]


def train_and_record(rank, run_dir, stage, accum, section, pool_pass="auto", merged=False):
    """Per step: the full gradient at the accumulation boundary; at the end, on rank 0: how far each weight moved.
    `merged`: whether the engine must run the pooled steps as one pass."""
    from deepspeed.runtime.zero import utils as zero_utils
    from deepspeed.utils import safe_get_full_grad

    from mmpt import distributed as mdist
    from mmpt.engine.checkpoint import gathered_state_dict
    from mmpt.engine.run import build_engine
    from mmpt.engine.trainer import optimizer_step
    from mmpt.methods import get_method

    method = get_method(section["name"])
    cfg = make_config(run_dir, stage, accum, ROWS * 4 // accum, section, pool_pass)
    engine, _, _ = build_engine(cfg, method, mdist.ParallelLayout.whole_world(), WORLD)
    assert (engine.module.pooling == "merged") == merged
    size = 16  # both image-text models' input size (see image_text_section)
    named = list(engine.module.model.named_parameters())
    initial = gathered_state_dict(engine.module.model)
    gradients = []
    apply_step = engine.step

    def step_capturing_the_gradient():
        if engine.is_gradient_accumulation_boundary():
            gradients.append({n: _full(safe_get_full_grad(p), p) for n, p in named})
        apply_step()

    engine.step = step_capturing_the_gradient
    zero_utils.warned = False  # DeepSpeed warns once per process, on rank 0, of module inputs it cannot look into
    for step in range(STEPS):
        optimizer_step(engine, split(step_batch(rank, step, ROWS * 4, size), accum))
    # The pool (a named tuple of tensors without gradient) is an input ZeRO-3's hooks can read.
    assert not zero_utils.warned, "ZeRO-3's module hooks met an input type they cannot look into"
    final = gathered_state_dict(engine.module.model)
    engine.destroy()
    return gradients, final and {n: final[n] - initial[n] for n in final}


def _full(grad, param):
    return torch.zeros(getattr(param, "ds_shape", param.shape)) if grad is None else grad.detach().float().clone()


def check_accumulated_step_equals_one_big_batch(rank, tmp, stage, accum, section):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD))
    pooled_grads, pooled_moves = train_and_record(rank, f"{tmp}/pooled", stage, accum, section)
    big_grads, big_moves = train_and_record(rank, f"{tmp}/big", stage, 1, section)
    assert len(pooled_grads) == len(big_grads) == STEPS
    roundoff = set()  # gradients that are zero up to rounding (a key bias's): Adam turns them into lr*sign(noise)
    for step, (mine, reference) in enumerate(zip(pooled_grads, big_grads), start=1):
        whole = torch.cat([g.flatten() for g in reference.values()])
        difference = torch.cat([(mine[n] - g).flatten() for n, g in reference.items()])
        error = (difference.norm() / whole.norm()).item()
        assert error <= 1e-5, f"step {step}: the full gradient differs by {error:.2e} (relative)"
        for name, ref in reference.items():
            if ref.norm() == 0:  # a parameter the contrastive step does not use: no gradient either way
                assert mine[name].norm() == 0, f"step {step}: {name} has a gradient only with accumulation"
            elif ref.norm() > 1e-3 * whole.norm():
                error = ((mine[name] - ref).norm() / ref.norm()).item()
                assert error <= 1e-5, f"step {step}: the gradient of {name} differs by {error:.2e} (relative)"
            else:
                roundoff.add(name)
    assert len(roundoff) < len(big_grads[0]) // 4, sorted(roundoff)
    assert (big_moves is not None) == (rank == 0)  # rank 0 holds the gathered weights and compares them
    for name, moved in (big_moves or {}).items():
        # Adam divides by the gradient's own scale, so an element whose gradient is tiny moves by about
        # lr either way: compare each parameter's update as a whole.
        error = (pooled_moves[name] - moved).norm().item()
        # open_clip's fused q, k, v bias: its k third has a gradient of rounding only (softmax ignores a shift)
        noisy = name in roundoff or name.endswith("in_proj_bias")
        limit = 2e-3 * moved.norm().item() if not noisy else 2 * 1e-3 * STEPS * moved.numel() ** 0.5
        assert error <= limit, f"{name}: moved {error:.2e} away from the big-batch run's update {moved.norm():.2e}"
    dist.barrier()


def check_merged_pass_equals_the_separate_one(rank, tmp, stage, accum, section):
    """With checkpointing on, `train.pool_pass: auto` merges the pool pass into the step (one forward with gradient
    per micro-batch, one backward): the same gradients as the separate pool pass, to fp32 rounding."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD))
    separate, separate_moves = train_and_record(rank, f"{tmp}/separate", stage, accum, section, "separate")
    merged, merged_moves = train_and_record(rank, f"{tmp}/merged", stage, accum, section, "auto", merged=True)
    assert len(merged) == len(separate) == STEPS
    # Gradients that are zero up to rounding (a key bias's) Adam moves by lr*sign(noise), so from step 2 on the two
    # runs' weights differ by that much: 1e-6 holds at step 1, where both start from the same weights.
    roundoff = set()
    for step, (mine, reference) in enumerate(zip(merged, separate), start=1):
        whole, limit = torch.cat([g.flatten() for g in reference.values()]).norm(), 1e-6 if step == 1 else 1e-5
        for name, ref in reference.items():
            error = ((mine[name] - ref).norm() / whole).item()
            assert error <= limit, f"step {step}: the gradient of {name} differs by {error:.2e} of the whole"
            if ref.norm() <= 1e-3 * whole:
                roundoff.add(name)
    for name, moved in (separate_moves or {}).items():
        if name not in roundoff and not name.endswith("in_proj_bias"):  # open_clip's fused q, k, v bias: k's is noise
            assert torch.allclose(merged_moves[name], moved, rtol=0, atol=1e-6), name
    dist.barrier()


def checkpointed(section):
    """`section` with gradient checkpointing on in its towers (where each method's config has the switch)."""
    if section["name"] == "m2_encoder":
        return {**section, "arch": {**section["arch"], "grad_checkpointing": True}}
    if section["name"] == "open_clip":
        return {**section, "grad_checkpointing": True}
    return {**section, "image": {**section["image"], "grad_checkpointing": True, "patch_dropout": 0.25}}


@pytest.mark.parametrize("stage", [2, 3])
def test_pooled_accumulation_through_the_engine_equals_one_big_batch(tmp_path, stage):
    # Between the two stages every accumulation (2, 4) meets every group size (1, 2); tiled logits at ZeRO-2 (at
    # ZeRO-3 the merged pass, tiled, equals the separate one).
    cells = [(2, 1, 0), (4, 2, 0), (4, 2, 5)] if stage == 2 else [(2, 2, 0), (4, 1, 0)]
    run_on_gloo_ranks(
        __name__,
        [
            (
                "check_accumulated_step_equals_one_big_batch",
                (str(tmp_path / f"k{a}g{g}t{t}"), stage, a, m2_section(g, t)),
            )
            for a, g, t in cells
        ]
        # GBA-ITC merged at ZeRO-3 (extended); the default tier's merged cells are the image-text methods' at ZeRO-0
        + [("check_merged_pass_equals_the_separate_one", (str(tmp_path / "merged"), stage, 4, checkpointed(M2_TILED)))]
        * (stage == 3),
        WORLD,
    )


SIGMOID = {"name": "sigmoid", "exchange": "ring", "tile_size": 5}


@pytest.mark.parametrize("stage", [0, 3])
def test_image_text_methods_pool_micro_batches_into_one_big_batch(tmp_path, stage):
    cells = [
        ("clip", {"name": "contrastive"}, 2),
        ("clip", SIGMOID, 4),
        ("open_clip", {"name": "contrastive", "tile_size": 5}, 4),
        ("open_clip", {**SIGMOID, "exchange": "gather", "tile_size": None}, 2),
    ]
    run_on_gloo_ranks(
        __name__,
        [
            (
                "check_accumulated_step_equals_one_big_batch",
                (str(tmp_path / f"{method}{i}"), stage, accum, image_text_section(method, loss, tmp_path)),
            )
            for i, (method, loss, accum) in enumerate(cells)
            if stage == 0 or i in (1, 2)  # ZeRO-3: each method once; every loss variant at ZeRO-0
        ]
        + [
            (
                "check_merged_pass_equals_the_separate_one",
                (
                    str(tmp_path / f"merged-{method}"),
                    stage,
                    2,
                    checkpointed(image_text_section(method, loss, tmp_path)),
                ),
            )
            for method, loss, _ in cells[1:3]  # clip with the sigmoid loss and patch dropout, open_clip contrastive
        ],
        WORLD,
    )
