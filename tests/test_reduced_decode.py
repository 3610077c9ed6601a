"""The reduced-size JPEG decode of the training transforms: the same crops as torchvision's RandomResizedCrop,
pixels close to a full decode's, and everything it does not apply to left exactly as it was."""

from __future__ import annotations

import io
from typing import Any, cast

import numpy as np
import pytest
import torch
from open_clip import image_transform
from PIL import Image
from torchvision import transforms as T

from mmpt.data import reduced_decode
from mmpt.data.image_text import ImageTextDecoder, decode_image, training_image_decode, uint8_transform
from mmpt.data.reduced_decode import ReducedDecodeCrop, decode_reduced, reduction_for

SEEDS = range(40)


def photo_like(width: int, height: int, seed: int = 0) -> Image.Image:
    """Smooth shading, edges and grain: enough structure that a crop off by a few pixels shows."""
    rng = np.random.default_rng(seed)
    coarse = Image.fromarray(rng.integers(0, 256, (12, 16, 3), dtype=np.uint8)).resize((width, height))
    pixels = np.asarray(coarse, np.float32) + rng.normal(0, 6, (height, width, 3))
    pixels[: height // 3, ::40] = 255  # vertical lines: sharp edges to misplace
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def encoded(image: Image.Image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def jpeg() -> bytes:
    return encoded(photo_like(1200, 900), "JPEG", quality=90)


def crop_then(size: int, scale: tuple[float, float] = (0.08, 1.0)) -> T.Compose:
    crop = T.RandomResizedCrop(size, scale=scale, interpolation=T.InterpolationMode.BICUBIC)
    return T.Compose([crop, T.PILToTensor()])


class Recorder:
    """A full decode that counts its calls, standing in for `decode_image`."""

    def __init__(self):
        self.calls = 0

    def __call__(self, data: bytes) -> Image.Image:
        self.calls += 1
        return decode_image(data)


def test_reduction_is_the_largest_leaving_the_crop_at_least_the_output_size():
    assert reduction_for(900, 1000, 112, 112) == 8
    assert reduction_for(895, 1000, 112, 112) == 4  # 895 / 8 < 112
    assert reduction_for(448, 500, 224, 224) == 2
    assert reduction_for(447, 2000, 224, 224) == 1


def test_the_crop_box_and_later_draws_are_torchvisions(jpeg):
    """Same seed: the reduced decode reads the same box of the full image, and leaves the generator where
    torchvision's crop leaves it (so the flips and RandAugment after it draw the same)."""
    crop = T.RandomResizedCrop(112, scale=(0.08, 1.0))
    reduced = ReducedDecodeCrop(T.Compose([crop]), decode_image)
    full = decode_image(jpeg)
    factors = set()
    for seed in SEEDS:
        torch.manual_seed(seed)
        box = reduced.crop_box(Image.open(io.BytesIO(jpeg)))
        after = torch.rand(3)
        torch.manual_seed(seed)
        assert box == T.RandomResizedCrop.get_params(cast(Any, full), list(crop.scale), list(crop.ratio)), seed
        torch.testing.assert_close(after, torch.rand(3), rtol=0, atol=0)
        factors.add(reduction_for(box[2], box[3], 112, 112))
    assert {2, 4, 8} <= factors  # the seeds reach every reduction


@pytest.mark.parametrize("size", [112, 224])
def test_reduced_decode_is_close_to_the_full_decode_of_the_same_box(jpeg, size):
    transform = crop_then(size)
    full_decode = Recorder()
    reduced = ReducedDecodeCrop(transform, full_decode)
    differences = []
    for seed in range(12):
        torch.manual_seed(seed)
        fast: torch.Tensor = reduced(jpeg)
        torch.manual_seed(seed)
        slow = cast(torch.Tensor, transform(decode_image(jpeg)))
        assert fast.dtype == torch.uint8 and fast.shape == slow.shape == (3, size, size)
        differences.append((fast.float() - slow.float()).abs().mean().item())
    assert full_decode.calls == 0  # JPEGs are decoded here, at reduced size
    assert max(differences) < 3.0, differences  # of 255: the DCT downscale, the box on the reduced grid
    assert np.mean(differences) < 2.0, differences


def test_png_gets_torchvisions_exact_pixels_and_small_jpeg_crops_within_two():
    """Formats without DCT scaling take torchvision's crop of the full decode: pixels unchanged. A JPEG crop too
    small to reduce is a full decode resized by torch's resampler: PIL's filter, within 2 of 255."""
    png = encoded(photo_like(300, 200, seed=1), "PNG")
    small_jpeg = encoded(photo_like(300, 200, seed=2), "JPEG", quality=90)
    transform = crop_then(224)
    for data, decodes, tolerance in ((png, 5, 0), (small_jpeg, 0, 2)):
        full_decode = Recorder()
        reduced = ReducedDecodeCrop(transform, full_decode)
        for seed in range(5):
            torch.manual_seed(seed)
            fast = reduced(data)
            torch.manual_seed(seed)
            slow = cast(torch.Tensor, transform(decode_image(data)))
            torch.testing.assert_close(fast, slow, rtol=0, atol=tolerance)
            assert (fast.float() - slow.float()).abs().mean() < 0.05
        assert full_decode.calls == decodes


def test_grey_and_damaged_jpegs():
    grey = encoded(photo_like(1000, 800).convert("L"), "JPEG", quality=90)
    torch.manual_seed(0)
    assert ReducedDecodeCrop(crop_then(64, scale=(0.9, 1.0)), decode_image)(grey).shape == (3, 64, 64)
    cut = encoded(photo_like(1000, 800), "JPEG", quality=90)[:20_000]
    with pytest.raises(OSError):  # counted as undecodable by the loader, as a full decode would be
        ReducedDecodeCrop(crop_then(64, scale=(0.9, 1.0)), decode_image)(cut)


@pytest.mark.parametrize("mode, subsampling", [("RGB", "4:2:0"), ("RGB", "4:4:4"), ("L", None), ("CMYK", None)])
def test_the_reduced_decode_gives_pils_draft_pixels_bit_for_bit(monkeypatch, mode, subsampling):
    """simplejpeg decodes YCbCr and grey JPEGs (its pixels are PIL's draft's); PIL decodes the rest (CMYK)."""
    calls = []
    decode = reduced_decode.simplejpeg.decode_jpeg
    monkeypatch.setattr(reduced_decode.simplejpeg, "decode_jpeg", lambda *a, **k: calls.append(1) or decode(*a, **k))
    options = {"subsampling": subsampling} if subsampling else {}
    data = encoded(photo_like(1013, 771, seed=3).convert(mode), "JPEG", quality=90, **options)
    for factor in (1, 2, 4, 8):
        at_least = (1013 // factor, 771 // factor) if factor > 1 else (0, 0)
        pil = Image.open(io.BytesIO(data))
        if factor > 1:
            pil.draft("RGB", at_least)
        expected = np.asarray(pil.convert("RGB"))
        got = np.asarray(decode_reduced(data, Image.open(io.BytesIO(data)), at_least))
        assert got.shape == expected.shape and (got == expected).all(), (mode, factor)
    assert len(calls) == (0 if mode == "CMYK" else 4)


def test_training_transforms_take_it_and_others_do_not(jpeg):
    """open_clip's and M2-Encoder's training transforms start with the crop; evaluation transforms are left alone."""
    m2_like = T.Compose(
        [
            T.RandomResizedCrop(224, scale=(0.8, 1.0), interpolation=T.InterpolationMode.BICUBIC),
            T.RandomHorizontalFlip(),
            T.RandAugment(num_ops=2, magnitude=7),
            T.ToTensor(),
            T.Normalize((0.5,) * 3, (0.5,) * 3),
        ]
    )
    for train in (cast(T.Compose, image_transform(224, is_train=True)), m2_like):
        assert isinstance(training_image_decode(uint8_transform(train)), ReducedDecodeCrop)
    evaluation = uint8_transform(cast(T.Compose, image_transform(224, is_train=False)))
    assert training_image_decode(evaluation) is evaluation

    def tokenize(texts: list[str]) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.zeros(1, 4, dtype=torch.long), "attention_mask": torch.ones(1, 4, dtype=torch.long)}

    decoder = ImageTextDecoder(training_image_decode(uint8_transform(m2_like)), tokenize)
    sample = decoder({"__key__": "k", "jpg": jpeg, "txt": b"a photo"})
    assert sample["image"].dtype == torch.uint8 and sample["image"].shape == (3, 224, 224)
