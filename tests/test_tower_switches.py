"""Gradient checkpointing and patch dropout (`mmpt.models.switches`) in every method with an image or video
tower, at the size its `tiny_overrides` give, with a small ViT where the demo tower is a ResNet.

Checkpointing must change memory, not numbers: the same gradients as the eager pass (the independent
reference), and a lower peak of live bytes in the tower's forward and backward. Patch dropout must keep the
class token and (1 - p) of the patches in training, and change nothing in evaluation.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from test_config_matrix import shrink
from test_every_method import demo_config
from timm.layers.patch_dropout import PatchDropout

from mmpt.config import ConfigError
from mmpt.config_loader import load_config
from mmpt.methods import get_method, list_methods
from mmpt.plan.batches import micro_batch
from mmpt.plan.build import built
from mmpt.plan.measure import LiveBytes, drop_gradients, run_step

TINY_VIT = "{img_size: 32, patch_size: 8, embed_dim: 32, depth: 2, num_heads: 2}"
VIT_TOWERS = {  # what makes each method's tiny tower a ViT (the demos' clip and VICTOR towers are ResNets)
    "clip": ["method.image.timm_name=vit_tiny_patch16_224", f"method.image.timm_kwargs={TINY_VIT}"],
    "victor": ["method.video.backbone=vit_tiny_patch16_224", f"method.video.backbone_kwargs={TINY_VIT}"],
    "open_clip": [],  # its tiny config is a ViT
    "m2_encoder": [],  # patches in its own embedding
    "transformers": [],  # its tiny checkpoint is a CLIP ViT
}
SWITCHED = [name for name in list_methods() if get_method(name).tower_switches]


def tiny(name: str, corpora: dict, *extra: str):
    path = demo_config(name)
    return load_config(path, [*shrink(path, corpora), *VIT_TOWERS[name], *extra])


def test_every_method_with_an_image_or_video_tower_has_the_switches():
    for name in list_methods():
        method = get_method(name)
        towers = {"image", "video"} & set(method.sample_fields)
        assert bool(method.tower_switches) == bool(towers), f"method '{name}': tower_switches vs {towers}"
    assert set(SWITCHED) == set(VIT_TOWERS), "a method with switches needs its ViT overrides here"


def step(b, batch: dict) -> dict[str, torch.Tensor]:
    """The parameter gradients of one training step (seeded: VICTOR and SPACE-2 draw masks)."""
    b.model.train()
    b.model.zero_grad(set_to_none=True)
    torch.manual_seed(2)
    run_step(b, batch)
    return {n: p.grad.clone() for n, p in b.model.named_parameters() if p.grad is not None}


def pixels(b, size: int = 4) -> tuple[torch.Tensor, Callable]:
    """A normalised pixel batch for the tower, and the model's function that encodes it."""
    batch = micro_batch(b, size)
    if "image" in batch:
        return torch.randn(batch["image"].shape), b.model.encode_image
    return torch.randn(batch["frames"].shape), b.model.encode_video


def tower_peak_bytes(b) -> int:
    """Peak bytes of the storages the image or video tower's training forward and backward create (batch 8)."""
    b.model.train()
    torch.manual_seed(3)
    images, encode = pixels(b, 8)
    tracker = LiveBytes([*b.model.parameters(), *b.model.buffers(), images])
    handles = drop_gradients(b.model)  # parameter gradients are model state, not the tower's working memory
    with tracker:
        encode(images).sum().backward()
    for handle in handles:
        handle.remove()
    return tracker.peak


@pytest.mark.parametrize("name", SWITCHED)
def test_checkpointing_gives_the_same_gradients_with_fewer_live_bytes(name, corpora):
    key = get_method(name).tower_switches
    grads, peaks = {}, {}
    for on in (False, True):
        torch.manual_seed(0)  # the same initial weights both times
        with built(tiny(name, corpora, f"{key}.grad_checkpointing={on}"), "cpu") as b:
            assert b.model.grad_checkpointing is on
            torch.manual_seed(1)
            batch = micro_batch(b, 4)
            grads[on] = step(b, batch)
            peaks[on] = tower_peak_bytes(b)
    assert grads[True].keys() == grads[False].keys()
    for param, expected in grads[False].items():
        torch.testing.assert_close(grads[True][param], expected, msg=param)
    assert peaks[True] < peaks[False], f"the tower's peak live bytes, checkpointed or not: {peaks}"


@pytest.mark.parametrize("name", SWITCHED)
def test_patch_dropout_keeps_the_class_token_and_1_minus_p_of_patches_in_training_only(name, corpora):
    key = get_method(name).tower_switches
    features = {}
    for p in (0.0, 0.5):
        torch.manual_seed(0)
        with built(tiny(name, corpora, f"{key}.patch_dropout={p}"), "cpu") as b:
            drops = [m for m in b.model.modules() if isinstance(m, PatchDropout) and m.prob == p]
            if p:
                assert drops, f"no patch dropout of {p} in the model"
            tokens: list[tuple[int, int]] = []
            for module in drops:
                module.register_forward_hook(lambda m, args, out: tokens.append((args[0].shape[1], out.shape[1])))
            torch.manual_seed(1)
            images, encode = pixels(b)
            if p:
                before_training = copy.deepcopy(b.model.state_dict())
                b.model.train()
                encode(images)
                b.model.load_state_dict(before_training)  # batch-norm statistics as they were
                assert tokens, "patch dropout never ran in training"
                for before, after in tokens:  # timm's rule: int() of the kept share, at least one patch
                    assert after == 1 + max(1, int((before - 1) * (1 - p))), (before, after)
                tokens.clear()
            b.model.eval()
            with torch.no_grad():
                features[p] = encode(images)
            assert not tokens or all(before == after for before, after in tokens), tokens
    torch.testing.assert_close(features[0.5], features[0.0])  # evaluation sees every patch


@pytest.mark.parametrize(("name", "section"), [("clip", "method.image"), ("victor", "method.video")])
def test_patch_dropout_on_a_tower_without_patches_names_the_key(name, section, corpora):
    path = demo_config(name)
    cfg = load_config(path, [*shrink(path, corpora), f"{section}.patch_dropout=0.5"])  # the demos' ResNets
    expected = rf"config key '{section}\.patch_dropout': timm model 'resnet10t' has no"
    with pytest.raises(ConfigError, match=expected), built(cfg):
        pass
