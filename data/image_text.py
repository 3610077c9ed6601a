"""Image-text samples: decode image bytes and caption, apply the image transform, tokenize.

Training batches carry images as uint8 pixels (`uint8_transform`): a quarter of float32's bytes through
the loader workers' IPC and the host-to-device copy. `normalize_pixels` finishes them on the device.
`training_image_decode` runs the training transform from the image bytes, decoding JPEGs at reduced size.
"""

from __future__ import annotations

import functools
import io
from collections.abc import Callable, Sequence
from typing import Any

import torch
from PIL import Image
from torchvision import transforms as T

from mmpt.data import fields
from mmpt.data.fields import MissingFieldError
from mmpt.data.reduced_decode import ReducedDecodeCrop, fits

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
    """UTF-8 text; other bytes fail as a `TextEncodingError`, counted apart from damaged samples."""
    return fields.decode_text(data) if isinstance(data, bytes) else str(data)


def uint8_transform(transform: T.Compose) -> T.Compose:
    """`transform` (a Compose ending in ToTensor, Normalize) ending in uint8 [C, H, W] pixels instead.

    The same steps before those two, so the same augmentation and the same pixels; `normalize_pixels`
    later turns them into exactly what ToTensor + Normalize gave.
    """
    steps = list(getattr(transform, "transforms", ()))
    if len(steps) < 2 or not isinstance(steps[-2], T.ToTensor) or not isinstance(steps[-1], T.Normalize):
        raise ValueError(f"expected a torchvision Compose ending in ToTensor and Normalize, got {transform!r}")
    return T.Compose([*steps[:-2], T.PILToTensor()])


def training_image_decode(transform: T.Compose) -> T.Compose | ReducedDecodeCrop:
    """`transform` for `ImageTextDecoder`, decoding JPEGs at reduced size when it starts with a RandomResizedCrop.

    The one place the training pipelines choose it: the crop box is drawn as before on the full-size image,
    only the decode is cheaper (`mmpt.data.reduced_decode`). Other transforms are returned as they are.
    """
    return ReducedDecodeCrop(transform, decode_image) if fits(transform) else transform


def normalize_pixels(
    pixels: torch.Tensor, mean: Sequence[float], std: Sequence[float], dtype: torch.dtype
) -> torch.Tensor:
    """uint8 pixels [..., C, H, W] -> (x / 255 - mean) / std in `dtype`, on the pixels' device.

    Computed in float32 with ToTensor's and Normalize's own operations, then cast: the result equals
    the float pipeline's batch after the engine's cast to the training precision.
    """
    x = pixels.to(torch.float32).div(255)
    return x.sub_(_channel_values(tuple(mean), x.device)).div_(_channel_values(tuple(std), x.device)).to(dtype)


@functools.lru_cache(maxsize=32)
def _channel_values(values: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """Per-channel constants as a [C, 1, 1] float32 tensor, made once per device rather than copied every step."""
    return torch.tensor(values, dtype=torch.float32, device=device).view(-1, 1, 1)


class ImageTextDecoder:
    """Raw sample -> {"image": `image_transform`'s tensor, "input_ids", "attention_mask"}; picklable for workers.

    Training passes a `uint8_transform`: pixels cross worker IPC as uint8 and are normalised on the device.
    `image_transform` takes the decoded image, or, as a `ReducedDecodeCrop` (`training_image_decode`), the bytes.

    `attention_mask=False` leaves the mask out, for text towers that find the end token themselves
    (open_clip's): one tensor fewer to pass from the loader workers per batch. `teacher_tokenize`: a distillation
    teacher's tokenizer; the same caption then also comes as "teacher_input_ids" and "teacher_attention_mask".
    """

    def __init__(
        self,
        image_transform: Callable[[Image.Image], torch.Tensor] | ReducedDecodeCrop,
        tokenize: Callable[[list[str]], dict[str, torch.Tensor]],
        image_fields: Sequence[str] = IMAGE_FIELDS,
        text_fields: Sequence[str] = TEXT_FIELDS,
        attention_mask: bool = True,
        teacher_tokenize: Callable[[list[str]], dict[str, torch.Tensor]] | None = None,
    ):
        self.image_transform, self.tokenize, self.attention_mask = image_transform, tokenize, attention_mask
        self.teacher_tokenize = teacher_tokenize
        self.image_fields, self.text_fields = tuple(image_fields), tuple(text_fields)

    def __call__(self, sample: dict) -> dict[str, torch.Tensor]:
        image_bytes = pick_field(sample, self.image_fields, "image")
        text = decode_text(pick_field(sample, self.text_fields, "text"))
        tokens = self.tokenize([text])
        if isinstance(self.image_transform, ReducedDecodeCrop):
            image = self.image_transform(image_bytes)
        else:
            image = self.image_transform(decode_image(image_bytes))
        sample = {"image": image, "input_ids": tokens["input_ids"][0]}
        if self.attention_mask:
            sample["attention_mask"] = tokens["attention_mask"][0]
        if self.teacher_tokenize is not None:
            theirs = self.teacher_tokenize([text])
            sample["teacher_input_ids"] = theirs["input_ids"][0]
            sample["teacher_attention_mask"] = theirs["attention_mask"][0]
        return sample
