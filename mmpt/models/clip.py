"""A two-tower CLIP: a timm image backbone and a BERT text encoder trained from scratch."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal, cast

import torch
import torch.nn.functional as F
from open_clip.constants import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD
from pydantic import Field, model_validator
from torch import nn
from transformers import BertConfig, BertModel

from mmpt.config import Section
from mmpt.models.padding_masks import last_hidden_state
from mmpt.models.switches import TowerSwitches, timm_tower


class ImageTowerConfig(TowerSwitches):
    timm_name: str = Field(default="vit_tiny_patch16_224", description="any timm model name")
    pretrained: str | None = Field(
        default=None,
        description="initial weights: 'timm' (timm's pretrained weights of timm_name: its cache, else a download) "
        "or a local weights file timm reads; null: random",
    )
    image_size: int = Field(default=224, gt=0, description="input resolution of the image transforms")
    timm_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="extra timm.create_model arguments (img_size, patch_size, depth, ...)"
    )

    @model_validator(mode="after")
    def _one_resolution(self) -> ImageTowerConfig:
        size = self.timm_kwargs.get("img_size")
        if size is not None and size != self.image_size:
            raise ValueError(f"timm_kwargs.img_size={size} differs from image_size={self.image_size}")
        return self


class TextTowerConfig(Section):
    """A BERT-style encoder; `vocab_size: null` takes the tokenizer's size. With `pretrained`, the encoder is that
    checkpoint's architecture and weights, and its size keys are not read."""

    pretrained: str | None = Field(
        default=None,
        description="a transformers encoder checkpoint (folder or hub name, e.g. a BERT or RoBERTa-wwm): its "
        "architecture, weights and, unless method.tokenizer is set, its tokenizer; null: a new BERT of this size",
    )
    vocab_size: int | None = Field(default=None, gt=0)
    width: int = Field(default=256, gt=0)
    layers: int = Field(default=4, gt=0)
    heads: int = Field(default=4, gt=0)
    mlp_ratio: float = Field(default=4.0, gt=0)
    context_length: int = Field(default=32, gt=1)
    dropout: float = Field(default=0.0, ge=0, lt=1)
    pooling: Literal["mean", "cls"] = Field(
        default="mean",
        description="text features from the mean of the real tokens' last hidden states, or from the first "
        "([CLS]) token's, as Chinese-CLIP (and --format transformers, a ChineseCLIPModel) has them",
    )


def bert_text_encoder(cfg: TextTowerConfig) -> BertModel:
    """A randomly initialised BERT encoder of the tower's size (no pooler: towers pool themselves)."""
    if cfg.vocab_size is None:
        raise ValueError("text tower vocab_size must be resolved (from the tokenizer) before building the model")
    return BertModel(
        BertConfig(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.width,
            num_hidden_layers=cfg.layers,
            num_attention_heads=cfg.heads,
            intermediate_size=int(cfg.width * cfg.mlp_ratio),
            max_position_embeddings=cfg.context_length,
            hidden_dropout_prob=cfg.dropout,
            attention_probs_dropout_prob=cfg.dropout,
        ),
        add_pooling_layer=False,
    )


class ClipModel(nn.Module):
    """`encode_image` / `encode_text` return L2-normalised features in a shared `embed_dim` space.

    Images are expected normalised with `image_mean` / `image_std` (per channel, of pixels in [0, 1]).
    """

    reads_mask = True  # the text tower attends only to real tokens

    def __init__(
        self,
        image: ImageTowerConfig,
        text: TextTowerConfig,
        embed_dim: int,
        init_logit_scale: float = math.log(1 / 0.07),
        init_logit_bias: float | None = None,
        image_mean: Sequence[float] = OPENAI_DATASET_MEAN,
        image_std: Sequence[float] = OPENAI_DATASET_STD,
        text_encoder: nn.Module | None = None,
    ):
        """`text_encoder`: a transformers encoder of a pretrained architecture, instead of a BERT of `text`'s size."""
        super().__init__()
        self.image_mean, self.image_std = tuple(image_mean), tuple(image_std)
        self.visual = timm_tower(image.timm_name, image.timm_kwargs, image, "method.image")
        self.image_projection = nn.Linear(cast(int, self.visual.num_features), embed_dim, bias=False)
        self.text: Any = text_encoder if text_encoder is not None else bert_text_encoder(text)
        self.text_projection = nn.Linear(int(self.text.config.hidden_size), embed_dim, bias=False)
        self.text_pooling = text.pooling
        # Shape [1], not 0-D: DeepSpeed cannot flatten 0-D parameters.
        self.logit_scale = nn.Parameter(torch.full([1], float(init_logit_scale)))
        # The sigmoid loss's bias, kept with the model (as open_clip and transformers keep SigLIP's)
        self.logit_bias = None if init_logit_bias is None else nn.Parameter(torch.full([1], float(init_logit_bias)))

    @property
    def grad_checkpointing(self) -> bool:
        return bool(getattr(self.visual, "grad_checkpointing", False))

    def set_grad_checkpointing(self, enabled: bool = True) -> None:
        """The image tower's switch (the text tower is not checkpointed)."""
        self.visual.set_grad_checkpointing(enabled)

    def encode_image(self, images: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        features = self.image_projection(self.visual(images))
        return F.normalize(features, dim=-1) if normalize else features

    def encode_text(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, normalize: bool = True
    ) -> torch.Tensor:
        hidden = last_hidden_state(self.text, input_ids, attention_mask)
        if self.text_pooling == "cls":
            pooled = hidden[:, 0]
        else:
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1.0)  # mean over real tokens
        features = self.text_projection(pooled)
        return F.normalize(features, dim=-1) if normalize else features

    def forward(self, images: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        """(image features, text features, logit scale multiplier clamped at 100), and the logit bias where the
        model has one."""
        scale = self.logit_scale.exp().clamp(max=100.0)
        features = self.encode_image(images), self.encode_text(input_ids, attention_mask)
        return (*features, scale) if self.logit_bias is None else (*features, scale, self.logit_bias)
