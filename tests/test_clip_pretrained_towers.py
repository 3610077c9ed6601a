"""The `clip` method from public towers: a timm backbone from a local weights file (as timm reads it: classifier
left out) and a transformers text encoder from a folder, with its tokenizer. Before any step the towers give what
timm and transformers give with those weights; a run from them trains, and its run directory builds the model
(and the model card's description) without the checkpoint folder; missing weights stop before training naming the
key."""

import shutil

import pytest
import timm
import torch
from safetensors.torch import save_file
from test_every_method import one_process  # noqa: F401  (the in-process training fixture)

from conftest import REPO
from mmpt.config import ConfigError
from mmpt.engine.preflight import check_inputs
from mmpt.methods import get_method

DEMO = REPO / "configs/clip/demo.yaml"
CAPTIONS = ["a photo of the digit seven", "数字七", "nine"]


@pytest.fixture(scope="module")
def towers(tmp_path_factory, corpora):
    """A resnet10t with a 10-class classifier saved as timm weights, and a copy of the tiny BERT folder."""
    root = tmp_path_factory.mktemp("towers")
    torch.manual_seed(4)
    reference = timm.create_model("resnet10t", num_classes=10).eval()
    save_file(reference.state_dict(), str(root / "resnet10t.safetensors"))
    shutil.copytree(corpora["bert"], root / "bert")
    return root, reference


def overrides(corpora, root, run_dir):
    from test_config_matrix import shrink

    cut = ("method.tokenizer=", "method.text.")  # the checkpoint's tokenizer and architecture instead
    kept = [o for o in shrink(DEMO, corpora) if not o.startswith(cut)]
    return [
        *kept,
        "method.tokenizer=null",
        f"method.text.pretrained={root / 'bert'}",
        f"method.image.pretrained={root / 'resnet10t.safetensors'}",
        f"run.output_dir={run_dir}",
    ]


def test_towers_give_what_timm_and_transformers_give(towers, corpora, tmp_path):
    from transformers import AutoTokenizer, BertModel

    from mmpt.config_loader import load_config

    root, reference = towers
    cfg = load_config(DEMO, overrides(corpora, root, tmp_path))
    method = get_method("clip")
    method.prepare(cfg, tmp_path)
    model = method.build_model(cfg, tmp_path).eval()
    assert "resnet10t" in method.load_initial_weights(model, cfg)
    images = torch.randn(2, 3, 32, 32)
    reference.reset_classifier(0)
    with torch.no_grad():
        torch.testing.assert_close(model.visual(images), reference(images), atol=1e-6, rtol=0)
    tokens = method.tokenizer(cfg, tmp_path)(CAPTIONS)
    length = tokens["input_ids"].shape[1]
    theirs = AutoTokenizer.from_pretrained(root / "bert")(CAPTIONS, padding="max_length", max_length=length)
    assert tokens["input_ids"].tolist() == theirs["input_ids"]  # the checkpoint's tokenizer, as a tokenizer.json
    bert = BertModel.from_pretrained(root / "bert", add_pooling_layer=False).eval()
    with torch.no_grad():
        ours = model.text(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"]).last_hidden_state
        expected = bert(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"]).last_hidden_state
    torch.testing.assert_close(ours, expected, atol=1e-6, rtol=0)


def test_a_run_from_public_towers_trains_and_needs_no_checkpoint_afterwards(towers, corpora, one_process, tmp_path):  # noqa: F811
    import mmpt
    from mmpt.config_loader import load_config
    from mmpt.engine import train

    root, _ = towers
    copy = tmp_path / "towers"
    shutil.copytree(root, copy)
    run = ["train.max_steps=2", "train.zero_stage=0", "train.precision=fp32", "data.eval=[]", "train.eval_every=0"]
    train(load_config(DEMO, [*overrides(corpora, copy, tmp_path / "run"), *run]))
    shutil.rmtree(copy)  # the run keeps the encoder's config and tokenizer itself
    loaded = mmpt.load(tmp_path / "run")
    tokens = loaded.preprocessors()["tokenizer"](CAPTIONS)
    with torch.no_grad():
        assert loaded.encode_text(tokens["input_ids"], tokens["attention_mask"]).shape == (3, 16)
    card = get_method("clip").architecture(loaded.config, tmp_path / "run")  # the encoder's size, not demo.yaml's
    assert "a bert text tower (from " in card and ") of 2 layers, width 32, 2 heads" in card, card


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("method.image.pretrained", "{root}/missing.safetensors", "missing.safetensors does not exist"),
        ("method.image.pretrained", "timm", None),
        ("method.text.pretrained", "{root}/no-such-encoder", "no-such-encoder does not exist \\(a local folder"),
    ],
    ids=["missing-image-file", "timm-tag-known", "missing-text-folder"],
)
def test_missing_weights_stop_before_training_naming_the_key(towers, corpora, tmp_path, key, value, message):
    from mmpt.config_loader import load_config

    root, _ = towers
    cfg = load_config(DEMO, [*overrides(corpora, root, tmp_path), f"{key}={value.format(root=root)}"])
    if message is None:  # resnet10t has timm weights: found, not fetched before training
        get_method("clip").check_initial_weights(cfg)
        return
    with pytest.raises(ConfigError, match=f"^config key '{key}': .*{message}") as error:
        check_inputs(cfg, get_method("clip"))
    assert "\n" not in str(error.value)
