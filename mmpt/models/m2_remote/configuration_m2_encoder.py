"""The M²-Encoder's sizes as a transformers configuration (the fields of mmpt's `method.arch`)."""

from __future__ import annotations

from transformers import PretrainedConfig


class M2EncoderConfig(PretrainedConfig):
    model_type = "m2_encoder"

    def __init__(
        self,
        width: int = 768,
        heads: int = 12,
        lower_layers: int = 9,
        shared_layers: int = 3,
        ffn_width: int | None = None,
        vocab_size: int | None = 115244,
        image_size: int = 224,
        patch_size: int = 16,
        output_dim: int = 768,
        text_positions: int = 1024,
        context_length: int = 52,
        layernorm_eps: float = 1e-5,
        position_init_std: float = 1.0,
        grad_checkpointing: bool = False,
        patch_dropout: float = 0.0,
        **kwargs,
    ):
        self.width, self.heads, self.lower_layers, self.shared_layers = width, heads, lower_layers, shared_layers
        self.ffn_width, self.vocab_size, self.output_dim = ffn_width, vocab_size, output_dim
        self.image_size, self.patch_size = image_size, patch_size
        self.text_positions, self.context_length = text_positions, context_length
        self.layernorm_eps, self.position_init_std = layernorm_eps, position_init_std
        self.grad_checkpointing, self.patch_dropout = grad_checkpointing, patch_dropout
        super().__init__(**kwargs)

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2
