"""The `transformers` method from a folder of each dual encoder class transformers ships (tiny, saved with
`save_pretrained`): before any step, mmpt's embeddings of the same images and captions equal transformers' own
(its model, its tokenizer, its image processor's "pil" backend) to 1e-5; the checkpoint's logit scale and bias
are kept and its loss chosen; a folder that is no dual encoder, or has no weights, stops in one line naming the
key; on two ranks a SigLIP run with pooled accumulation trains, resumes and exports."""

import json
import re
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from tiny_dual_encoders import KINDS, build

from conftest import REPO, read_metrics
from mmpt.config import ConfigError
from mmpt.engine.preflight import check_inputs
from mmpt.methods import get_method
from mmpt.methods.image_text import SigmoidLossConfig
from pool import scenario

CAPTIONS = ["a photo of the digit seven", "数字七", "nine"]
CONFIG = REPO / "configs/transformers/clip_finetune.yaml"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("dual_encoders")
    return {kind: build(kind, root / kind) for kind in KINDS}


def config(model, **method):
    from mmpt.config_loader import validate_config

    return validate_config(
        {
            "method": {"name": "transformers", "model": str(model), **method},
            "data": {"train": {"sources": [{"shards": str(REPO / "README.md")}], "batch_size": 2}},
            "optim": {"lr": 1e-4},
            "train": {"max_steps": 1, "zero_stage": 0, "grad_clip": 1.0},
            "run": {"output_dir": str(model.parent / "run")},
        }
    )


def images(kind):
    """Odd sizes, so that resizing and cropping (by an odd margin) are exercised (SigLIP 2 keeps the aspect ratio:
    squares for it)."""
    rng = np.random.RandomState(0)
    sizes = [(40, 40), (56, 56)] if kind == "siglip2" else [(48, 37), (32, 51)]
    return [Image.fromarray(rng.randint(0, 256, (h, w, 3)).astype(np.uint8)) for h, w in sizes]


@pytest.mark.parametrize("kind", KINDS)
def test_embeddings_equal_transformers_own(checkpoints, kind, tmp_path):
    from transformers import AutoImageProcessor, AutoModel, AutoTokenizer

    folder, method = checkpoints[kind], get_method("transformers")
    cfg = config(folder)
    method.resolve_defaults(cfg)
    method.prepare(cfg, tmp_path)  # the run keeps the checkpoint's config, tokenizer and processor: built from it
    model = method.build_model(cfg, tmp_path).eval()
    method.load_initial_weights(model, cfg)
    transform, tokens = method.image_transform(cfg, train=False), method.tokenizer(cfg, tmp_path)(CAPTIONS)
    with torch.no_grad():
        ours_images = model.encode_image(torch.stack([transform(image) for image in images(kind)]))
        ours_texts = model.encode_text(tokens["input_ids"], tokens["attention_mask"])
        _, _, scale, *bias = model(torch.stack([transform(image) for image in images(kind)]), tokens["input_ids"])

    reference = AutoModel.from_pretrained(folder).eval()
    processor = AutoImageProcessor.from_pretrained(folder, backend="pil")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    sigmoid = kind in ("siglip", "siglip2")  # trained on padded, unmasked captions of the tower's full length
    padding = {"padding": "max_length", "max_length": 16, "truncation": True} if sigmoid else {"padding": True}
    text = tokenizer(CAPTIONS, return_tensors="pt", **padding)
    with torch.no_grad():
        theirs_images = reference.get_image_features(**processor(images=images(kind), return_tensors="pt"))
        mask = None if sigmoid else text["attention_mask"]
        theirs_texts = reference.get_text_features(input_ids=text["input_ids"], attention_mask=mask)
    torch.testing.assert_close(ours_images, F.normalize(theirs_images.pooler_output, dim=-1), atol=1e-5, rtol=0)
    torch.testing.assert_close(ours_texts, F.normalize(theirs_texts.pooler_output, dim=-1), atol=1e-5, rtol=0)
    assert scale.item() == pytest.approx(np.exp(2.5))  # the checkpoint's, not a new model's
    assert isinstance(method.loss_spec(cfg), SigmoidLossConfig) == sigmoid  # the checkpoint's own loss
    assert [b.item() for b in bias] == ([-3.0] if sigmoid else [])
    assert all(k.startswith("hf.") for k in model.state_dict())  # transformers' tensors, each once


