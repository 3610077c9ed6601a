"""VICTOR's networks: unimodal towers (query and momentum key copies) and a cross-modal transformer.

- Frame encoder: a timm image backbone (trainable or frozen) applied to each of the T frames, or a linear
  layer over precomputed per-frame features; either way projected to the video width.
- Temporal transformer: [CLS] + T frame tokens with learned time embeddings; a learned mask token
  replaces the features of masked frames (masked frame modelling).
- Text encoder: a BERT-style `transformers` model (from scratch, any tokenizer incl. Chinese).
- Cross-modal transformer over [text tokens; frame tokens] with modality embeddings, for the
  reconstruction and order tasks.
- Pooled features: the [CLS] outputs of the temporal transformer and the text encoder, projected,
  batch-normalised (see `Projection`) and L2-normalised; retrieval and `encode_video` / `encode_text` use them.

The momentum key network is a `MomentumCopy` of the unimodal towers (frame encoder, temporal
transformer, text encoder, projections): [ours] in the spec, the paper says only "query" and "key" networks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from open_clip.constants import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD
from pydantic import Field, model_validator
from timm.models.vision_transformer import Block
from torch import nn
from torch.utils.checkpoint import checkpoint

from mmpt.models.clip import TextTowerConfig, bert_text_encoder
from mmpt.models.momentum import MomentumCopy
from mmpt.models.padding_masks import last_hidden_state
from mmpt.models.switches import TowerSwitches, timm_tower

NUM_ORDER_CLASSES = 6  # 3! orders of three segments
TASKS = ("mlm", "msom", "mfom", "intra_mfm", "inter_mfm", "dual_vsa")


class VideoTowerConfig(TowerSwitches):
    """The frame backbone and temporal transformer; `grad_checkpointing` covers both, `patch_dropout` the
    backbone (a ViT), frame by frame."""

    backbone: str | None = Field(
        default="resnet10t",
        description="timm model name (built without pretrained weights); null: precomputed features",
    )
    backbone_kwargs: dict[str, Any] = Field(default_factory=dict, description="extra timm.create_model arguments")
    backbone_weights: str | None = Field(
        default=None,
        description="local weights file for the backbone (.safetensors, or a torch state dict read weights-only)",
    )
    frozen: bool = Field(default=False, description="freeze the frame backbone (its features are still projected)")
    feature_dim: int | None = Field(default=None, gt=0, description="width of precomputed `npy` frame features")
    image_size: int = Field(default=224, gt=0, description="frame resolution after the transforms")
    mean: tuple[float, float, float] = Field(
        default=OPENAI_DATASET_MEAN, description="per-channel mean of frames in [0, 1]"
    )
    std: tuple[float, float, float] = Field(
        default=OPENAI_DATASET_STD, description="per-channel std of frames in [0, 1]"
    )
    num_frames: int = Field(default=8, ge=3, description="T: frames sampled per clip, one per equal segment")
    width: int = Field(default=256, gt=0)
    layers: int = Field(default=2, gt=0, description="temporal transformer layers")
    heads: int = Field(default=4, gt=0)

    @model_validator(mode="after")
    def _one_input(self) -> VideoTowerConfig:
        if (self.backbone is None) == (self.feature_dim is None):
            raise ValueError("set exactly one of video.backbone (decode frames) and video.feature_dim (npy features)")
        if self.backbone is None and (self.backbone_weights or self.frozen):
            raise ValueError("video.backbone_weights and video.frozen need a video.backbone")
        return self


class FrameEncoder(nn.Module):
    """Frames [B, T, C, H, W] or precomputed features [B, T, D] -> frame features [B, T, width].

    uint8 frames (raw pixels, as the loader ships them) are normalised here, on the accelerator, with the
    configured mean and std; floating frames are taken as already normalised.
    """

    pixel_scale: torch.Tensor  # buffers (registered in __init__)
    pixel_shift: torch.Tensor

    def __init__(self, cfg: VideoTowerConfig):
        super().__init__()
        if cfg.backbone is None:
            self.backbone = None
            in_dim = cfg.feature_dim
        else:
            self.backbone = timm_tower(cfg.backbone, cfg.backbone_kwargs, cfg, "method.video")
            self.backbone.requires_grad_(not cfg.frozen)
            in_dim = cast(int, self.backbone.num_features)
        self.frozen = cfg.frozen
        assert in_dim is not None  # the config asks for a backbone or a feature_dim
        self.projection = nn.Linear(in_dim, cfg.width)
        std = torch.tensor(cfg.std).view(1, 3, 1, 1)
        # x_normalised = x_uint8 * scale + shift; not saved: they follow from the config
        self.register_buffer("pixel_scale", 1.0 / (255.0 * std), persistent=False)
        self.register_buffer("pixel_shift", -torch.tensor(cfg.mean).view(1, 3, 1, 1) / std, persistent=False)

    def train(self, mode: bool = True) -> FrameEncoder:
        """A frozen backbone stays in evaluation mode (no BatchNorm statistics updates, no dropout)."""
        super().train(mode)
        if self.frozen and self.backbone is not None:
            self.backbone.eval()
        return self

    def forward(self, video: torch.Tensor) -> torch.Tensor:
        if self.backbone is None:
            if video.ndim != 3:
                raise ValueError(
                    f"this model reads precomputed features [B, T, D]; got a tensor of shape {tuple(video.shape)}"
                )
            return self.projection(video)
        if video.ndim != 5:
            raise ValueError(f"this model decodes frames [B, T, C, H, W]; got a tensor of shape {tuple(video.shape)}")
        batch, frames = video.shape[:2]
        images = video.flatten(0, 1)
        if not images.is_floating_point():
            dtype = self.projection.weight.dtype
            images = torch.addcmul(self.pixel_shift.to(dtype), images.to(dtype), self.pixel_scale.to(dtype))
        features = self.backbone(images)
        return self.projection(features).unflatten(0, (batch, frames))


def load_backbone_weights(backbone: nn.Module, path: str) -> None:
    """Backbone weights from a local file (e.g. timm's ImageNet weights); the classifier may be absent or extra."""
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        state = load_file(path)
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
        state = state.get("state_dict", state.get("model", state)) if isinstance(state, dict) else state
    result = backbone.load_state_dict(state, strict=False)
    classifier = getattr(backbone, "pretrained_cfg", {}).get("classifier") or "head"
    unexpected = [k for k in result.unexpected_keys if not k.startswith(classifier)]
    if result.missing_keys or unexpected:
        raise ValueError(
            f"config key 'method.video.backbone_weights': {path} does not fit the backbone: missing "
            f"{result.missing_keys[:10]}, unexpected {unexpected[:10]}"
        )


class Transformer(nn.Module):
    """Pre-LN transformer blocks (timm's ViT block, fused attention) and a final LayerNorm.

    timm's block calls every linear layer as a module, as the parameter rule asks (every parameter
    is read in the forward of the module that owns it; docs/adding_a_method.md); `nn.MultiheadAttention`
    reads its output projection's weight without calling it.
    """

    def __init__(self, width: int, layers: int, heads: int):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width, heads, mlp_ratio=4.0, qkv_bias=True) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.grad_checkpointing = False

    def forward(self, x: torch.Tensor, padding: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, L, W]; padding [B, L], True where a position is ignored as a key."""
        mask = None if padding is None else ~padding[:, None, None, :]
        for block in self.blocks:
            if self.grad_checkpointing and self.training:
                x = checkpoint(block, x, attn_mask=mask, use_reentrant=False)
            else:
                x = block(x, attn_mask=mask)
        return self.norm(x)


class TemporalTransformer(nn.Module):
    """Frame features [B, T, W] (+ a frame mask [B, T]) -> [B, 1 + T, W]: [CLS] then the frames."""

    def __init__(self, cfg: VideoTowerConfig):
        super().__init__()
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.width))
        self.mask_token = nn.Parameter(torch.zeros(1, 1, cfg.width))
        self.time_embedding = nn.Parameter(torch.zeros(1, cfg.num_frames, cfg.width))
        nn.init.normal_(self.time_embedding, std=0.02)
        nn.init.normal_(self.cls_token, std=0.02)
        nn.init.normal_(self.mask_token, std=0.02)
        self.encoder = Transformer(cfg.width, cfg.layers, cfg.heads)
        self.encoder.grad_checkpointing = cfg.grad_checkpointing

    def forward(self, frames: torch.Tensor, frame_mask: torch.Tensor | None = None) -> torch.Tensor:
        if frames.shape[1] != self.time_embedding.shape[1]:
            raise ValueError(f"expected {self.time_embedding.shape[1]} frames per clip, got {frames.shape[1]}")
        if frame_mask is not None:
            frames = torch.where(frame_mask[..., None], self.mask_token.to(frames.dtype), frames)
        tokens = torch.cat(
            [self.cls_token.expand(frames.shape[0], -1, -1).to(frames.dtype), frames + self.time_embedding], dim=1
        )
        return self.encoder(tokens)


class Projection(nn.Module):
    """Pooled token -> embedding: linear, then batch normalisation without affine terms (MoCo v3's heads).

    The normalisation centres the features over the batch. Without it, towers trained from scratch start
    with nearly identical pooled features (a BERT [CLS] at init is the same for every sentence), the key
    network's targets carry no signal, and both towers collapse to one constant feature.
    """

    def __init__(self, width: int, embed_dim: int):
        super().__init__()
        self.linear = nn.Linear(width, embed_dim, bias=False)
        self.norm = nn.BatchNorm1d(embed_dim, affine=False)

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.norm(self.linear(pooled))


class UnimodalTowers(nn.Module):
    """Everything the key network copies. `forward` gives what the key network contributes:
    (frame features [B, T, Wv], pooled video [B, E], pooled text [B, E]), the pooled ones L2-normalised."""

    def __init__(self, video: VideoTowerConfig, text: TextTowerConfig, embed_dim: int):
        super().__init__()
        self.frame_encoder = FrameEncoder(video)
        self.temporal = TemporalTransformer(video)
        self.text = bert_text_encoder(text)
        self.video_projection = Projection(video.width, embed_dim)
        self.text_projection = Projection(text.width, embed_dim)

    @property
    def grad_checkpointing(self) -> bool:
        return self.temporal.encoder.grad_checkpointing

    def set_grad_checkpointing(self, enabled: bool = True) -> None:
        """The video tower's switch: the frame backbone (a timm model) and the temporal transformer."""
        backbone: Any = self.frame_encoder.backbone
        if backbone is not None:
            backbone.set_grad_checkpointing(enabled)
        self.temporal.encoder.grad_checkpointing = enabled

    def text_hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return last_hidden_state(self.text, input_ids, attention_mask)

    def pooled_video(self, video_tokens: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        pooled = self.video_projection(video_tokens[:, 0])
        return F.normalize(pooled, dim=-1) if normalize else pooled

    def pooled_text(self, text_hidden: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        pooled = self.text_projection(text_hidden[:, 0])
        return F.normalize(pooled, dim=-1) if normalize else pooled

    def forward(self, video: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        frames = self.frame_encoder(video)
        return (
            frames,
            self.pooled_video(self.temporal(frames)),
            self.pooled_text(self.text_hidden(input_ids, attention_mask)),
        )


class CrossModalTransformer(nn.Module):
    """[text hidden [B, L, Wt]; video tokens [B, T, Wv]] -> (text outputs [B, L, Wt], frame outputs [B, T, Wt])."""

    def __init__(self, text_width: int, video_width: int, layers: int, heads: int):
        super().__init__()
        self.video_in = nn.Linear(video_width, text_width)
        # Own parameters, read in this module's forward (the parameter rule), not an nn.Embedding that
        # would be indexed without being called.
        self.modality = nn.Parameter(torch.zeros(2, text_width))
        nn.init.normal_(self.modality, std=0.02)
        self.encoder = Transformer(text_width, layers, heads)

    def forward(self, text_hidden: torch.Tensor, attention_mask: torch.Tensor, frame_tokens: torch.Tensor):
        frames = self.video_in(frame_tokens) + self.modality[1]
        tokens = torch.cat([text_hidden + self.modality[0], frames], dim=1)
        padding = torch.cat([attention_mask == 0, attention_mask.new_zeros(frames.shape[:2], dtype=torch.bool)], dim=1)
        out = self.encoder(tokens, padding)
        length = text_hidden.shape[1]
        return out[:, :length], out[:, length:]


class PredictionHead(nn.Module):
    """dense -> GELU -> LayerNorm -> linear, BERT's prediction-head shape."""

    def __init__(self, width: int, out: int):
        super().__init__()
        self.transform = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.LayerNorm(width))
        self.out = nn.Linear(width, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.transform(x))


class LogitScale(nn.Module):
    """exp(learnable log scale), clamped at 100; a module, so the scale is read in its owner's forward."""

    def __init__(self, temperature: float, learnable: bool):
        super().__init__()
        # Shape [1], not 0-D: DeepSpeed cannot flatten 0-D parameters.
        self.log_scale = nn.Parameter(torch.full([1], math.log(1.0 / temperature)), requires_grad=learnable)

    def forward(self) -> torch.Tensor:
        return self.log_scale.exp().clamp(max=100.0)


class VictorModel(nn.Module):
    """Query towers + cross-modal transformer + task heads, and the momentum key network."""

    def __init__(
        self,
        video: VideoTowerConfig,
        text: TextTowerConfig,
        embed_dim: int,
        cross_layers: int,
        momentum: float,
        vsa_temperature: float,
        learn_temperature: bool,
        tasks: Sequence[str] = TASKS,
    ):
        """`tasks`: the proxy tasks trained; heads (and the cross-modal transformer) only for those, so a
        task turned off leaves no unused parameters."""
        super().__init__()
        unknown = set(tasks) - set(TASKS)
        if unknown:
            raise ValueError(f"unknown VICTOR tasks {sorted(unknown)}; known: {', '.join(TASKS)}")
        self.unimodal = UnimodalTowers(video, text, embed_dim)
        needs_cross = bool(set(tasks) - {"dual_vsa"})
        self.cross = CrossModalTransformer(text.width, video.width, cross_layers, text.heads) if needs_cross else None
        if "mlm" in tasks and text.vocab_size is None:
            raise ValueError("TextTowerConfig.vocab_size is null: the method sets it to its tokenizer's size")
        self.mlm_head = PredictionHead(text.width, text.vocab_size) if text.vocab_size and "mlm" in tasks else None
        self.sentence_order_head = PredictionHead(text.width, NUM_ORDER_CLASSES) if "msom" in tasks else None
        self.frame_order_head = PredictionHead(text.width, NUM_ORDER_CLASSES) if "mfom" in tasks else None
        # cross-modal frame output -> frame feature space, for intra- and inter-MFM
        self.frame_head = PredictionHead(text.width, video.width) if {"intra_mfm", "inter_mfm"} & set(tasks) else None
        self.vsa_scale = LogitScale(vsa_temperature, learn_temperature)
        self.key = MomentumCopy(self.unimodal, momentum)  # registered after `unimodal`: deepcopy keeps the link

    @property
    def grad_checkpointing(self) -> bool:
        return self.unimodal.grad_checkpointing

    def set_grad_checkpointing(self, enabled: bool = True) -> None:
        """The query video tower's switch (the key network runs without gradient: nothing to recompute)."""
        self.unimodal.set_grad_checkpointing(enabled)

    def encode_video(self, video: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        """Frames [B, T, C, H, W] (or features [B, T, D] for a feature model) -> video features [B, E]."""
        towers = self.unimodal
        return towers.pooled_video(towers.temporal(towers.frame_encoder(video)), normalize)

    def encode_text(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, normalize: bool = True
    ) -> torch.Tensor:
        towers = self.unimodal
        return towers.pooled_text(towers.text_hidden(input_ids, attention_mask), normalize)

    def forward(self, video: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        """(video features, text features), both L2-normalised."""
        return self.encode_video(video), self.encode_text(input_ids, attention_mask)
