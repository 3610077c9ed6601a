"""Models that leave mmpt (`launch/export.py --format`): every method's towers in ONNX give mmpt's features
under onnxruntime; clip and open_clip models load in open_clip with the same features; an official
M²-Encoder checkpoint goes through mmpt and back bit for bit; every release carries a model card with
its run's evaluations; a request that cannot work is one line and exit 2.

Models are the methods' demo configs at the size of their `tiny_overrides`, built in this process.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from test_config_matrix import COMMON
from test_every_method import one_process  # noqa: F401 (a fixture)

import mmpt
from conftest import REPO, launcher_env, read_metrics
from mmpt.commands.export import main as export
from mmpt.methods import get_method, list_methods
from mmpt.release import PretrainedModel

ONNX_TOLERANCE = 1e-4
OPEN_CLIP_TOLERANCE = 1e-5
CAPTIONS = ["a handwritten digit seven", "手写的数字三", "the digit two  written   twice, " + "very long " * 30]


def demo_config(name: str, corpora: dict, run_dir: Path, *extra: str):
    from test_every_method import demo_config as config_of

    from mmpt.config_loader import load_config

    overrides = [*COMMON, *(o.format(**corpora) for o in get_method(name).tiny_overrides), *extra]
    return load_config(config_of(name), [*overrides, f"run.output_dir={run_dir}"])


def demo_release(name: str, corpora: dict, root: Path, *extra: str) -> Path:
    """The method's demo config at its tiny size, freshly initialised in this process, saved as a release."""
    cfg = demo_config(name, corpora, root / "run", *extra)
    files = root / "files"
    files.mkdir(parents=True)
    method = get_method(name)
    method.prepare(cfg, files)
    torch.manual_seed(0)
    return PretrainedModel(method.build_model(cfg, files), cfg, files).eval().save_pretrained(root / "release")


def mmpt_features(model, tower: str, inputs: tuple[torch.Tensor, ...]) -> np.ndarray:
    """What mmpt's own encoder gives for a tower's inputs."""
    with torch.no_grad():
        if tower == "image":
            return model.encode_image(*inputs).numpy()
        if tower == "video":
            return model.encode_video(*inputs).numpy()
        if tower == "text":
            return model.encode_text(*inputs).numpy()
        names = ("input_ids", "positions", "turns", "roles", "attention_mask")
        return model.encode_dialog(dict(zip(names, inputs))).numpy()


def digit_images(digits_root: Path, count: int = 3) -> list[Image.Image]:
    paths = sorted((digits_root / "zeroshot" / "images").glob("*.png"))[:count]
    return [Image.open(path).convert("RGB") for path in paths]


ONNX_CASES = {
    "clip": ("clip", ()),
    "open_clip": ("open_clip", ()),
    "m2_encoder": ("m2_encoder", ()),
    "m2_encoder-glm": ("m2_encoder", ("method.tokenizer={glm}", "method.arch.vocab_size=null")),
    "victor": ("victor", ()),
    "space2": ("space2", ()),
    "transformers": ("transformers", ()),
}


def test_every_method_with_towers_has_an_onnx_case():
    assert {name for name, _ in ONNX_CASES.values()} == {m for m in list_methods() if get_method(m).tower_names}


