"""The `open_clip` method: any open_clip architecture on mmpt's engine (what the throughput comparison trains)."""

import logging
import math
import re

import open_clip
import pytest
import torch

from conftest import REPO, read_metrics, tiny_config
from mmpt.config import ConfigError
from mmpt.models.open_clip_model import OpenClipModel, OpenClipTokenizer
from pool import scenario

CONFIG = str(REPO / "mmpt/models/bench-vit-tiny.json")


def test_model_and_tokenizer_are_open_clips():
    torch.manual_seed(0)
    model = OpenClipModel(CONFIG).eval()
    assert model.clip.logit_scale.shape == (1,)  # DeepSpeed cannot flatten 0-D parameters
    reference = open_clip.create_model("bench-vit-tiny", pretrained=None).eval()
    state = {k: v.reshape(reference.state_dict()[k].shape) for k, v in model.clip.state_dict().items()}
    reference.load_state_dict(state)
    tokens = OpenClipTokenizer(CONFIG)(["a handwritten seven", "zero"])
    assert torch.equal(tokens["input_ids"], open_clip.get_tokenizer("bench-vit-tiny")(["a handwritten seven", "zero"]))
    images = torch.randn(2, 3, 64, 64)
    image, text, scale = model(images, tokens["input_ids"], tokens["attention_mask"])
    with torch.no_grad():
        torch.testing.assert_close(image, reference.encode_image(images, normalize=True))
        torch.testing.assert_close(text, reference.encode_text(tokens["input_ids"], normalize=True))
    assert scale.item() == pytest.approx(1 / 0.07, rel=1e-5)


def test_building_the_model_does_not_say_its_weights_are_random(caplog):
    """mmpt loads the weights after open_clip builds the network; open_clip's "initialized randomly" would
    make a fine-tuning user think the checkpoint was lost. Other warnings pass."""
    with caplog.at_level("WARNING"):
        OpenClipModel(CONFIG)
        logging.warning("another warning")  # noqa: LOG015 (open_clip warns on the root logger too)
    assert [r.getMessage() for r in caplog.records] == ["another warning"]


def test_unknown_model_is_a_config_error(tmp_path):
    """A name open_clip does not know, a missing model config and a file that is not JSON: one line naming the key
    (a ConfigError: exit 2 before training), not a traceback."""
    (tmp_path / "pairs.json").write_text("image,caption\na.png,a cat\n")
    cases = {
        "ViT-Nonexistent-1": "'ViT-Nonexistent-1' is not an open_clip model",
        str(tmp_path / "missing.json"): "missing.json does not exist",
        str(tmp_path / "pairs.json"): "pairs.json is not a JSON model config",
    }
    for model, message in cases.items():
        with pytest.raises(ConfigError, match=f"^config key 'method.model': .*{re.escape(message)}"):
            OpenClipModel(model)


@scenario("open-clip-two-ranks")
def open_clip_two_ranks(corpora, run_dir):
    cfg = tiny_config(corpora["digits"], run_dir, train={"max_steps": 4, "save_every": 0})
    cfg["method"] = {"name": "open_clip", "model": CONFIG}
    cfg["data"]["eval"] = [{"dataset": str(corpora["digits"] / "zeroshot"), "task": "zeroshot_classification"}]
    return cfg, [], "train"


@pytest.mark.pool("open-clip-two-ranks")
def test_open_clip_method_trains_on_two_ranks(rank_pool):
    records = read_metrics(rank_pool.run_dir("open-clip-two-ranks"))
    assert all(math.isfinite(r["loss/total"]) for r in records if "loss/total" in r)
    assert 0 <= records[-1]["eval/zeroshot/en/acc1"] <= 1
    # the diagnostics fine-tuners watch, in every window; not part of the loss
    windows = [r for r in records if "loss/total" in r]
    for record in windows:
        assert 0 <= record["train/i2t_acc"] <= 1 and 0 <= record["train/t2i_acc"] <= 1
        assert record["loss/total"] == pytest.approx(record["loss/contrastive"])
    assert windows[0]["train/logit_scale"] == pytest.approx(1 / 0.07, rel=1e-2)


def test_in_batch_diagnostics_count_each_side_s_best_match():
    from mmpt.methods.image_text import in_batch_diagnostics

    images = torch.eye(4)
    texts = torch.eye(4)[[0, 1, 3, 2]] + 0.1 * torch.eye(4)  # images 2 and 3 best match each other's caption
    texts[0, 1] = 2.0  # and text 0 is image 1's best match
    found = in_batch_diagnostics(images, texts, [torch.tensor([20.0]), torch.tensor([-10.0])])
    assert float(found["i2t_acc"]) == 0.25  # image 0 finds its caption
    assert float(found["t2i_acc"]) == 0.25  # text 1 finds its image (text 0's best is image 1)
    assert float(found["logit_scale"]) == 20.0 and float(found["logit_bias"]) == -10.0


def test_a_model_defined_by_a_json_file_is_carried_by_its_run_and_release(tmp_path, monkeypatch):
    """A run keeps its JSON model config, and so does a release of it: both load from any working directory,
    also once the file the config named (by a relative path) is gone."""
    import shutil

    import mmpt
    from mmpt.config_loader import load_config
    from mmpt.methods import get_method
    from mmpt.release import read_config, save_release

    (tmp_path / "defs").mkdir()
    shutil.copyfile(CONFIG, tmp_path / "defs" / "my-tiny.json")
    monkeypatch.chdir(tmp_path)
    overrides = ["method.model=defs/my-tiny.json", "method.pretrained=null", "run.output_dir=run"]
    cfg = load_config(REPO / "configs/open_clip/demo.yaml", overrides)
    method = get_method("open_clip")
    (tmp_path / "run").mkdir()
    method.prepare(cfg, tmp_path / "run")
    torch.manual_seed(0)
    model = method.build_model(cfg, tmp_path / "run").eval()
    save_release(tmp_path / "release", cfg, model.state_dict(), tmp_path / "run")
    # a run from before runs kept the file: its release makes the copy from the path the config names
    (tmp_path / "older").mkdir()
    save_release(tmp_path / "older-release", cfg, model.state_dict(), tmp_path / "older")
    made = tmp_path / "older-release/open_clip_config/my-tiny.json"
    assert made.read_bytes() == (tmp_path / "defs/my-tiny.json").read_bytes()
    shutil.rmtree(tmp_path / "defs")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert read_config(tmp_path / "release").method.model == str(tmp_path / "release/open_clip_config/my-tiny.json")
    loaded = mmpt.load(tmp_path / "release")
    images = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(loaded.encode_image(images), model.clip.encode_image(images, normalize=True))
