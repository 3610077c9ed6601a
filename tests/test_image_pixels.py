"""Image-text training images cross the loader workers as uint8 and are normalised on the device.

What must hold for every image-text method: the batch its model reads equals what the float pipeline
(ToTensor + Normalize in the worker, then the engine's cast to the training precision) gave, computed
here independently from the same images and the same augmentation draws; and pinning batches for the GPU
leaves their non-tensor items as they were.
"""

import io
from collections import namedtuple

import numpy as np
import open_clip
import pytest
import torch
from PIL import Image
from torch.utils.data._utils.pin_memory import pin_memory as dataloader_pin
from torchvision import transforms as T

import mmpt.data.loader as loader_module
from conftest import REPO
from mmpt.config_loader import validate_config
from mmpt.data import BatchStream, ShardSetWriter, Source, StatefulLoader, StreamSpec
from mmpt.data.image_text import decode_image
from mmpt.methods import get_method

OPEN_CLIP_CONFIG = str(REPO / "mmpt/models/bench-vit-tiny.json")
CLIP_MEAN, CLIP_STD = (
    (0.41, 0.52, 0.63),
    (0.21, 0.27, 0.33),
)  # not the defaults: the config's values must reach the model


PLACEMENT = {"affine_scale": [0.6, 1.4], "affine_translate": 0.15}


def placement():
    return T.RandomAffine(
        degrees=0, translate=(0.15, 0.15), scale=(0.6, 1.4), interpolation=T.InterpolationMode.BILINEAR, fill=0
    )


def old_clip_transform():
    """open_clip's training transform with the random placement before ToTensor."""
    steps = open_clip.image_transform(32, is_train=True, mean=CLIP_MEAN, std=CLIP_STD).transforms
    return T.Compose([*steps[:-2], placement(), *steps[-2:]])


def old_open_clip_transform():
    return open_clip.image_transform(
        64, is_train=True, mean=open_clip.OPENAI_DATASET_MEAN, std=open_clip.OPENAI_DATASET_STD
    )


def old_m2_transform():
    return T.Compose(
        [
            T.RandomResizedCrop(32, scale=(0.8, 1.0), interpolation=T.InterpolationMode.BICUBIC),
            T.RandomHorizontalFlip(),
            T.RandAugment(num_ops=2, magnitude=7),
            placement(),
            T.ToTensor(),
            T.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
        ]
    )


# method section (the tokenizer added later), the module that first reads the images, the float pipeline before
METHODS = {
    "clip": (
        {
            "name": "clip",
            "embed_dim": 32,
            "image": {"timm_name": "resnet10t", "image_size": 32},
            "text": {"width": 32, "layers": 1, "heads": 2, "context_length": 16},
            "image_mean": list(CLIP_MEAN),
            "image_std": list(CLIP_STD),
            "augment": PLACEMENT,
        },
        lambda model: model.visual,
        old_clip_transform,
    ),
    "open_clip": (
        {"name": "open_clip", "model": OPEN_CLIP_CONFIG},
        lambda model: model.clip.visual,
        old_open_clip_transform,
    ),
    "m2_encoder": (
        {"name": "m2_encoder", "model": "m2-encoder-demo", "augment": PLACEMENT},
        lambda model: model.backbone.vision_embed,
        old_m2_transform,
    ),
}


@pytest.fixture(scope="module")
def colour_shards(module_tmp):
    """Twelve RGB images of different sizes, noise over colour gradients, so every augmentation shows."""
    folder = module_tmp("colour")
    rng = np.random.default_rng(0)
    with ShardSetWriter(folder / "colour", max_samples=6) as writer:
        for i in range(12):
            height, width = 36 + 3 * i, 52 - 2 * i
            ramp = np.linspace(0, 255, width)[None, :, None] * rng.uniform(0.2, 1.0, size=(1, 1, 3))
            pixels = np.clip(ramp + rng.normal(0, 40, size=(height, width, 3)), 0, 255).astype(np.uint8)
            buffer = io.BytesIO()
            Image.fromarray(pixels, mode="RGB").save(buffer, format="PNG")
            writer.write({"__key__": f"{i:04d}", "png": buffer.getvalue(), "txt": f"colour picture {i}"})
    return str(folder / "colour-*.tar")