def test_sigmoid_loss_on_a_clip_checkpoint_adds_siglips_bias(checkpoints, tmp_path):
    cfg = config(checkpoints["clip"], loss={"name": "sigmoid"})
    method = get_method("transformers")
    model = method.build_model(cfg, tmp_path)
    method.load_initial_weights(model, cfg)
    assert model.bias is not None and model.bias.item() == -10.0 and model.hf.logit_scale.item() == 2.5


@pytest.mark.parametrize("loss", ["sigmoid", "contrastive"])
def test_an_export_without_a_place_for_the_trained_bias_says_so(checkpoints, loss, tmp_path, capfd):
    """CLIPModel has no logit bias: a sigmoid-trained one exports without it, and the command says so."""
    from mmpt.commands.export import main as export
    from mmpt.release import PretrainedModel

    method, cfg = get_method("transformers"), config(checkpoints["clip"], loss={"name": loss})
    method.resolve_defaults(cfg)
    method.prepare(cfg, tmp_path)
    model = method.build_model(cfg, tmp_path).eval()
    method.load_initial_weights(model, cfg)
    PretrainedModel(model, cfg, tmp_path).save_pretrained(tmp_path / "release")
    capfd.readouterr()
    assert export(["--run", str(tmp_path / "release"), "--out", str(tmp_path / "hf"), "--format", "transformers"]) == 0
    noted = "note: CLIPModel has no logit bias: the one the sigmoid loss trained (-10) is not in the export"
    assert (noted in capfd.readouterr().err) == (loss == "sigmoid")


def test_what_cannot_be_trained_stops_before_training_naming_the_key(checkpoints, tmp_path):
    from transformers import BertConfig, BertModel

    BertModel(
        BertConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=1, intermediate_size=8)
    ).save_pretrained(tmp_path / "bert")
    for name, leave_out in (("no-weights", "model.safetensors"), ("no-processor", "preprocessor_config.json")):
        shutil.copytree(checkpoints["clip"], tmp_path / name, ignore=shutil.ignore_patterns(leave_out))
    tokenizer_files = "tokenizer*", "vocab.*", "merges.txt", "special_tokens_map.json"
    shutil.copytree(checkpoints["clip"], tmp_path / "no-tokenizer", ignore=shutil.ignore_patterns(*tokenizer_files))
    cases = {
        tmp_path / "bert": r"is a 'bert' model, not a dual encoder mmpt trains \(clip, ",
        tmp_path / "missing": r"missing does not exist \(a local folder, or a hub name org/name\)$",
        tmp_path / "bert/..": r"cannot read a transformers config from ",  # a folder without config.json
        tmp_path / "no-weights": r"no-weights holds no weights \(none of model.safetensors",
        tmp_path / "no-processor": r"an image processor \(preprocessor_config.json or .*\) from .*no-processor",
        tmp_path / "no-tokenizer": r"no-tokenizer has no tokenizer files \(the tokenizer read from it knows only",
    }
    for folder, message in cases.items():
        with pytest.raises(ConfigError, match="^config key 'method.model'") as error:
            check_inputs(config(folder), get_method("transformers"))
        assert re.search(message, str(error.value)) and "\n" not in str(error.value), str(error.value)


@scenario("transformers-siglip-pooled")
def transformers_siglip_pooled(corpora, run_dir):
    """configs/transformers/clip_finetune.yaml on a tiny SigLIP folder: its sigmoid loss, pooled over 2 micro-
    batches at ZeRO-2, trained, resumed, exported and loaded back (a matrix cell)."""
    from test_config_matrix import shrink

    folder = build("siglip", run_dir.parent / "siglip")
    overrides = ["method.loss=null", "train.zero_stage=2", "train.grad_accum=2", f"method.model={folder}"]
    return CONFIG, [*shrink(CONFIG, corpora), *overrides], "matrix"


@pytest.mark.pool("transformers-siglip-pooled")
def test_a_siglip_run_trains_resumes_and_exports(rank_pool):
    rank_pool.record("transformers-siglip-pooled")  # the checks run in the pool (pool_runner.run_matrix_cell)
    windows = [r for r in read_metrics(rank_pool.run_dir("transformers-siglip-pooled")) if "loss/total" in r]
    assert "loss/sigmoid" in windows[0] and windows[0]["train/logit_bias"] == pytest.approx(-3.0, abs=0.05)


