"""`clip`: a two-tower image-text model trained with the global contrastive loss.

The reference method of the spine: a timm image tower, a BERT text tower trained from scratch with
a corpus-trained bilingual tokenizer, and zero-shot classification in every configured language at
the end of training.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, cast

from open_clip import image_transform
from open_clip.constants import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD
from pydantic import Field
from torch import nn
from torchvision import transforms as T

from mmpt.config import Config
from mmpt.data.tokenizer import TextTokenizer
from mmpt.losses import ContrastiveLoss
from mmpt.methods import register
from mmpt.methods.base import EngineNeeds, MethodConfig
from mmpt.methods.image_text import TINY_IMAGE_TEXT_DATA, ImageTextMethod, PlacementAugment, ZeroShotConfig
from mmpt.models.clip import ClipModel, ImageTowerConfig, TextTowerConfig


class ClipConfig(MethodConfig):
    name: Literal["clip"] = "clip"
    image: ImageTowerConfig = Field(default_factory=ImageTowerConfig)
    text: TextTowerConfig = Field(default_factory=TextTowerConfig)
    embed_dim: int = Field(default=256, gt=0)
    tokenizer: str = Field(description="path of a `tokenizers` tokenizer.json (copied into the run directory)")
    image_mean: tuple[float, float, float] = OPENAI_DATASET_MEAN
    image_std: tuple[float, float, float] = OPENAI_DATASET_STD
    augment: PlacementAugment = Field(
        default_factory=PlacementAugment, description="added to open_clip's training transform (crop 0.9-1)"
    )
    zeroshot: ZeroShotConfig = Field(default_factory=ZeroShotConfig)


class ClipMethod(ImageTextMethod[ClipConfig]):
    name = "clip"
    config_class = ClipConfig
    tower_switches = "method.image"
    tiny_overrides = (
        *TINY_IMAGE_TEXT_DATA,
        "method.tokenizer={digits}/tokenizer.json",
        "method.embed_dim=16",
        "method.image.image_size=32",
        "method.text.width=32",
        "method.text.layers=1",
        "method.text.heads=2",
        "method.zeroshot.dataset=null",
    )

    def tokenizer_file_name(self, cfg: Config) -> str:
        return "tokenizer.json"

    def tokenizer_source(self, cfg: Config) -> str | None:
        return self.settings(cfg).tokenizer

    def load_tokenizer(self, path: Path, cfg: Config) -> TextTokenizer:
        return TextTokenizer(path, self.settings(cfg).text.context_length)

    def image_transform(self, cfg: Config, train: bool):
        m = self.settings(cfg)
        transform = image_transform(m.image.image_size, is_train=train, mean=m.image_mean, std=m.image_std)
        return m.augment.apply_to(cast(T.Compose, transform)) if train else transform

    def build_model(self, cfg: Config, run_dir: Path) -> ClipModel:
        m = self.settings(cfg)
        text = m.text
        if text.vocab_size is None:
            text = text.model_copy(update={"vocab_size": self.tokenizer(cfg, run_dir).vocab_size})
        return ClipModel(m.image, text, m.embed_dim, image_mean=m.image_mean, image_std=m.image_std)

    def build_loss(self, cfg: Config) -> nn.Module:
        return ContrastiveLoss()

    def engine_needs(self, model: ClipModel) -> EngineNeeds:
        return EngineNeeds(compilable=(model.visual, model.text))  # the timm image tower, the BERT text tower


METHOD = register(ClipMethod())
