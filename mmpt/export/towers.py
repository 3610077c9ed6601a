"""Each method's encoders ("towers") as modules whose inputs are plain tensors, and what those inputs are.

A tower is what an exported model runs: an image, video, text or dialog batch in, L2-normalised
features out, computed by the model's own `encode_*` method. `TOWER_NAMES` says which towers a
method has without building anything (the model card and the export checks read it);
`towers(method, model, cfg)` wraps a built model's encoders.

Axes named "batch" are dynamic in every tower; "sequence" is dynamic up to `Tower.max_sequence`
where the tower reads a padding mask (or, for SPACE-2, positions) and so accepts any length; the
open_clip text tower adds its fixed position table to exactly `context_length` tokens, so its
length is fixed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from mmpt.config import Config

if TYPE_CHECKING:
    from mmpt.methods.clip import ClipConfig
    from mmpt.methods.open_clip import OpenClipConfig
    from mmpt.methods.space2 import Space2Config
    from mmpt.methods.victor import VictorConfig
    from mmpt.models.clip import ClipModel
    from mmpt.models.m2_encoder import M2Encoder
    from mmpt.models.open_clip_model import OpenClipModel
    from mmpt.models.space2 import Space2Encoder
    from mmpt.models.victor import VictorModel

TOWER_NAMES: dict[str, tuple[str, ...]] = {
    "clip": ("image", "text"),
    "open_clip": ("image", "text"),
    "m2_encoder": ("image", "text"),
    "victor": ("video", "text"),
    "space2": ("dialog",),
}
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
    """`module(*inputs)` gives `output`; inputs in the order of `inputs`."""

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


def _features(name: str, dim: int) -> TensorSpec:
    return TensorSpec(f"{name}_features", "float32", (BATCH, dim), f"{name} features, L2-normalised")


def _pixels(size: int) -> TensorSpec:
    return TensorSpec(
        "pixel_values", "float32", (BATCH, 3, size, size), "RGB images, preprocessed as `image` says (normalised)"
    )


def _text_inputs(vocab: int, length: int | str, with_mask: bool = True) -> tuple[TensorSpec, ...]:
    ids = TensorSpec("input_ids", "int64", (BATCH, length), "token ids from the tokenizer", (0, vocab))
    if not with_mask:
        return (ids,)
    mask = TensorSpec("attention_mask", "int64", (BATCH, length), "1 for real tokens, 0 for padding")
    return ids, mask


def _output_dim(module: nn.Module, example: tuple[torch.Tensor, ...]) -> int:
    with torch.no_grad():
        return int(module(*example).shape[-1])


def _image_text(model: nn.Module, image_size: int, vocab: int, context: int, dynamic_text: bool) -> list:
    image = ImageTower(model, lambda m, x: m.encode_image(x))
    text = (
        TextTower(model, lambda m, ids, mask: m.encode_text(ids, mask))
        if dynamic_text
        else IdsTextTower(model, lambda m, ids: m.encode_text(ids))
    )
    text_inputs = _text_inputs(vocab, SEQUENCE if dynamic_text else context, with_mask=dynamic_text)
    towers = [
        Tower("image", image, (_pixels(image_size),), _features("image", 0)),
        Tower("text", text, text_inputs, _features("text", 0), max_sequence=context),
    ]
    return _with_output_dims(towers)


def _with_output_dims(towers: list[Tower]) -> list[Tower]:
    for tower in towers:
        dim = _output_dim(tower.module, tower.example(1, 2 if tower.dynamic_sequence else None))
        tower.output = _features(tower.name, dim)
    return towers


def clip_towers(model: nn.Module, cfg: Config) -> list[Tower]:
    clip, m = cast("ClipModel", model), cast("ClipConfig", cfg.method)
    text = clip.text.config
    return _image_text(clip, m.image.image_size, text.vocab_size, text.max_position_embeddings, True)


def open_clip_towers(model: nn.Module, cfg: Config) -> list[Tower]:
    from mmpt.models.open_clip_model import preprocess_settings

    wrapped, m = cast("OpenClipModel", model), cast("OpenClipConfig", cfg.method)
    size = preprocess_settings(m.model, m.image_size)["image_size"]
    size = size if isinstance(size, int) else size[0]
    clip: Any = wrapped.clip  # open_clip's CLIP: vocab_size and context_length are plain attributes
    return _image_text(wrapped, size, int(clip.vocab_size), int(clip.context_length), False)


def m2_encoder_towers(model: nn.Module, cfg: Config) -> list[Tower]:
    m2 = cast("M2Encoder", model)
    arch = m2.cfg
    return _image_text(m2, arch.image_size, int(arch.vocab_size or 0), arch.context_length, True)


def victor_towers(model: nn.Module, cfg: Config) -> list[Tower]:
    victor, video_cfg = cast("VictorModel", model), cast("VictorConfig", cfg.method).video
    frames = video_cfg.num_frames
    if video_cfg.feature_dim is not None:
        video_input = TensorSpec(
            "video", "float32", (BATCH, frames, video_cfg.feature_dim), "precomputed per-frame features"
        )
    else:
        size = video_cfg.image_size
        video_input = TensorSpec(
            "video",
            "uint8",
            (BATCH, frames, 3, size, size),
            "RGB frames as raw pixels (0-255): the model normalises them with `video.mean` / `video.std`",
        )
    text = victor.unimodal.text.config
    towers = [
        Tower("video", VideoTower(victor, lambda m, v: m.encode_video(v)), (video_input,), _features("video", 0)),
        Tower(
            "text",
            TextTower(victor, lambda m, ids, mask: m.encode_text(ids, mask)),
            _text_inputs(text.vocab_size, SEQUENCE),
            _features("text", 0),
            max_sequence=text.max_position_embeddings,
        ),
    ]
    return _with_output_dims(towers)


def space2_towers(model: nn.Module, cfg: Config) -> list[Tower]:
    from mmpt.models.space2 import TURN_ROWS

    encoder, m = cast("Space2Encoder", model), cast("Space2Config", cfg.method)
    vocab = int(getattr(encoder.config, "vocab_size"))  # noqa: B009 (BERT-family configs have it; the base class not)
    shape = (BATCH, SEQUENCE)
    inputs = (
        TensorSpec("input_ids", "int64", shape, "word-piece ids with role tokens", (0, vocab)),
        TensorSpec(
            "positions", "int64", shape, "position within each utterance (restarts at 0)", (0, m.max_utt_len + 2)
        ),
        TensorSpec("turns", "int64", shape, "turn distance from the current utterance (1 = current)", (1, TURN_ROWS)),
        TensorSpec("roles", "int64", shape, "role id (0 or 1, alternating back from the current turn)", (0, 2)),
        TensorSpec("attention_mask", "int64", shape, "1 for real tokens, 0 for padding"),
    )
    dialog = DialogTower(encoder, lambda model_, batch: model_.encode_dialog(batch))
    return _with_output_dims([Tower("dialog", dialog, inputs, _features("dialog", 0), max_sequence=m.max_len)])


BUILDERS: dict[str, Callable[[nn.Module, Config], list[Tower]]] = {
    "clip": clip_towers,
    "open_clip": open_clip_towers,
    "m2_encoder": m2_encoder_towers,
    "victor": victor_towers,
    "space2": space2_towers,
}


def towers(model: nn.Module, cfg: Config, names: list[str] | None = None) -> list[Tower]:
    """The towers of `model` (built by `cfg`'s method, in eval mode), all or those named."""
    built = BUILDERS[cfg.method_name](model, cfg)
    return [tower for tower in built if names is None or tower.name in names]
