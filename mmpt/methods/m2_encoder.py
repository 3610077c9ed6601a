"""`m2_encoder`: the M²-Encoder multiway model trained with GBA-ITC.

Model and preprocessing follow the official inference code; the loss is our exact definition of
GBA-ITC (`losses/grouped_itc.py`). `init_from` starts from an official `.ckpt`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator
from torch import nn
from torchvision import transforms as T

from mmpt import distributed as mdist
from mmpt.config import Config, Section
from mmpt.data.glm_tokenizer import GLMTokenizer
from mmpt.data.tokenizer import TextTokenizer
from mmpt.eval.retrieval import official_caption_normalization
from mmpt.losses.grouped_itc import GroupedContrastiveLoss
from mmpt.methods.base import EngineNeeds, MethodConfig
from mmpt.methods.image_text import ImageTextMethod, PlacementAugment, ZeroShotConfig, model_images
from mmpt.models.m2_encoder import PRESETS, M2Encoder, M2EncoderConfig
from mmpt.models.m2_official import load_official

OFFICIAL_MEAN, OFFICIAL_STD = M2Encoder.image_mean, M2Encoder.image_std  # the official inception_normalize


class GbaItcConfig(Section):
    name: Literal["gba_itc"] = "gba_itc"
    group_size: int | Literal["auto", "world"] = Field(
        "world", description="ranks per gathering group: an int dividing the world size, auto (ranks per node), world")
    accumulation_steps: int | None = Field(
        None, gt=0, description="K micro-batches pooled per step; must equal train.grad_accum (null: follow it)")
    tile_size: int = Field(0, ge=0, description="column tile width of the logits; 0 = untiled")


class AugmentConfig(PlacementAugment):
    """Training augmentation; the official recipe is crop 0.8-1, horizontal flip, RandAugment(2, 7) (no placement)."""

    crop_scale: tuple[float, float] = (0.8, 1.0)
    hflip: bool = True
    randaugment: bool = True


class M2Config(MethodConfig):
    name: Literal["m2_encoder"] = "m2_encoder"
    model: Literal["m2-encoder-demo", "m2-encoder-0.4b", "m2-encoder-1b", "m2-encoder-10b"] = "m2-encoder-0.4b"
    arch: M2EncoderConfig = Field(default_factory=M2EncoderConfig,
                                  description="architecture; keys given here override the `model` preset")
    tokenizer: str = Field(description="GLM sp.model (SentencePiece, official) or a WordPiece tokenizer.json")
    init_from: str | None = Field(None, description="official M2-Encoder .ckpt to start from")
    loss: GbaItcConfig = Field(default_factory=GbaItcConfig)
    augment: AugmentConfig = Field(default_factory=AugmentConfig)
    zeroshot: ZeroShotConfig = Field(default_factory=ZeroShotConfig)

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, values: Any) -> Any:
        if isinstance(values, dict):
            preset = PRESETS.get(values.get("model", "m2-encoder-0.4b"), {})
            arch = values.get("arch") or {}
            if isinstance(arch, dict):
                values = {**values, "arch": {**preset, **arch}}
        return values


class M2EncoderMethod(ImageTextMethod):
    name = "m2_encoder"
    config_class = M2Config
    caption_normalization = staticmethod(official_caption_normalization)

    def check_config(self, cfg: Config) -> None:
        k = cfg.method.loss.accumulation_steps
        if k is not None and k != cfg.train.grad_accum:
            raise ValueError(f"method.loss.accumulation_steps={k} differs from train.grad_accum={cfg.train.grad_accum}")

    def tokenizer_file_name(self, cfg: Config) -> str:
        return "tokenizer.json" if cfg.method.tokenizer.endswith(".json") else "sp.model"

    def load_tokenizer(self, path: Path, cfg: Config):
        length = cfg.method.arch.context_length
        return TextTokenizer(path, length) if path.suffix == ".json" else GLMTokenizer(path, length)

    def image_transform(self, cfg: Config, train: bool):
        size, augment = cfg.method.arch.image_size, cfg.method.augment
        finish = [T.ToTensor(), T.Normalize(OFFICIAL_MEAN, OFFICIAL_STD)]
        if not train:  # official eval: squash to a square, no crop
            return T.Compose([T.Resize((size, size), interpolation=T.InterpolationMode.BICUBIC), *finish])
        steps = [T.RandomResizedCrop(size, scale=augment.crop_scale, interpolation=T.InterpolationMode.BICUBIC)]
        if augment.hflip:
            steps.append(T.RandomHorizontalFlip())
        if augment.randaugment:
            steps.append(T.RandAugment(num_ops=2, magnitude=7))
        return augment.apply_to(T.Compose([*steps, *finish]))

    def build_model(self, cfg: Config, run_dir: Path) -> M2Encoder:
        arch = cfg.method.arch
        if arch.vocab_size is None:
            arch = arch.model_copy(update={"vocab_size": self.tokenizer(cfg, run_dir).vocab_size})
        return M2Encoder(arch)

    def load_initial_weights(self, model: M2Encoder, cfg: Config) -> None:
        if cfg.method.init_from:
            load_official(model, cfg.method.init_from)

    def build_loss(self, cfg: Config) -> nn.Module:
        spec = cfg.method.loss
        size = {"world": None, "auto": mdist.local_world_size()}.get(spec.group_size, spec.group_size)
        return GroupedContrastiveLoss(mdist.contiguous_group(size), tile_size=spec.tile_size)

    def engine_needs(self, model: M2Encoder) -> EngineNeeds:
        return EngineNeeds(step_pool=self.step_pool)  # GBA-ITC: the step's K micro-batches form one negative pool

    def step_pool(self, model: M2Encoder, loss: GroupedContrastiveLoss, batches: list[dict[str, Any]]):
        images = [model.encode_image(model_images(model, b["image"])) for b in batches]
        texts = [model.encode_text(b["input_ids"], b["attention_mask"]) for b in batches]
        return loss.pool(images, texts)


METHOD = M2EncoderMethod()
