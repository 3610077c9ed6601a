"""A training transform that starts with a RandomResizedCrop, run from image bytes, decoding JPEGs at reduced size.

A 224 px crop of a 1000 px photo needs a fraction of the photo's pixels, yet a full decode pays for all of them.
libjpeg can decode at 1/2, 1/4 or 1/8 of the size straight from the DCT coefficients, which costs a fraction
of a full decode (not the entropy decoding, which every scale pays). simplejpeg runs that decode (libjpeg-turbo,
the same pixels as PIL's `Image.draft` to the bit, ~17% more images per core: benchmarks/results/jpeg_decoders.md);
PIL decodes the JPEGs simplejpeg would convert differently (CMYK) or refuses. The crop box is
drawn first, on the full-size geometry with the same random draws as torchvision's `RandomResizedCrop` (the
image's size is in its header: nothing is decoded yet), so the distribution of crops is the one the transform
always had. The image is then decoded at the largest reduction that leaves the box at least the output size in
pixels, and the box, scaled to the reduced image and rounded to its pixels, is resized to the output size with
the crop's own interpolation, antialiased. Bilinear and bicubic resizing run on torch's uint8 resampler (Pillow's
filters, vectorised: within 2 of 255 of PIL's resize and several times faster), JPEGs too small to reduce
included. The steps after the crop (flips, RandAugment, placement, `PILToTensor`) run as before on the crop.

Other formats (PNG, WebP) take the crop on the full decode exactly as torchvision does: their pixels are unchanged.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import simplejpeg
import torch
from PIL import Image
from torchvision import transforms as T
from torchvision.transforms import functional as F

REDUCTIONS = (8, 4, 2)  # the DCT scalings libjpeg offers, largest first
TORCH_MODES = {T.InterpolationMode.BILINEAR: "bilinear", T.InterpolationMode.BICUBIC: "bicubic"}


def reduction_for(box_height: int, box_width: int, out_height: int, out_width: int) -> int:
    """The largest DCT reduction (8, 4, 2, or 1: none) leaving a box of this size at least `out` pixels."""
    for factor in REDUCTIONS:
        if box_height >= factor * out_height and box_width >= factor * out_width:
            return factor
    return 1


class ReducedDecodeCrop:
    """Image bytes -> `transform`'s output, where `transform` is a Compose whose first step is a RandomResizedCrop.

    `decode` is the full decode of the formats that are not JPEG (it must load the pixels now and give RGB, as
    `mmpt.data.image_text.decode_image` does). Picklable, for loader workers.
    """

    def __init__(self, transform: T.Compose, decode: Callable[[bytes], Image.Image]):
        if not fits(transform):
            raise ValueError(f"expected a torchvision Compose starting with RandomResizedCrop, got {transform!r}")
        self.crop: T.RandomResizedCrop = transform.transforms[0]
        self.rest = T.Compose(transform.transforms[1:])
        self.decode = decode

    def __call__(self, data: bytes) -> Any:
        return self.rest(self.crop_image(data))

    def crop_box(self, image: Image.Image) -> tuple[int, int, int, int]:
        """(top, left, height, width) on the full-size image: torchvision's draws, from the size in the header."""
        # torchvision's annotations name tensors only; its functions take PIL images as well
        return T.RandomResizedCrop.get_params(cast(Any, image), list(self.crop.scale), list(self.crop.ratio))

    def crop_image(self, data: bytes) -> Image.Image:
        """The crop step alone: the output-size RGB crop, with the random draws the RandomResizedCrop makes."""
        image = Image.open(io.BytesIO(data))  # reads the header only: size and format
        top, left, height, width = self.crop_box(image)
        size = (int(self.crop.size[0]), int(self.crop.size[1]))  # (height, width)
        if image.format != "JPEG":
            full = cast(Any, self.decode(data))
            return cast(
                Image.Image, F.resized_crop(full, top, left, height, width, list(size), self.crop.interpolation)
            )
        factor, full_width = reduction_for(height, width, *size), image.width
        reduced = (full_width // factor, image.height // factor) if factor > 1 else (0, 0)
        pixels = decode_reduced(data, image, reduced)
        scale = full_width / pixels.shape[1]  # the reduction the decoder chose: full size over reduced
        box = reduced_box((left, top, left + width, top + height), scale, (pixels.shape[1], pixels.shape[0]))
        return resample(pixels, box, size, self.crop.interpolation)


def decode_reduced(data: bytes, header: Image.Image, at_least: tuple[int, int]) -> np.ndarray:
    """The JPEG `data` (opened as `header`) as RGB pixels [H, W, 3], reduced by the largest DCT scaling that keeps
    it at least `at_least` (width, height) ((0, 0): whole). Truncated or damaged bytes fail here, as a full decode
    would."""
    if header.mode in ("RGB", "L"):  # YCbCr or grey: simplejpeg's pixels are PIL's
        try:
            width, height = at_least
            return simplejpeg.decode_jpeg(data, colorspace="RGB", min_width=width, min_height=height)
        except ValueError:  # what it refuses, PIL decodes or rejects with its own error
            pass
    if at_least != (0, 0):
        header.draft("RGB", at_least)
    header.load()
    return np.asarray(header if header.mode == "RGB" else header.convert("RGB"))


def reduced_box(box: tuple[int, int, int, int], scale: float, bounds: tuple[int, int]) -> tuple[int, int, int, int]:
    """(left, top, right, bottom) of a full-size box on an image reduced `scale` times, rounded to whole pixels
    (at most half a reduced pixel off, under half an output pixel) and kept at least one pixel inside `bounds`."""
    left, top, right, bottom = (round(edge / scale) for edge in box)
    left, top = min(left, bounds[0] - 1), min(top, bounds[1] - 1)
    return left, top, min(max(right, left + 1), bounds[0]), min(max(bottom, top + 1), bounds[1])


def resample(pixels: np.ndarray, box: tuple[int, int, int, int], size: tuple[int, int], mode: T.InterpolationMode):
    """`box` of RGB pixels [H, W, 3] resized to `size` (height, width) with `mode`, antialiased, as an RGB image.

    Bilinear and bicubic run on torch's uint8 antialiased resampler (Pillow's filters vectorised: within 2 of 255
    of PIL's resize, several times faster); other modes on PIL's.
    """
    name = TORCH_MODES.get(mode)
    if name is None:
        return Image.fromarray(pixels).resize((size[1], size[0]), F.pil_modes_mapping[mode], box=box)
    left, top, right, bottom = box
    crop = torch.from_numpy(np.ascontiguousarray(pixels[top:bottom, left:right])).permute(2, 0, 1)[None]
    out = torch.nn.functional.interpolate(crop, size=size, mode=name, antialias=True)  # channels-last [1, 3, h, w]
    return Image.fromarray(out[0].permute(1, 2, 0).contiguous().numpy())


def fits(transform: Any) -> bool:
    """Whether `transform` is a Compose that starts with a RandomResizedCrop (what `ReducedDecodeCrop` runs)."""
    steps = getattr(transform, "transforms", None)
    return isinstance(transform, T.Compose) and bool(steps) and isinstance(steps[0], T.RandomResizedCrop)