@pytest.mark.slow  # ~70 s for every tower: the default run, not the quick tier
@pytest.mark.parametrize("case", sorted(ONNX_CASES))
def test_onnx_towers_give_mmpts_features(case, corpora, glm_sp_model, tmp_path, monkeypatch):
    """Each tower under onnxruntime against mmpt's encoder on batches of 1 and 5 (and two lengths where the length
    is dynamic); then the onnxruntime code the export's README shows, run as written (preprocessing, tokenizer,
    towers), on a photo, a caption, a dialog, or the zero clip it uses as its example video."""
    import onnxruntime

    from mmpt.export.towers import towers

    name, extra = ONNX_CASES[case]
    release = demo_release(name, corpora, tmp_path, *(o.format(glm=glm_sp_model) for o in extra))
    out = tmp_path / "onnx"
    assert export(["--run", str(release), "--out", str(out), "--format", "onnx", "--skip-check"]) == 0
    contract = json.loads((out / "preprocessing.json").read_text())
    assert sorted(contract["towers"]) == sorted(get_method(name).tower_names)
    model = mmpt.load(release)
    for tower in towers(model.model, model.config):
        spec = contract["towers"][tower.name]
        session = onnxruntime.InferenceSession(str(out / spec["file"]), providers=["CPUExecutionProvider"])
        assert [i.name for i in session.get_inputs()] == [s["name"] for s in spec["inputs"]]
        lengths = [tower.max_sequence, tower.max_sequence // 2 + 1] if tower.dynamic_sequence else [None]
        for batch in (1, 5):  # neither is the size the exporter traced with (2)
            for length in lengths:
                inputs = tower.example(batch, length, seed=batch)
                got = session.run(None, {s["name"]: x.numpy() for s, x in zip(spec["inputs"], inputs)})[0]
                expected = mmpt_features(model.model, tower.name, inputs)
                assert got.shape == expected.shape == (batch, spec["outputs"][0]["shape"][1])
                np.testing.assert_allclose(got, expected, rtol=0, atol=ONNX_TOLERANCE, err_msg=f"{tower.name} {batch}")

    readme = (out / "README.md").read_text()
    code = readme.split("### With onnxruntime\n\n```python\n", 1)[1].split("```", 1)[0]
    assert ("GLMTokenizer" in code) == case.endswith("glm")
    monkeypatch.chdir(tmp_path)
    digit_images(corpora["digits"], 1)[0].resize((48, 40)).save("photo.jpg")
    scope: dict = {}
    exec(code, scope)
    pre = model.preprocessors()
    with torch.no_grad():
        expected = {}
        if "tokenizer" in pre and name != "space2":
            tokens = pre["tokenizer"](["a photo of a cat"])
            expected["text_features"] = model.encode_text(tokens["input_ids"], tokens["attention_mask"])
        if "preprocess" in pre:
            pixels = pre["preprocess"](Image.open("photo.jpg").convert("RGB")).unsqueeze(0)
            expected["image_features"] = model.encode_image(pixels)
        if name == "victor":
            expected["video_features"] = model.encode_video(torch.zeros(scope["video"].shape, dtype=torch.uint8))
        if name == "space2":
            dialog = pre["tokenizer"]([[{"role": "user", "text": "I lost my card"}]])
            expected["dialog_features"] = model.encode_dialog(dialog)
    assert expected and set(expected) <= set(scope)
    for key, value in expected.items():
        np.testing.assert_allclose(scope[key], value.numpy(), rtol=0, atol=ONNX_TOLERANCE, err_msg=key)


@pytest.mark.parametrize("name, extra", [("clip", ()), ("clip", ("method.text.pooling=cls",)), ("open_clip", ())])
def test_open_clip_loads_the_export_and_gives_mmpts_features(name, extra, corpora, tmp_path):
    from mmpt.export.card import open_clip_name

    release = demo_release(name, corpora, tmp_path, *extra)
    out = tmp_path / "for-open_clip"
    assert export(["--run", str(release), "--out", str(out), "--format", "open_clip", "--skip-check"]) == 0
    model_name = open_clip_name(out)
    card = (out / "README.md").read_text().split("### With open_clip\n\n```python\n", 1)[1]
    scope: dict = {}
    assert f'open_clip.add_model_config("{out}/{model_name}.json")' in card
    exec(card.split("```", 1)[0], scope)  # the lines the card gives, as they are
    loaded, preprocess = scope["model"], scope["preprocess"]
    model = mmpt.load(release)
    pre = model.preprocessors()
    images = digit_images(corpora["digits"])
    ours_pixels = torch.stack([pre["preprocess"](image) for image in images])
    assert torch.equal(torch.stack([preprocess(image) for image in images]), ours_pixels)
    tokens = pre["tokenizer"](CAPTIONS if name == "clip" else CAPTIONS[:1] + CAPTIONS[2:])
    theirs_ids = scope["tokenizer"](CAPTIONS if name == "clip" else CAPTIONS[:1] + CAPTIONS[2:])
    assert torch.equal(theirs_ids, tokens["input_ids"])  # the same tokenizer, truncation and padding
    with torch.no_grad():
        ours = model.encode_image(ours_pixels), model.encode_text(tokens["input_ids"], tokens["attention_mask"])
        theirs = loaded.encode_image(ours_pixels, normalize=True), loaded.encode_text(theirs_ids, normalize=True)
    for mine, open_clips in zip(ours, theirs):
        torch.testing.assert_close(open_clips, mine, rtol=0, atol=OPEN_CLIP_TOLERANCE)
    # and without registering anything: the folder as open_clip's local-dir
    exec(card.split("```python\n", 1)[1].split("```", 1)[0], scope)
    local, local_preprocess = scope["model"], scope["preprocess"]
    with torch.no_grad():
        features = local.encode_image(torch.stack([local_preprocess(i) for i in images]), normalize=True)
    torch.testing.assert_close(features, ours[0], rtol=0, atol=OPEN_CLIP_TOLERANCE)


def test_an_open_clip_vit_exports_as_a_clip_model_transformers_loads(corpora, tmp_path):
    """`--format transformers` of open_clip's plain ViT CLIP: transformers' CLIPModel, CLIPTokenizer and
    CLIPImageProcessor load the folder, tokenise as open_clip does (to the end token; padding differs) and give
    mmpt's image and text features from their own preprocessing."""
    import torch.nn.functional as F
    from transformers import CLIPImageProcessor, CLIPModel, CLIPTokenizer

    release = demo_release("open_clip", corpora, tmp_path)
    model = mmpt.load(release)
    out = tmp_path / "hf"
    assert export(["--run", str(release), "--out", str(out), "--format", "transformers"]) == 0
    loaded = CLIPModel.from_pretrained(out).eval()
    tokenizer, processor = CLIPTokenizer.from_pretrained(out), CLIPImageProcessor.from_pretrained(out)
    pre = model.preprocessors()
    captions = ["a handwritten digit seven", "the digit two  written   twice"]
    ours_ids = pre["tokenizer"](captions)["input_ids"]
    theirs_ids = tokenizer(captions, padding="max_length", max_length=ours_ids.shape[1], return_tensors="pt")
    for ours_row, theirs_row in zip(ours_ids, theirs_ids["input_ids"]):
        end = int(ours_row.argmax()) + 1
        assert torch.equal(ours_row[:end], theirs_row[:end])
    images = digit_images(corpora["digits"])
    pixels = processor(images=images, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        theirs_image = F.normalize(loaded.get_image_features(pixel_values=pixels).pooler_output, dim=-1)
        theirs_text = F.normalize(loaded.get_text_features(input_ids=theirs_ids["input_ids"]).pooler_output, dim=-1)
        ours_image = model.encode_image(torch.stack([pre["preprocess"](image) for image in images]))
        ours_text = model.encode_text(ours_ids, None)
    torch.testing.assert_close(theirs_text, ours_text, rtol=0, atol=1e-5)
    torch.testing.assert_close(theirs_image, ours_image, rtol=0, atol=1e-5)  # the same pixels from its processor
    assert loaded.logit_scale.item() == pytest.approx(model.model.clip.logit_scale.item())


def official_layout(size: str) -> list[tuple[str, list[int], str]]:
    rows = (REPO / f"tests/data/m2_encoder_{size}_state_dict.tsv").read_text().splitlines()
    return [(key, json.loads(shape), dtype) for key, shape, dtype in (row.split("\t") for row in rows)]


@pytest.mark.slow
def test_an_official_m2_checkpoint_goes_through_mmpt_and_back_bit_for_bit(tmp_path, glm_sp_model):
    """official .ckpt (the released 0.4B layout) -> mmpt model -> mmpt release -> --format official: the same
    keys in the same order, shapes, dtypes and bytes."""
    import shutil

    layout = official_layout("0.4b")
    generator = torch.Generator().manual_seed(0)
    official = {
        key: torch.randn(shape, generator=generator, dtype=getattr(torch, dtype)) for key, shape, dtype in layout
    }
    download = tmp_path / "M2-Encoder"
    download.mkdir()
    torch.save({"state_dict": official, "epoch": 3}, download / "m2_encoder_0.4b.ckpt")  # Lightning layout
    shutil.copyfile(glm_sp_model, download / "sp.model")
    del official

    model, _, _ = mmpt.create_model_and_transforms("m2-encoder-0.4b", pretrained=str(download))
    release = model.save_pretrained(tmp_path / "release")
    del model
    out = tmp_path / "official"
    assert export(["--run", str(release), "--out", str(out), "--format", "official"]) == 0
    (release / "model.safetensors").unlink(missing_ok=True)

    before = torch.load(download / "m2_encoder_0.4b.ckpt", mmap=True, weights_only=True)["state_dict"]
    after = torch.load(out / "m2_encoder.ckpt", mmap=True, weights_only=True)
    assert list(after) == ["state_dict"]
    after = after["state_dict"]
    assert [(k, list(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in after.items()] == layout
    for key, value in before.items():
        assert value.reshape(-1).view(torch.uint8).equal(after[key].reshape(-1).view(torch.uint8)), key
    assert (out / "sp.model").read_bytes() == glm_sp_model.read_bytes()
    # and mmpt reads it back as an official download
    again, _, _ = mmpt.create_model_and_transforms("m2-encoder-0.4b", pretrained=str(out))
    assert again.logit_scale.item() == before["logit_scale"].item()


def test_a_tiny_m2_run_exports_to_the_official_layout_and_loads_back(corpora, tmp_path):
    """The fast tier's round trip: a demo-sized M²-Encoder release -> official layout -> `load_official`."""
    from safetensors.torch import load_file

    from mmpt.models.m2_encoder import M2Encoder
    from mmpt.models.m2_official import load_official

    release = demo_release("m2_encoder", corpora, tmp_path)
    out = tmp_path / "official"
    assert export(["--run", str(release), "--out", str(out), "--format", "official"]) == 0
    saved = torch.load(out / "m2_encoder.ckpt", weights_only=True)["state_dict"]
    weights = load_file(str(release / "model.safetensors"))
    cfg = mmpt.load(release).config
    vocab = weights["backbone.text_embed.weight"].shape[0]
    with torch.device("meta"):
        order = list(M2Encoder(cfg.method.arch.model_copy(update={"vocab_size": vocab})).state_dict())
    assert list(saved) == order and saved["logit_scale"].dim() == saved["logit_vl_scale"].dim() == 0
    back = load_official(mmpt.load(release).model, out / "m2_encoder.ckpt").state_dict()
    for key, value in weights.items():
        assert torch.equal(back[key], value), key
    assert json.loads((out / "m2_encoder_arch.json").read_text())["width"] == cfg.method.arch.width


@pytest.fixture(scope="module")
def clip_run(corpora, one_process, tmp_path_factory):  # noqa: F811
    """A tiny clip run trained in this process: 2 steps, the digits zero-shot set evaluated at step 1 and at
    the end (in Chinese), and the end-of-training records of that set (`eval/*.json`)."""
    from mmpt.engine import train

    run_dir = tmp_path_factory.mktemp("clip-run") / "run"
    cfg = demo_config(
        "clip",
        corpora,
        run_dir,
        "train.zero_stage=0",
        "train.precision=fp32",
        "train.max_steps=2",
        "train.eval_every=1",
        "train.save_every=0",
    )
    train(cfg)
    return run_dir


def test_the_card_counts_a_single_sources_samples_and_says_when_a_run_ended_in_warmup(tmp_path):
    """A run of one source counts its samples in the totals alone (no per-source counts)."""
    from mmpt.config_loader import load_config
    from mmpt.export.card import training_section

    cfg = load_config(REPO / "configs/clip/demo.yaml", ['data.train.sources=[{shards: "a/*.tar"}]'])
    record = {"steps": 3, "samples": 192, "skipped": 0, "samples_per_source": {}}
    assert "| `a/*.tar` | 1 | 192 |" in training_section(cfg, record)
    # the schedule's lr is reached at the end of warmup (open_clip's (step + 1) / warmup)
    for steps, warmup, said in ((3, 4, True), (4, 4, False)):
        cfg.optim.warmup_steps = warmup
        text = training_section(cfg, {**record, "steps": steps})
        assert ("the run ended in warmup, that lr not reached" in text) == said, text


def test_every_release_carries_a_model_card_with_its_runs_evaluations(clip_run, tmp_path):
    release = tmp_path / "clip-demo"
    assert export(["--run", str(clip_run), "--out", str(release)]) == 0
    card = (release / "README.md").read_text()
    evaluations = [r for r in read_metrics(clip_run) if "lr" not in r and any("/" in k for k in r)]
    assert [r["step"] for r in evaluations][:2] == [1, 2]
    table = card.split("## Evaluation", 1)[1].split("\n## ", 1)[0]
    header = next(line for line in table.splitlines() if line.startswith("| metric |"))
    assert header.startswith("| metric | step 1 | step 2") and header.endswith("(final) |")
    for record in evaluations:
        for key, value in record.items():
            if key != "step" and not key.endswith("seconds"):
                row = next(line for line in table.splitlines() if line.startswith(f"| `{key}` |"))
                assert f"{value:.4f}" in row, (key, row)
    for path in (clip_run / "eval").glob("*.json"):  # the end-of-training records, CLIP_benchmark style
        record = json.loads(path.read_text())
        assert f"| {record['task']} | `{record['dataset']}` | {record['language']} |" in table
    model = mmpt.load(release)
    assert f"| parameters | {sum(p.numel() for p in model.parameters()):,} (all trainable) |" in card
    training = card.split("## Training data", 1)[1].split("\n## ", 1)[0]
    metrics = read_metrics(clip_run)
    samples = [r for r in metrics if "lr" in r][-1]["data/decoded"]
    assert "- steps: 2 (of `train.max_steps` 2)" in training and f"- samples trained on: {samples}" in training
    for section in ("## Intended use", "### With mmpt", "### With onnxruntime", "### With open_clip"):
        assert section in card
    # the facts travel with the release: saved again from it, the card is the same but for the folder name
    again = model.save_pretrained(tmp_path / "again")
    assert (again / "README.md").read_text() == card.replace("clip-demo", "again")
    # an export folder has its card too
    assert export(["--run", str(release), "--out", str(tmp_path / "onnx"), "--format", "onnx"]) == 0
    assert table in (tmp_path / "onnx" / "README.md").read_text()


def test_the_docs_show_the_card_as_save_release_writes_it(clip_run, corpora, tmp_path):
    """docs/releases.md shows the card of this fixture's run, its paths written as the demo's: the same sections
    and tables as a card written now. When the card changes, this fails with the new one to paste there."""
    release = tmp_path / "clip-demo"
    assert export(["--run", str(clip_run), "--out", str(release)]) == 0
    card = (release / "README.md").read_text()
    card = card.replace(str(release), "releases/clip-demo").replace(str(corpora["digits"]), "demo_data/digits")
    docs = (REPO / "docs" / "releases.md").read_text()
    begin, end = "<!-- the demo card: begin -->", "<!-- the demo card: end -->"
    shown = docs.split(begin, 1)[1].split(end, 1)[0] if begin in docs and end in docs else ""

    def outline(text: str) -> list[str]:
        heads = ("#", "| metric |", "| source |", "| file |", "| task |", "| method |", "| parameters |")
        return [line for line in text.splitlines() if line.startswith(heads)]

    assert outline(shown) == outline(card), f"docs/releases.md: paste the card between the markers:\n{card}"


def release_without_weights(tmp_path: Path, method: dict) -> Path:
    """A release folder with its config.json only: format checks read nothing else."""
    from mmpt.artifacts import RELEASE_FORMAT
    from mmpt.release import model_config

    cfg = model_config(method)
    folder = tmp_path / method["name"]
    folder.mkdir()
    record = {"format": RELEASE_FORMAT, "version": 1, "method": cfg.method_name, "config": cfg.to_dict()}
    (folder / "config.json").write_text(json.dumps(record))
    return folder


BAD_REQUESTS = {
    "victor-image-tower": (
        {"name": "victor", "tokenizer": "tokenizer.json"},
        ["--format", "onnx", "--towers", "image"],
        "the 'victor' model has no 'image' tower; its towers: video, text",
    ),
    "space2-text-tower": (
        {"name": "space2", "encoder": "bert"},
        ["--format", "onnx", "--towers", "dialog,text"],
        "the 'space2' model has no 'text' tower; its towers: dialog",
    ),
    "m2-open_clip": (
        {"name": "m2_encoder", "tokenizer": "sp.model"},
        ["--format", "open_clip"],
        "open_clip cannot build a 'm2_encoder' model",
    ),
    "space2-open_clip": ({"name": "space2", "encoder": "bert"}, ["--format", "open_clip"], "open_clip cannot build"),
    "clip-official": (
        {"name": "clip", "tokenizer": "tokenizer.json"},
        ["--format", "official"],
        "a 'clip' model has none",
    ),
    "clip-timm-kwargs-open_clip": (
        {
            "name": "clip",
            "tokenizer": "t.json",
            "image": {
                "timm_name": "vit_tiny_patch16_224",
                "image_size": 64,
                "timm_kwargs": {"img_size": 64, "depth": 2},
            },
        },
        ["--format", "open_clip"],
        "'method.image.timm_kwargs' sets depth, img_size",
    ),
    "open_clip-sigmoid-transformers": (
        {"name": "open_clip", "model": "ViT-B-32", "loss": {"name": "sigmoid"}},
        ["--format", "transformers"],
        "CLIPModel has no place for the logit bias the sigmoid loss trained",
    ),
    "clip-resnet-transformers": (
        {"name": "clip", "tokenizer": "tokenizer.json", "image": {"timm_name": "resnet10t"}},
        ["--format", "transformers"],
        "ChineseCLIPModel has no place for a ResNet image tower (it holds a ViT)",
    ),
    "clip-vit-without-pre-norm-transformers": (
        {"name": "clip", "tokenizer": "tokenizer.json", "text": {"pooling": "cls"}},
        ["--format", "transformers"],
        "no place for an image tower without a LayerNorm before the blocks (timm_kwargs pre_norm: true), a patch "
        "embedding without bias",
    ),
    "clip-mean-pooled-transformers": (
        {"name": "clip", "tokenizer": "tokenizer.json", "image": {"timm_kwargs": {"pre_norm": True}}},
        ["--format", "transformers"],
        "ChineseCLIPModel has no place for text features mean-pooled",
    ),
    "open_clip-resnet-transformers": (
        {"name": "open_clip", "model": "RN50"},
        ["--format", "transformers"],
        "CLIPModel has no place for a ResNet image tower",
    ),
    "unknown-format": (
        {"name": "clip", "tokenizer": "tokenizer.json"},
        ["--format", "tflite"],
        "unknown export format 'tflite': one of release, onnx, open_clip, official",
    ),
    "no-weights": (
        {"name": "clip", "tokenizer": "tokenizer.json"},
        [],
        "no model.safetensors and no complete checkpoint to export",
    ),
    "towers-without-onnx": (
        {"name": "clip", "tokenizer": "tokenizer.json"},
        ["--towers", "image"],
        "--towers applies to --format onnx, not to --format release",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_a_request_that_cannot_work_is_one_line_and_exit_2(case, tmp_path, capfd):
    from mmpt import cli

    method, args, message = BAD_REQUESTS[case]
    folder = release_without_weights(tmp_path, method)
    code = cli.run(export, ["--run", str(folder), "--out", str(tmp_path / "out"), *args])
    err = capfd.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("mmpt: ") and message in err, err
    assert not (tmp_path / "out").exists()


def test_onnx_without_its_extra_is_one_line_naming_what_to_install(tmp_path, capfd, monkeypatch):
    """Checked before any weight is read: onnxruntime is needed only to check the written files."""
    import importlib.util

    from mmpt import cli

    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "onnxruntime" else found(name))
    folder = release_without_weights(tmp_path, {"name": "clip", "tokenizer": "tokenizer.json"})
    code = cli.run(export, ["--run", str(folder), "--out", str(tmp_path / "out"), "--format", "onnx"])
    err = capfd.readouterr().err
    assert code == 2 and err == "mmpt: --format onnx needs onnxruntime: pip install -e '.[onnx]'\n", err
    assert not (tmp_path / "out").exists()
    code = cli.run(export, ["--run", str(folder), "--out", str(tmp_path / "out"), "--format", "onnx", "--skip-check"])
    assert "no model.safetensors" in capfd.readouterr().err  # past the check: nothing else is missing


def test_the_command_ends_a_bad_request_in_one_line_with_exit_code_2(tmp_path):
    folder = release_without_weights(tmp_path, {"name": "m2_encoder", "tokenizer": "sp.model"})
    result = subprocess.run(
        [sys.executable, str(REPO / "launch/export.py"), "--run", str(folder), "--out", str(tmp_path / "o")]
        + ["--format", "open_clip"],
        env=launcher_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert (
        result.stderr.startswith("mmpt: open_clip cannot build a 'm2_encoder' model") and result.stderr.count("\n") == 1
    )


@pytest.mark.parametrize("tokenizer", ["wordpiece", "glm"])
def test_an_m2_encoder_exports_as_a_folder_transformers_loads_with_its_own_code(
    tokenizer, corpora, glm_sp_model, tmp_path
):
    """`--format transformers` of an M²-Encoder: `AutoModel`, `AutoTokenizer` (the GLM tokenizer or the run's
    WordPiece one) and `AutoImageProcessor` load the folder with `trust_remote_code`, tokenise exactly as mmpt
    does and give mmpt's features from their own preprocessing; the folder's code imports nothing of mmpt."""
    from transformers import AutoImageProcessor, AutoModel, AutoTokenizer

    extra = ["method.tokenizer=" + str(glm_sp_model), "method.arch.vocab_size=null"] if tokenizer == "glm" else []
    release = demo_release("m2_encoder", corpora, tmp_path, *extra)
    assert 'AutoModel.from_pretrained("' in (card := (release / "README.md").read_text()), card
    assert "trust_remote_code=True" in card
    model = mmpt.load(release)
    out = tmp_path / "hf"
    assert export(["--run", str(release), "--out", str(out), "--format", "transformers"]) == 0
    code = {path.name: path.read_text() for path in out.glob("*.py")}
    assert {"modeling_m2_encoder.py", "network.py", "configuration_m2_encoder.py"} <= set(code)
    assert (tokenizer == "glm") == ("tokenization_m2_encoder.py" in code and "glm_tokenizer.py" in code)
    assert not [name for name, text in code.items() if re.search(r"^\s*(from|import) mmpt\b", text, re.M)]

    loaded = AutoModel.from_pretrained(out, trust_remote_code=True).eval()
    assert type(loaded).__module__.startswith("transformers_modules")
    tokens = AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    processor = AutoImageProcessor.from_pretrained(out, backend="pil")  # PIL's bicubic, as mmpt resizes
    pre = model.preprocessors()
    captions = ["a photo of a cat", "一只猫的照片  and   blanks", "the digit seven " * 20]
    ours_ids = pre["tokenizer"](captions)
    theirs_ids = tokens(captions, padding="max_length", truncation=True, return_tensors="pt")
    for key in ("input_ids", "attention_mask"):
        assert torch.equal(theirs_ids[key], ours_ids[key]), key
    images = [image.resize((45, 37)) for image in digit_images(corpora["digits"])]  # not the model's square size
    pixels = processor(images=images, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        theirs = loaded(
            input_ids=theirs_ids["input_ids"], attention_mask=theirs_ids["attention_mask"], pixel_values=pixels
        )
        ours_image = model.encode_image(torch.stack([pre["preprocess"](image) for image in images]))
        ours_text = model.encode_text(ours_ids["input_ids"], ours_ids["attention_mask"])
    torch.testing.assert_close(theirs.text_embeds, ours_text, rtol=0, atol=1e-5)
    torch.testing.assert_close(theirs.image_embeds, ours_image, rtol=0, atol=1e-5)
    scale = model.model.logit_scale.exp().item()
    torch.testing.assert_close(theirs.logits_per_image, scale * ours_image @ ours_text.t(), rtol=1e-5, atol=1e-5)


def test_a_clip_vit_with_a_bert_exports_as_a_chinese_clip_model_transformers_loads(corpora, tmp_path, monkeypatch):
    """`--format transformers` of the `clip` method (a timm ViT in CLIP's layout, a BERT pooled at [CLS]):
    transformers' ChineseCLIPModel, its tokenizer and image processor load the folder and give mmpt's features
    from their own preprocessing (what cannot be one is in BAD_REQUESTS)."""
    import torch.nn.functional as F
    from transformers import AutoImageProcessor, AutoTokenizer, ChineseCLIPModel

    vit = "method.image.timm_name=vit_tiny_patch16_224", "method.image.timm_kwargs={img_size: 32, pre_norm: true}"
    release = demo_release("clip", corpora, tmp_path, *vit, "method.text.pooling=cls")
    model = mmpt.load(release)
    out = Path(f"{release}-transformers")  # where the release's card exports it
    assert export(["--run", str(release), "--out", str(out), "--format", "transformers"]) == 0
    loaded = ChineseCLIPModel.from_pretrained(out).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    processor = AutoImageProcessor.from_pretrained(out, backend="pil")
    pre = model.preprocessors()
    captions = ["a handwritten digit seven", "手写的数字二"]
    ours_ids = pre["tokenizer"](captions)
    theirs_ids = tokenizer(captions, padding="max_length", truncation=True, return_tensors="pt")
    assert torch.equal(theirs_ids["input_ids"], ours_ids["input_ids"])
    images = [image.resize((45, 37)) for image in digit_images(corpora["digits"])]
    pixels = processor(images=images, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        text = loaded.get_text_features(input_ids=theirs_ids["input_ids"], attention_mask=theirs_ids["attention_mask"])
        image = loaded.get_image_features(pixel_values=pixels)
        ours_image = model.encode_image(torch.stack([pre["preprocess"](image) for image in images]))
        ours_text = model.encode_text(ours_ids["input_ids"], ours_ids["attention_mask"])
    torch.testing.assert_close(F.normalize(text.pooler_output, dim=-1), ours_text, rtol=0, atol=1e-5)
    torch.testing.assert_close(F.normalize(image.pooler_output, dim=-1), ours_image, rtol=0, atol=1e-5)
    # the release card's lines, as they are, give mmpt's embeddings
    card = (release / "README.md").read_text().split("### With transformers\n", 1)[1]
    monkeypatch.chdir(tmp_path)
    images[0].save("cat.jpg")
    scope: dict = {}
    exec(card.split("```python\n", 1)[1].split("```", 1)[0], scope)
    with torch.no_grad():
        tokens = pre["tokenizer"](["a photo of a cat"])
        ours_text = model.encode_text(tokens["input_ids"], tokens["attention_mask"])
        ours_image = model.encode_image(pre["preprocess"](Image.open("cat.jpg").convert("RGB")).unsqueeze(0))
    torch.testing.assert_close(scope["text_features"], ours_text, rtol=0, atol=1e-5)
    torch.testing.assert_close(scope["image_features"], ours_image, rtol=0, atol=1e-5)