@scenario("transformers-locked-image-zero3-offload")
def transformers_locked_image(corpora, run_dir):
    """A tiny CLIP checkpoint with its image tower locked, at ZeRO-3 with the optimizer offloaded (frozen
    parameters are where DeepSpeed has crashed), 2 steps."""
    from test_config_matrix import shrink

    stage = ["train.zero_stage=3", "train.offload_optimizer=true", "train.precision=fp32", "train.max_steps=2"]
    rest = ["method.lock_image=0", "data.eval=[]", "train.eval_every=0"]
    return CONFIG, [*shrink(CONFIG, corpora), *stage, *rest], "train"


@pytest.mark.pool("transformers-locked-image-zero3-offload")
def test_a_locked_tower_ends_as_the_checkpoint_had_it(rank_pool, corpora):
    from safetensors.torch import load_file

    start = load_file(str(corpora["transformers_clip"] / "model.safetensors"))
    final = load_file(str(rank_pool.run_dir("transformers-locked-image-zero3-offload") / "model.safetensors"))
    image = [k for k in start if k.startswith(("vision_model.", "visual_projection."))]
    assert image and all(torch.equal(final[f"hf.{k}"], start[k]) for k in image)
    assert not torch.equal(final["hf.text_projection.weight"], start["text_projection.weight"])  # the text trained


@pytest.mark.parametrize("kind", ["clip", "siglip", "siglip2"])
def test_format_transformers_is_a_folder_transformers_loads_with_the_trained_weights(checkpoints, kind, tmp_path):
    """A release of the model (its weights moved away from the checkpoint's), exported as a transformers folder:
    AutoModel, AutoTokenizer and AutoImageProcessor load it and give mmpt's embeddings; the scale and bias are the
    model's, and its tokenizer truncates at the context length the model was trained with."""
    from transformers import AutoImageProcessor, AutoModel, AutoTokenizer

    from mmpt.commands.export import main as export
    from mmpt.release import PretrainedModel

    method, cfg = get_method("transformers"), config(checkpoints[kind])
    method.resolve_defaults(cfg)
    method.prepare(cfg, tmp_path)
    model = method.build_model(cfg, tmp_path).eval()
    method.load_initial_weights(model, cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))  # not the checkpoint's weights any more
    PretrainedModel(model, cfg, tmp_path).save_pretrained(tmp_path / "release")
    saved = json.loads((tmp_path / "release/config.json").read_text())["config"]["method"]
    assert saved["loss"]["name"] == ("contrastive" if kind == "clip" else "sigmoid")  # built without the checkpoint
    assert export(["--run", str(tmp_path / "release"), "--out", str(tmp_path / "hf"), "--format", "transformers"]) == 0
    card = (tmp_path / "hf/README.md").read_text()  # the folder's model card says how to load it
    assert f'model = AutoModel.from_pretrained("{tmp_path / "hf"}")' in card and "| `model.safetensors` |" in card
    loaded = AutoModel.from_pretrained(tmp_path / "hf").eval()
    assert type(loaded).__name__ == type(model.hf).__name__
    assert torch.equal(loaded.logit_scale.reshape(1), model.hf.logit_scale.detach())
    long = AutoTokenizer.from_pretrained(tmp_path / "hf")(" ".join(["seven"] * 600), truncation=True)
    assert len(long["input_ids"]) == model.context_length  # truncated where training truncates
    processor = AutoImageProcessor.from_pretrained(tmp_path / "hf", backend="pil")
    pictures = images(kind)
    with torch.no_grad():
        theirs = loaded.get_image_features(**processor(images=pictures, return_tensors="pt")).pooler_output
        ours = model.encode_image(torch.stack([method.image_transform(cfg, False)(p) for p in pictures]))
    torch.testing.assert_close(ours, F.normalize(theirs, dim=-1), atol=1e-5, rtol=0)


def test_a_bare_name_that_is_no_folder_here_says_so_beside_the_hubs_answer(monkeypatch, tmp_path):
    """`tiny-clp-hf`, a typo of a local folder, is also a well-formed hub name: the line says there is no such
    folder before what the hub said."""
    import huggingface_hub.constants

    from mmpt.models.transformers_dual import load_config

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)
    says = r"^config key 'method.model': cannot read a transformers config from tiny-clp-hf: no local folder of"
    with pytest.raises(ConfigError, match=says):
        load_config("tiny-clp-hf")
