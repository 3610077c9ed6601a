"""Image-text samples: decode image bytes and caption, apply the image transform, tokenize."""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from typing import Any

import torch
from PIL import Image

from mmpt.data.loader import MissingFieldError

IMAGE_FIELDS = ("jpg", "jpeg", "png", "webp")
TEXT_FIELDS = ("txt", "text", "caption")


def pick_field(sample: dict, names: Sequence[str], what: str) -> Any:
    """The first of `names` present in the sample; a clear error naming the sample otherwise."""
    for name in names:
        if name in sample:
            return sample[name]
    fields = sorted(k for k in sample if not k.startswith("__"))
    raise MissingFieldError(
        f"sample {sample.get('__key__')!r} of {sample.get('__shard__', sample.get('__url__'))} has no {what} field "
        f"(looked for {', '.join(names)}; it has {', '.join(fields) or 'nothing'})"
    )


def decode_image(data: bytes) -> Image.Image:
    """Decode fully now (PIL is lazy), so truncated bytes fail here and the sample is skipped."""
    image = Image.open(io.BytesIO(data))
    image.load()
    return image.convert("RGB")


def decode_text(data: bytes | str) -> str:
    return data.decode("utf-8") if isinstance(data, bytes) else str(data)


class ImageTextDecoder:
    """Raw sample -> {"image": float tensor, "input_ids", "attention_mask"}; picklable for workers.

    `attention_mask=False` leaves the mask out, for text towers that find the end token themselves
    (open_clip's): one tensor fewer to pass from the loader workers per batch.
    """

    def __init__(
        self,
        image_transform: Callable[[Image.Image], torch.Tensor],
        tokenize: Callable[[list[str]], dict[str, torch.Tensor]],
        image_fields: Sequence[str] = IMAGE_FIELDS,
        text_fields: Sequence[str] = TEXT_FIELDS,
        attention_mask: bool = True,
    ):
        self.image_transform, self.tokenize, self.attention_mask = image_transform, tokenize, attention_mask
        self.image_fields, self.text_fields = tuple(image_fields), tuple(text_fields)

    def __call__(self, sample: dict) -> dict[str, torch.Tensor]:
        image_bytes = pick_field(sample, self.image_fields, "image")
        text = decode_text(pick_field(sample, self.text_fields, "text"))
        tokens = self.tokenize([text])
        sample = {"image": self.image_transform(decode_image(image_bytes)), "input_ids": tokens["input_ids"][0]}
        if self.attention_mask:
            sample["attention_mask"] = tokens["attention_mask"][0]
        return sample