def make_config(method, digits_root, shards, run_dir, workers):
    section, _, _ = METHODS[method]
    if method != "open_clip":
        section = {**section, "tokenizer": str(digits_root / "tokenizer.json")}
    return validate_config(
        {
            "method": section,
            "data": {
                "train": {
                    "sources": [{"shards": shards}],
                    "batch_size": 5,
                    "num_workers": workers,
                    "shuffle_buffer": 4,
                    "mode": "epoch",
                }
            },
            "optim": {"lr": 1e-3},
            "train": {"max_steps": 1, "grad_clip": 1.0, "seed": 3},
            "run": {"output_dir": str(run_dir), "progress_bar": False, "tensorboard": False},
        }
    )


def training_stream(method, digits_root, shards, run_dir, workers):
    cfg = make_config(method, digits_root, shards, run_dir, workers)
    run_dir.mkdir(exist_ok=True)
    implementation = get_method(method)
    implementation.prepare(cfg, run_dir)
    return cfg, implementation, implementation.train_data(cfg, run_dir, rank=0, world_size=1)


class Seen(Exception):
    """Stops a step once the image tower has its input: what it read is all these tests look at."""


def images_the_model_reads(model, tower, call):
    def stop(module, args):
        raise Seen(args[0])

    handle = tower(model).register_forward_pre_hook(stop)
    try:
        call()
    except Seen as seen:
        return seen.args[0]
    finally:
        handle.remove()
    raise AssertionError("the image tower was never called")


@pytest.mark.parametrize("method", sorted(METHODS))
def test_the_model_reads_what_the_float_pipeline_gave(tmp_path, digits_root, colour_shards, method):
    _, tower, old_transform = METHODS[method]
    cfg, implementation, stream = training_stream(method, digits_root, colour_shards, tmp_path / "run", workers=0)
    drawn = []  # (image bytes, RNG state) of every sample as the loader decodes it
    decode = stream.decode

    def recording_decode(raw):
        drawn.append((raw["png"], torch.random.get_rng_state()))
        return decode(raw)

    stream.decode = recording_decode
    batch = next(iter(StatefulLoader(stream)))
    assert batch["image"].dtype == torch.uint8 and len(drawn) == len(batch["image"]) == 5

    def old_pipeline(transform):
        """The same augmentation draws on the same images, finished by ToTensor + Normalize as before."""
        images = []
        with torch.random.fork_rng(devices=[]):
            for data, state in drawn:
                torch.random.set_rng_state(state)
                images.append(transform(decode_image(data)))
        return torch.stack(images)

    expected = old_pipeline(old_transform())
    assert expected.dtype == torch.float32
    model = implementation.build_model(cfg, tmp_path / "run")
    for dtype in (torch.float32, torch.bfloat16):  # the dtypes the engine trains image-text models in on CPU
        model.to(dtype)
        seen = images_the_model_reads(model, tower, lambda: implementation.training_step(model, None, batch))
        assert seen.dtype == dtype and seen.shape == expected.shape
        torch.testing.assert_close(seen.float(), expected.to(dtype).float(), rtol=0, atol=1e-6)
        needs = implementation.engine_needs(model, cfg)
        if needs.pool_features is not None:  # GBA-ITC's pool pass reads the same images
            pooled = images_the_model_reads(model, tower, lambda: needs.pool_features(model, batch))
            torch.testing.assert_close(pooled, seen, rtol=0, atol=0)

    # Batches built by hand with normalised floats (as the engine tests do) are read as they are.
    model.float()
    seen = images_the_model_reads(
        model, tower, lambda: implementation.training_step(model, None, {**batch, "image": expected})
    )
    assert seen is expected
    # What a released model's users call stays open_clip's: float, normalised, the same augmentation for training.
    preprocessors = implementation.preprocessors(cfg, tmp_path / "run")
    torch.testing.assert_close(old_pipeline(preprocessors["preprocess_train"]), expected, rtol=0, atol=0)
    assert preprocessors["preprocess"](decode_image(drawn[0][0])).dtype == torch.float32


@pytest.mark.parametrize("method", sorted(METHODS))
def test_loader_workers_send_uint8_images(tmp_path, digits_root, colour_shards, method):
    _, _, stream = training_stream(method, digits_root, colour_shards, tmp_path / "run", workers=1)
    batch = next(iter(StatefulLoader(stream)))
    size = 64 if method == "open_clip" else 32
    assert batch["image"].dtype == torch.uint8 and batch["image"].shape == (5, 3, size, size)
    _, _, in_process = training_stream(method, digits_root, colour_shards, tmp_path / "run", workers=0)
    assert torch.equal(next(iter(StatefulLoader(in_process)))["image"], batch["image"])


Pair = namedtuple("Pair", "tensor name")


