"""Locked towers of the image-text methods (`method.lock_image`, `method.lock_text`), on each method's tiny model
in this process: after AdamW steps on the method's own training step (weight decay on), a locked tower's
parameters are bit-identical, "all but the last N groups" changes exactly those groups' parameters, and a locked
ResNet's batch norm keeps its running statistics (open_clip's frozen batch norm) under its own names. The engine
under every ZeRO stage, with optimizer offload, is exercised by the open_clip and transformers scenarios."""

import pytest
import torch
from PIL import Image
from test_config_matrix import shrink
from test_every_method import demo_config

from mmpt.config import ConfigError
from mmpt.methods import get_method

CASES = {  # method: (its image tower's parameter-name prefixes, its text tower's)
    "clip": (("visual.", "image_projection."), ("text.", "text_projection.")),
    "transformers": (("hf.vision_model.", "hf.visual_projection."), ("hf.text_model.", "hf.text_projection.")),
    "m2_encoder": (("backbone.vision_embed.", "itc_image_proj.", "itc_vl_image_proj."), ("backbone.text_embed.",)),
}


def tiny(name, corpora, tmp_path, *extra):
    from mmpt.config_loader import load_config

    config = demo_config(name)
    cfg = load_config(config, [*shrink(config, corpora), f"run.output_dir={tmp_path}", *extra])
    method = get_method(name)
    method.resolve_defaults(cfg)
    method.prepare(cfg, tmp_path)
    torch.manual_seed(0)
    return cfg, method, method.build_model(cfg, tmp_path)


def batch(method, cfg, tmp_path, size=4):
    generator = torch.Generator().manual_seed(1)
    side = method.image_transform(cfg, train=False)(Image.new("RGB", (64, 64))).shape[-1]
    tokens = method.tokenizer(cfg, tmp_path)(["a seven", "the digit two", "一个三", "four"][:size])
    return {"image": torch.randint(0, 256, (size, 3, side, side), generator=generator, dtype=torch.uint8), **tokens}


def train_steps(method, cfg, model, tmp_path, steps=2):
    """AdamW on every parameter that requires a gradient, weight decay on (locked ones would move under it)."""
    loss = method.build_loss(cfg)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-2, weight_decay=0.1)
    model.train()
    for _ in range(steps):
        terms = method.training_step(model, loss, batch(method, cfg, tmp_path))
        sum(v for k, v in terms.items() if k != "train").backward()
        optimizer.step()
        optimizer.zero_grad()


def changed(model, start):
    return {k for k, v in model.state_dict().items() if not torch.equal(v, start[k])}


@pytest.mark.parametrize("name", CASES)
def test_a_locked_image_tower_is_bit_identical_and_the_text_tower_trains(name, corpora, tmp_path):
    cfg, method, model = tiny(name, corpora, tmp_path, "method.lock_image=0")
    assert "the image tower locked by method.lock_image: 0" in method.summary_lines(cfg)  # the run summary's line
    start = {k: v.clone() for k, v in model.state_dict().items()}
    train_steps(method, cfg, model, tmp_path)
    moved = changed(model, start)
    image, text = CASES[name]
    image_names = [
        k for k in start if k.startswith(image) or (name == "m2_encoder" and ".A." in k and "backbone.encoder." in k)
    ]
    assert image_names and not moved & set(image_names), sorted(moved & set(image_names))[:5]
    assert any(k.startswith(text) for k in moved), "the text tower did not train"


def test_all_but_the_last_groups_locked_changes_exactly_those(corpora, tmp_path):
    """The transformers CLIP's text tower with its last block and its head unlocked (2 groups): only those and the
    image tower, the logit scale, move."""
    cfg, method, model = tiny("transformers", corpora, tmp_path, "method.lock_text=2")
    start = {k: v.clone() for k, v in model.state_dict().items()}
    train_steps(method, cfg, model, tmp_path)
    moved = [k.split(".")[2:5] for k in changed(model, start) if k.startswith("hf.text_model.")]
    text = {part[2] if part[:2] == ["encoder", "layers"] else part[0] for part in moved}
    assert text == {"1", "final_layer_norm"}, text  # layer 1 of 2, and what follows the layers
    assert any(k.startswith("hf.text_projection") for k in changed(model, start))
    assert any(k.startswith("hf.vision_model.") for k in changed(model, start))


def test_a_locked_resnet_keeps_its_batch_norm_statistics_and_names(corpora, tmp_path):
    cfg, method, model = tiny("clip", corpora, tmp_path, "method.lock_image=0")
    (tmp_path / "unlocked").mkdir()
    _, _, unlocked = tiny("clip", corpora, tmp_path / "unlocked")
    assert model.state_dict().keys() == unlocked.state_dict().keys()  # a release or checkpoint loads either way
    running = {k: v.clone() for k, v in model.state_dict().items() if "running_" in k or "num_batches" in k}
    assert running
    train_steps(method, cfg, model, tmp_path)
    now = model.state_dict()
    assert all(torch.equal(now[k], v) for k, v in running.items())


def test_unlocking_every_group_is_a_config_error(corpora, tmp_path):
    with pytest.raises(ConfigError, match=r"^config key 'method.lock_image': 99 unlocked groups leave nothing locked"):
        tiny("clip", corpora, tmp_path, "method.lock_image=99")
