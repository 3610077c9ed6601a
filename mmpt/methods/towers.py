"""A model's encoders ("towers") as modules whose inputs are plain tensors, and what those inputs are: what a
method declares for export (`Method.tower_names`, `Method.export_towers`) and `mmpt.export` writes out.

A tower is what an exported model runs: an image, video, text or dialog batch in, L2-normalised
features out, computed by the model's own `encode_*` method.

Axes named "batch" are dynamic in every tower; "sequence" is dynamic up to `Tower.max_sequence`
where the tower reads a padding mask (or, for SPACE-2, positions) and so accepts any length; a text
tower that adds a fixed position table to exactly its context length (open_clip's) has a fixed length.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

BATCH, SEQUENCE = "batch", "sequence"


@dataclass(frozen=True)
class TensorSpec:
    """One input or output of a tower: its name, numpy dtype name, shape (ints, or the names of dynamic
    axes) and what it holds; `values` is the range [low, high) of an integer input's valid values."""

    name: str
    dtype: str
    shape: tuple[int | str, ...]
    about: str
    values: tuple[int, int] | None = None

    def as_dict(self) -> dict:
        record: dict = {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "about": self.about}
        if self.values is not None:
            record["values"] = list(self.values)
        return record


@dataclass
class Tower:
    """`module(*inputs)` gives `output`; inputs in the order of `inputs`, named as `module.forward`'s arguments."""

    name: str
    module: nn.Module
    inputs: tuple[TensorSpec, ...]
    output: TensorSpec
    max_sequence: int | None = None  # the largest "sequence" length the tower accepts
    file: str = field(init=False)

    def __post_init__(self) -> None:
        self.file = f"{self.name}.onnx"

    @property
    def dynamic_sequence(self) -> bool:
        return any(SEQUENCE in spec.shape for spec in self.inputs)

    def example(self, batch: int, sequence: int | None = None, seed: int = 0) -> tuple[torch.Tensor, ...]:
        """Valid inputs of `batch` samples (and `sequence` tokens where the length is dynamic): random pixels,
        token ids in range, a padding mask with the second half of the first sample padded."""
        generator = torch.Generator().manual_seed(seed)
        length = sequence or self.max_sequence or 1
        tensors = []
        for spec in self.inputs:
            shape = [batch if d == BATCH else length if d == SEQUENCE else int(d) for d in spec.shape]
            if spec.name == "attention_mask":
                mask = torch.ones(shape, dtype=torch.long)
                mask[0, max(2, shape[1] // 2) :] = 0
                tensors.append(mask)
            elif spec.dtype == "float32":
                tensors.append(torch.randn(shape, generator=generator))
            elif spec.dtype == "uint8":
                tensors.append(torch.randint(0, 256, shape, generator=generator, dtype=torch.uint8))
            else:
                low, high = spec.values or (0, 2)
                tensors.append(torch.randint(low, high, shape, generator=generator, dtype=torch.long))
        return tuple(tensors)


class _Encode(nn.Module):
    """`encode(model, *tensors)` as a module that owns the model (so its weights are exported with it)."""

    def __init__(self, model: nn.Module, encode: Callable[..., torch.Tensor]):
        super().__init__()
        self.model = model
        self._encode = encode


class ImageTower(_Encode):
    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self._encode(self.model, pixel_values)


class VideoTower(_Encode):
    def forward(self, video: torch.Tensor) -> torch.Tensor:
        return self._encode(self.model, video)


class TextTower(_Encode):
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self._encode(self.model, input_ids, attention_mask)


class IdsTextTower(_Encode):
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self._encode(self.model, input_ids)


class DialogTower(_Encode):
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        turns: torch.Tensor,
        roles: torch.Tensor,
        attention_mask: torch.Tensor,
    ) -> torch.Tensor:
        batch = {"input_ids": input_ids, "positions": positions, "turns": turns, "roles": roles}
        return self._encode(self.model, {**batch, "attention_mask": attention_mask})


def features(name: str, dim: int = 0) -> TensorSpec:
    """The output of tower `name`: [batch, dim] L2-normalised features (`with_output_dims` finds dim)."""
    return TensorSpec(f"{name}_features", "float32", (BATCH, dim), f"{name} features, L2-normalised")


def pixels(size: int) -> TensorSpec:
    return TensorSpec(
        "pixel_values", "float32", (BATCH, 3, size, size), "RGB images, preprocessed as `image` says (normalised)"
    )


def text_inputs(vocab: int, length: int | str, with_mask: bool = True) -> tuple[TensorSpec, ...]:
    ids = TensorSpec("input_ids", "int64", (BATCH, length), "token ids from the tokenizer", (0, vocab))
    if not with_mask:
        return (ids,)
    mask = TensorSpec("attention_mask", "int64", (BATCH, length), "1 for real tokens, 0 for padding")
    return ids, mask


def with_output_dims(towers: list[Tower]) -> list[Tower]:
    """`towers` with each output's feature width found by running the tower once on an example."""
    for tower in towers:
        with torch.no_grad():
            dim = int(tower.module(*tower.example(1, 2 if tower.dynamic_sequence else None)).shape[-1])
        tower.output = features(tower.name, dim)
    return towers


def image_text_towers(model: nn.Module, image_size: int, vocab: int, context: int, dynamic_text: bool) -> list[Tower]:
    """The "image" and "text" towers of a model with `encode_image(pixels)` and `encode_text(ids, mask)` (with
    `dynamic_text`: any length up to `context`) or `encode_text(ids)` (exactly `context` tokens)."""
    image = ImageTower(model, lambda m, x: m.encode_image(x))
    text = (
        TextTower(model, lambda m, ids, mask: m.encode_text(ids, mask))
        if dynamic_text
        else IdsTextTower(model, lambda m, ids: m.encode_text(ids))
    )
    towers = [
        Tower("image", image, (pixels(image_size),), features("image")),
        Tower(
            "text",
            text,
            text_inputs(vocab, SEQUENCE if dynamic_text else context, with_mask=dynamic_text),
            features("text"),
            max_sequence=context,
        ),
    ]
    return with_output_dims(towers)