def mixed_batch(samples):
    """A batch with tensors among items that are not: labels and ids as a dialog batch has them, a tuple, a
    named tuple, a per-source sub-batch."""
    values = torch.tensor([s["value"] for s in samples])
    return {
        "values": values,
        "label": [{"intent": "book", "slots": ["date"]} for _ in samples],
        "id": [s["key"] for s in samples],
        "shape": (len(samples), 1),
        "pair": Pair(values * 2, "doubled"),
        "source": {"tokens": values[:, None].repeat(1, 3), "note": None},
    }


def test_pinning_pins_the_batch_tensors_and_keeps_everything_else(tmp_path, monkeypatch):
    with ShardSetWriter(tmp_path / "mixed", max_samples=4) as writer:
        for i in range(4):
            writer.write({"__key__": f"k{i}", "txt": str(i)})
    spec = StreamSpec(
        [Source.from_pattern(str(tmp_path / "mixed-*.tar"))], batch_size=4, shuffle_buffer=0, mode="epoch", max_epochs=1
    )
    dataset = BatchStream(spec, lambda raw: {"value": int(raw["txt"]), "key": raw["__key__"]}, mixed_batch)
    delivery = next(iter(dataset))
    pinned_ids = set()

    def pin(tensor):  # stands for page-locking, which needs a GPU
        copy = tensor.clone()
        pinned_ids.add(id(copy))
        return copy

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    pinned = dataloader_pin(delivery)  # what the DataLoader's pinning thread does with each item
    batch, before = pinned.batch, delivery.batch
    for tensor in (batch["values"], batch["pair"].tensor, batch["source"]["tokens"]):
        assert id(tensor) in pinned_ids
    assert torch.equal(batch["values"], before["values"]) and torch.equal(
        batch["source"]["tokens"], before["source"]["tokens"]
    )
    assert batch["label"] == before["label"] and batch["id"] == before["id"] == ["k0", "k1", "k2", "k3"]
    assert type(batch["shape"]) is tuple and batch["shape"] == (4, 1)
    assert type(batch["pair"]) is Pair and batch["pair"].name == "doubled"
    assert batch["source"]["note"] is None
    assert pinned.position is delivery.position  # the stream position is not walked
    assert len(pinned_ids) == 3


@pytest.mark.parametrize("cuda", [False, True])
def test_the_loader_pins_when_there_is_a_gpu(tmp_path, monkeypatch, cuda):
    with ShardSetWriter(tmp_path / "few", max_samples=4) as writer:
        for i in range(4):
            writer.write({"__key__": f"k{i}", "txt": str(i)})
    built, pinned_ids = [], set()

    class RecordingDataLoader(loader_module.DataLoader):
        def __init__(self, *args, **kwargs):
            built.append(kwargs.get("pin_memory", False))
            super().__init__(*args, **kwargs)

    def pin(tensor):
        copy = tensor.clone()
        pinned_ids.add(id(copy))
        return copy

    monkeypatch.setattr(loader_module, "DataLoader", RecordingDataLoader)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)  # torch's DataLoader asks it too
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    spec = StreamSpec([Source.from_pattern(str(tmp_path / "few-*.tar"))], batch_size=2, shuffle_buffer=0)
    batch = next(iter(StatefulLoader(BatchStream(spec, lambda raw: {"value": torch.tensor(int(raw["txt"]))}))))
    assert built == [cuda] and batch["value"].shape == (2,)
    assert (id(batch["value"]) in pinned_ids) == cuda  # pinned through the DataLoader's own pinning path


def test_random_placement_moves_and_resizes_and_is_off_by_default():
    from mmpt.methods.image_text import PlacementAugment

    base = T.Compose([T.ToTensor(), T.Normalize((0.5,), (0.5,))])
    assert PlacementAugment().apply_to(base) is base
    square = Image.new("L", (32, 32))
    square.paste(255, (8, 8, 24, 24))  # 16 px wide, centred
    transform = PlacementAugment(affine_scale=(0.6, 1.4), affine_translate=0.15).apply_to(base)
    assert isinstance(transform.transforms[0], T.RandomAffine) and transform.transforms[1:] == base.transforms
    widths, centres = [], []
    torch.manual_seed(0)
    for _ in range(40):
        columns = torch.nonzero(transform(square)[0].amax(dim=0) > 0)[:, 0].float()
        widths.append(columns.max() - columns.min() + 1)
        centres.append((columns.max() + columns.min()) / 2)
    widths, centres = torch.stack(widths), torch.stack(centres)
    assert widths.min() <= 12 and widths.max() >= 19  # scaled by 0.6-1.4: 10-22 px
    assert centres.min() <= 13 and centres.max() >= 18  # shifted by up to 0.15 * 32 = 4.8 px
