"""`clip`: a two-tower image-text model trained with the global contrastive loss.

The reference method of the spine: a timm image tower, a BERT text tower trained from scratch with
a corpus-trained bilingual tokenizer, and zero-shot classification in every configured language at
the end of training.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Literal

import torch
from open_clip import image_transform
from open_clip.constants import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD
from pydantic import Field
from torch import nn

from mmpt.config import Config, Section
from mmpt.data.image_text import ImageTextDecoder
from mmpt.data.loader import BatchStream
from mmpt.data.tokenizer import TextTokenizer
from mmpt.eval import resolve_dataset
from mmpt.eval.zeroshot import load_classification_set, zeroshot_classification
from mmpt.losses import ContrastiveLoss
from mmpt.methods.base import Method, MethodConfig, stream_spec
from mmpt.models.clip import ClipModel, ImageTowerConfig, TextTowerConfig

TOKENIZER_FILE = "tokenizer.json"


class ZeroShotConfig(Section):
    dataset: str | None = Field(None, description="CLIP_benchmark/ImageFolder path, or a demo corpus name ('digits')")
    languages: list[str] = Field(default_factory=lambda: ["en"])
    batch_size: int = Field(256, gt=0)


class ClipConfig(MethodConfig):
    name: Literal["clip"] = "clip"
    image: ImageTowerConfig = Field(default_factory=ImageTowerConfig)
    text: TextTowerConfig = Field(default_factory=TextTowerConfig)
    embed_dim: int = Field(256, gt=0)
    tokenizer: str = Field(description="path of a `tokenizers` tokenizer.json (copied into the run directory)")
    image_mean: tuple[float, float, float] = OPENAI_DATASET_MEAN
    image_std: tuple[float, float, float] = OPENAI_DATASET_STD
    zeroshot: ZeroShotConfig = Field(default_factory=ZeroShotConfig)


class ClipMethod(Method):
    name = "clip"
    config_class = ClipConfig

    def prepare(self, cfg: Config, run_dir: Path) -> None:
        source = Path(cfg.method.tokenizer)
        if not source.is_file():
            raise FileNotFoundError(f"config key 'method.tokenizer': {source} does not exist")
        if source.resolve() != (run_dir / TOKENIZER_FILE).resolve():
            shutil.copyfile(source, run_dir / TOKENIZER_FILE)

    def tokenizer(self, cfg: Config, run_dir: Path) -> TextTokenizer:
        return TextTokenizer(run_dir / TOKENIZER_FILE, cfg.method.text.context_length)

    def image_transform(self, cfg: Config, train: bool):
        m = cfg.method
        return image_transform(m.image.image_size, is_train=train, mean=m.image_mean, std=m.image_std)

    def build_model(self, cfg: Config, run_dir: Path) -> ClipModel:
        m = cfg.method
        text = m.text
        if text.vocab_size is None:
            text = text.model_copy(update={"vocab_size": self.tokenizer(cfg, run_dir).vocab_size})
        return ClipModel(m.image, text, m.embed_dim)

    def build_loss(self, cfg: Config) -> nn.Module:
        return ContrastiveLoss()

    def train_data(self, cfg: Config, run_dir: Path, *, rank: int, world_size: int) -> BatchStream:
        decoder = ImageTextDecoder(self.image_transform(cfg, train=True), self.tokenizer(cfg, run_dir))
        return BatchStream(stream_spec(cfg, rank=rank, world_size=world_size), decoder)

    def training_step(self, model: ClipModel, loss: nn.Module, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        image_features, text_features, scale = model(batch["image"], batch["input_ids"], batch["attention_mask"])
        return {"contrastive": loss(image_features, text_features, scale)}

    def evaluate(self, model: ClipModel, cfg: Config, run_dir: Path) -> dict[str, Any]:
        zs = cfg.method.zeroshot
        if zs.dataset is None:
            return {}
        return {
            f"zeroshot/{language}/{key}": value
            for language in zs.languages
            for key, value in self.zeroshot(model, cfg, run_dir, zs.dataset, language)["metrics"].items()
        }

    def zeroshot(self, model: ClipModel, cfg: Config, run_dir: Path, dataset: str, language: str) -> dict[str, Any]:
        """One zero-shot classification run as a CLIP_benchmark-style result record."""
        data = load_classification_set(resolve_dataset(dataset, cfg.data.root), language)
        device = next(model.parameters()).device
        metrics = zeroshot_classification(
            model, self.tokenizer(cfg, run_dir), self.image_transform(cfg, train=False), data,
            batch_size=cfg.method.zeroshot.batch_size, device=device,
        )
        result = {"dataset": dataset, "model": str(run_dir), "task": "zeroshot_classification",
                  "language": language, "metrics": metrics}
        (run_dir / "eval").mkdir(exist_ok=True)
        (run_dir / "eval" / f"zeroshot_{Path(dataset).name}_{language}.json").write_text(json.dumps(result, indent=2))
        return result


METHOD = ClipMethod()
