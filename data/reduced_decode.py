"""A training transform that starts with a RandomResizedCrop, run from image bytes, decoding JPEGs at reduced size.

A 224 px crop of a 1000 px photo needs a fraction of the photo's pixels, yet a full decode pays for all of them.
libjpeg can decode at 1/2, 1/4 or 1/8 of the size straight from the DCT coefficients (PIL's `Image.draft`),
which costs a fraction of a full decode. The crop box is drawn first, on the full-size geometry with the same
random draws as torchvision's `RandomResizedCrop` (the image's size is in its header: nothing is decoded yet),
so the distribution of crops is the one the transform always had. The image is then decoded at the largest
reduction that leaves the box at least the output size in pixels, and the box, scaled to the reduced image,
is resampled to the output size with the crop's own interpolation (PIL's, antialiased). The steps after the
crop (flips, RandAugment, placement, `PILToTensor`) run as before on the cropped image.

Other formats (PNG, WebP), and JPEGs whose box is too small to reduce, take the crop on the full decode
exactly as torchvision does, so their pixels are unchanged.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any, cast

from PIL import Image
from torchvision import transforms as T
from torchvision.transforms import functional as F

REDUCTIONS = (8, 4, 2)  # the DCT scalings libjpeg offers, largest first


def reduction_for(box_height: int, box_width: int, out_height: int, out_width: int) -> int:
    """The largest DCT reduction (8, 4, 2, or 1: none) leaving a box of this size at least `out` pixels."""
    for factor in REDUCTIONS:
        if box_height >= factor * out_height and box_width >= factor * out_width:
            return factor
    return 1


class ReducedDecodeCrop:
    """Image bytes -> `transform`'s output, where `transform` is a Compose whose first step is a RandomResizedCrop.

    `decode` is the full decode used for everything that is not reduced (it must load the pixels now and
    give RGB, as `mmpt.data.image_text.decode_image` does). Picklable, for loader workers.
    """

    def __init__(self, transform: T.Compose, decode: Callable[[bytes], Image.Image]):
        if not fits(transform):
            raise ValueError(f"expected a torchvision Compose starting with RandomResizedCrop, got {transform!r}")
        self.crop: T.RandomResizedCrop = transform.transforms[0]
        self.rest = T.Compose(transform.transforms[1:])
        self.decode = decode
        self.resample = F.pil_modes_mapping[self.crop.interpolation]

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
        out_height, out_width = self.crop.size
        full_width, full_height = image.size
        factor = reduction_for(height, width, out_height, out_width) if image.format == "JPEG" else 1
        drafted = factor > 1 and image.draft("RGB", (full_width // factor, full_height // factor))
        if not drafted:
            full = cast(Any, self.decode(data))
            size = [out_height, out_width]
            return cast(Image.Image, F.resized_crop(full, top, left, height, width, size, self.crop.interpolation))
        scale = full_width / drafted[1][2]  # the reduction PIL chose: the full size over the reduced one
        image.load()  # truncated or damaged bytes fail here, as a full decode would
        box = (left / scale, top / scale, (left + width) / scale, (top + height) / scale)
        rgb = image if image.mode == "RGB" else image.convert("RGB")
        return rgb.resize((out_width, out_height), self.resample, box=box)


def fits(transform: Any) -> bool:
    """Whether `transform` is a Compose that starts with a RandomResizedCrop (what `ReducedDecodeCrop` runs)."""
    steps = getattr(transform, "transforms", None)
    return isinstance(transform, T.Compose) and bool(steps) and isinstance(steps[0], T.RandomResizedCrop)
