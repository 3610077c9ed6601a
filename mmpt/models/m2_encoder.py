"""The M²-Encoder's configuration and its presets; the network itself is `mmpt.models.m2_remote.network`
(it needs torch alone, so that exported transformers folders carry it as it is)."""

from __future__ import annotations

from pydantic import Field, model_validator

from mmpt.models.m2_remote.network import FIRST_POSITION, TEXT, VISION, M2Encoder
from mmpt.models.switches import TowerSwitches
from mmpt.registry import Registry

__all__ = ["FIRST_POSITION", "PRESETS", "TEXT", "VISION", "M2Encoder", "M2EncoderConfig"]


class M2EncoderConfig(TowerSwitches):
    """Every size knob; the official 0.4B/1B/10B are presets of this (see `PRESETS`). `grad_checkpointing`
    covers every layer (both towers share the stack); `patch_dropout` the image tokens."""

    width: int = Field(default=768, gt=0)
    heads: int = Field(default=12, gt=0)
    lower_layers: int = Field(default=9, gt=0, description="modality-specific (A/B) layers: official `encoder_layers`")
    shared_layers: int = Field(default=3, gt=0, description="shared top layers: official `beit3_vl_layers`")
    ffn_width: int | None = Field(default=None, gt=0, description="default 4 x width")
    vocab_size: int | None = Field(default=115244, gt=0, description="null: the tokenizer's size")
    image_size: int = Field(default=224, gt=0)
    patch_size: int = Field(default=16, gt=0)
    output_dim: int = Field(default=768, gt=0)
    text_positions: int = Field(default=1024, gt=0, description="rows of the text position table")
    context_length: int = Field(default=52, gt=2)
    layernorm_eps: float = Field(default=1e-5, gt=0)
    position_init_std: float = Field(
        default=1.0,
        gt=0,
        description="std of the position tables at init (official: 1.0; small models train better with ~0.02)",
    )

    @model_validator(mode="after")
    def _check(self) -> M2EncoderConfig:
        if self.width % self.heads:
            raise ValueError(f"width {self.width} is not divisible by heads {self.heads}")
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size {self.image_size} is not divisible by patch_size {self.patch_size}")
        if self.context_length + FIRST_POSITION > self.text_positions:
            raise ValueError(
                f"context_length {self.context_length} needs more than {self.text_positions} text positions"
            )
        return self

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


PRESETS: Registry[dict] = Registry("M2-Encoder model")
PRESETS.register(
    "m2-encoder-demo",
    dict(
        width=64,
        heads=4,
        lower_layers=2,
        shared_layers=1,
        output_dim=64,
        image_size=32,
        patch_size=4,
        text_positions=64,
        context_length=24,
    ),
)
PRESETS.register("m2-encoder-0.4b", dict(width=768, heads=12, lower_layers=9, shared_layers=3, output_dim=768))
PRESETS.register("m2-encoder-1b", dict(width=1024, heads=16, lower_layers=21, shared_layers=3, output_dim=1024))
PRESETS.register("m2-encoder-10b", dict(width=4096, heads=32, lower_layers=21, shared_layers=3, output_dim=1024))
