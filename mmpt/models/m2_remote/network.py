"""The M²-Encoder multiway transformer (arXiv 2401.15896), compatible with the official checkpoints.

Follows the official inference code (docs/m2_encoder.md says what is known from it and the paper): a lower stack of
pre-LN Sub-LN (Magneto) layers in which every module has a vision copy `A` and a text copy `B`,
then a shared top stack in which both modalities use the `A` copies. Image and text features are
the CLS token of the top stack through the `itc_vl_*` projections, L2-normalised.
Parameter names equal the official state-dict keys, so official weights load strictly.

This file needs torch alone (timm only for patch dropout in training): it is copied as it is into the
transformers folders mmpt exports (`modeling_m2_encoder.py` imports it), so it imports nothing from mmpt.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

try:  # patch dropout in training only: an exported folder loads without timm
    from timm.layers.patch_dropout import PatchDropout

    PATCH_DROPOUT: type[nn.Module] | None = PatchDropout
except ImportError:
    PATCH_DROPOUT = None

VISION, TEXT = "A", "B"
FIRST_POSITION = 2  # fairseq convention: position rows 0 and 1 are never used


class Sizes(Protocol):
    """The knobs the network reads: mmpt's `M2EncoderConfig` in training, a transformers config in an
    exported folder."""

    width: int
    heads: int
    lower_layers: int
    shared_layers: int
    ffn_width: int | None
    vocab_size: int | None
    image_size: int
    patch_size: int
    output_dim: int
    text_positions: int
    context_length: int
    layernorm_eps: float
    position_init_std: float
    grad_checkpointing: bool
    patch_dropout: float

    @property
    def num_patches(self) -> int: ...


ModuleT = TypeVar("ModuleT", bound=nn.Module)


class Multiway(nn.Module, Generic[ModuleT]):
    """Two independent copies of a module: `A` (vision / shared) and `B` (text)."""

    A: ModuleT
    B: ModuleT

    def __init__(self, make: Callable[[], ModuleT], make_b: Callable[[], ModuleT] | None = None):
        super().__init__()
        self.A, self.B = make(), (make_b or make)()

    def forward(self, x: torch.Tensor, expert: str) -> torch.Tensor:
        return getattr(self, expert)(x)


class FeedForward(nn.Module):
    """fc1 -> exact GELU -> Sub-LN over the hidden width -> fc2."""

    def __init__(self, width: int, hidden: int, eps: float):
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)
        self.ffn_layernorm = nn.LayerNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.ffn_layernorm(F.gelu(self.fc1(x))))


class MultiwayAttention(nn.Module):
    """Bidirectional attention with per-modality projections and Sub-LN before the output projection."""

    def __init__(self, width: int, heads: int, eps: float):
        super().__init__()
        self.heads = heads
        # Registration order gives the official state-dict order: k, v, q, out, inner_attn_ln.
        self.k_proj = Multiway(lambda: nn.Linear(width, width))
        self.v_proj = Multiway(lambda: nn.Linear(width, width))
        self.q_proj = Multiway(lambda: nn.Linear(width, width))
        self.out_proj = Multiway(lambda: nn.Linear(width, width))
        self.inner_attn_ln = Multiway(lambda: nn.LayerNorm(width, eps=eps))

    def forward(self, x: torch.Tensor, expert: str, attend: torch.Tensor | None) -> torch.Tensor:
        batch, length, width = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, length, self.heads, width // self.heads).transpose(1, 2)

        q, k, v = heads(self.q_proj(x, expert)), heads(self.k_proj(x, expert)), heads(self.v_proj(x, expert))
        mask = None if attend is None else attend[:, None, None, :]  # True = key may be attended
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out = out.transpose(1, 2).reshape(batch, length, width)
        return self.out_proj(self.inner_attn_ln(out, expert), expert)


class EncoderLayer(nn.Module):
    def __init__(self, cfg: Sizes):
        super().__init__()
        eps = cfg.layernorm_eps
        self.self_attn = MultiwayAttention(cfg.width, cfg.heads, eps)
        self.self_attn_layer_norm = Multiway(lambda: nn.LayerNorm(cfg.width, eps=eps))
        self.ffn = Multiway(lambda: FeedForward(cfg.width, cfg.ffn_width or 4 * cfg.width, eps))
        self.final_layer_norm = Multiway(lambda: nn.LayerNorm(cfg.width, eps=eps))

    def forward(self, x: torch.Tensor, expert: str, attend: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x, expert), expert, attend)
        return x + self.ffn(self.final_layer_norm(x, expert), expert)


class Encoder(nn.Module):
    """A stack of layers and its final LayerNorm; zeroes padded positions at its input."""

    def __init__(self, cfg: Sizes, num_layers: int, positions: tuple[int, int] | None = None):
        super().__init__()
        if positions is not None:
            vision_rows, text_rows = positions
            self.embed_positions = Multiway(
                lambda: nn.Embedding(vision_rows, cfg.width), lambda: nn.Embedding(text_rows, cfg.width)
            )
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(num_layers))
        self.layer_norm = Multiway(lambda: nn.LayerNorm(cfg.width, eps=cfg.layernorm_eps))
        self.grad_checkpointing = cfg.grad_checkpointing
        # FLIP: image patches dropped once their positions are added (the class token is kept)
        self.patch_dropout = None
        if positions and cfg.patch_dropout:
            if PATCH_DROPOUT is None:
                raise ImportError("patch dropout (patch_dropout > 0) needs timm installed")
            self.patch_dropout = PATCH_DROPOUT(cfg.patch_dropout, num_prefix_tokens=1)
        _magneto_scale(self, num_layers)

    def forward(
        self, x: torch.Tensor, expert: str, attend: torch.Tensor | None, position_expert: str | None = None
    ) -> torch.Tensor:
        if position_expert is not None:
            positions = torch.arange(FIRST_POSITION, FIRST_POSITION + x.shape[1], device=x.device)
            x = x + self.embed_positions(positions, position_expert)
            if position_expert == VISION and self.patch_dropout is not None:
                x = self.patch_dropout(x)
        if attend is not None:
            x = x * attend.unsqueeze(-1).to(x.dtype)
        for layer in self.layers:
            if self.grad_checkpointing and self.training:
                x = checkpoint(layer, x, expert, attend, use_reentrant=False)
            else:
                x = layer(x, expert, attend)
        return self.layer_norm(x, expert)


def _magneto_scale(encoder: nn.Module, num_layers: int) -> None:
    """Sub-LN init: scale fc1, fc2, out_proj and v_proj (weights and biases) by sqrt(ln(2N))."""
    factor = math.sqrt(math.log(2 * num_layers))
    with torch.no_grad():
        for name, param in encoder.named_parameters():
            if any(part in name for part in ("fc1", "fc2", "out_proj", "v_proj")):
                param.mul_(factor)


class VisionEmbedding(nn.Module):
    def __init__(self, cfg: Sizes):
        super().__init__()
        self.mask_token = nn.Parameter(torch.zeros(1, 1, cfg.width))  # masked-image training only
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.width))
        self.proj = nn.Conv2d(3, cfg.width, kernel_size=cfg.patch_size, stride=cfg.patch_size)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        patches = self.proj(images).flatten(2).transpose(1, 2)  # row-major patch order
        # shape[0], not len(images): an exported (traced) model keeps the batch size symbolic
        return torch.cat([self.cls_token.expand(images.shape[0], -1, -1), patches], dim=1)


class Backbone(nn.Module):
    def __init__(self, cfg: Sizes):
        super().__init__()
        if cfg.vocab_size is None:
            raise ValueError("M2EncoderConfig.vocab_size is null: the method sets it to its tokenizer's size")
        self.text_embed = nn.Embedding(cfg.vocab_size, cfg.width)
        self.vision_embed = VisionEmbedding(cfg)
        self.encoder = Encoder(
            cfg,
            cfg.lower_layers,
            positions=((cfg.image_size // cfg.patch_size) ** 2 + 1 + FIRST_POSITION, cfg.text_positions),
        )


class Projection(nn.Module):
    def __init__(self, width: int, out: int):
        super().__init__()
        self.fc = nn.Linear(width, out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class Pooler(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.dense = nn.Linear(width, width)


class M2Encoder(nn.Module):
    """`encode_image(images)` / `encode_text(input_ids, attention_mask)` -> L2-normalised features.

    Images are expected normalised with mean = std = 0.5 (the official `inception_normalize`).
    `logit_scale` has shape [1] (the official checkpoints store it 0-D; `m2_checkpoint` maps it).
    """

    image_mean = image_std = (0.5, 0.5, 0.5)  # per channel, of pixels in [0, 1]

    def __init__(self, cfg: Sizes):
        super().__init__()
        self.cfg = cfg
        init_scale = math.log(1 / 0.07)
        self.logit_scale = nn.Parameter(torch.full([1], init_scale))
        self.logit_vl_scale = nn.Parameter(torch.full([1], init_scale))  # kept for checkpoint compatibility
        self.backbone = Backbone(cfg)
        self.backbone_vl = Encoder(cfg, cfg.shared_layers)
        self.norm = nn.LayerNorm(cfg.width, eps=1e-6)  # unused in the forward, kept for compatibility
        self.pooler = Pooler(cfg.width)  # unused in the forward, kept for compatibility
        # Registration order gives the official state-dict order.
        self.itc_text_proj = Projection(cfg.width, cfg.output_dim)
        self.itc_image_proj = Projection(cfg.width, cfg.output_dim)
        self.itc_vl_text_proj = Projection(cfg.width, cfg.output_dim)
        self.itc_vl_image_proj = Projection(cfg.width, cfg.output_dim)
        self._init_weights()

    def _init_weights(self) -> None:
        width = self.cfg.width
        nn.init.normal_(self.backbone.text_embed.weight, std=width**-0.5)
        positions = self.backbone.encoder.embed_positions
        for table in (positions.A, positions.B):
            nn.init.normal_(table.weight, std=self.cfg.position_init_std)
        for head in (self.itc_text_proj, self.itc_image_proj, self.itc_vl_text_proj, self.itc_vl_image_proj):
            nn.init.normal_(head.fc.weight, std=0.02)
        nn.init.normal_(self.pooler.dense.weight, std=0.02)
        nn.init.zeros_(self.pooler.dense.bias)

    @property
    def grad_checkpointing(self) -> bool:
        return self.backbone.encoder.grad_checkpointing

    def set_grad_checkpointing(self, enabled: bool = True) -> None:
        self.backbone.encoder.grad_checkpointing = self.backbone_vl.grad_checkpointing = enabled

    def image_tower(self, images: torch.Tensor) -> torch.Tensor:
        """Top-stack hidden states of an image batch, [B, 1 + patches, width]."""
        x = self.backbone.vision_embed(images)
        x = self.backbone.encoder(x, VISION, None, position_expert=VISION)
        return self.backbone_vl(x, VISION, None)

    def text_tower(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        attend = attention_mask.bool()
        x = self.backbone.text_embed(input_ids)
        x = self.backbone.encoder(x, TEXT, attend, position_expert=TEXT)
        return self.backbone_vl(x, VISION, attend)  # the shared top uses the A copies for text too

    def encode_image(self, images: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        features = self.itc_vl_image_proj(self.image_tower(images)[:, 0])
        return features / features.norm(dim=-1, keepdim=True) if normalize else features

    def encode_text(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, normalize: bool = True
    ) -> torch.Tensor:
        features = self.itc_vl_text_proj(self.text_tower(input_ids, attention_mask)[:, 0])
        return features / features.norm(dim=-1, keepdim=True) if normalize else features

    def forward(self, images: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        """(image features, text features, exp(logit_scale) clamped at 100)."""
        return (
            self.encode_image(images),
            self.encode_text(input_ids, attention_mask),
            self.logit_scale.exp().clamp(max=100.0),
        )
