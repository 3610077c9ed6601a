"""`AutoModel.from_pretrained(folder, trust_remote_code=True)` for an M²-Encoder mmpt exported.

`get_image_features(pixel_values)` and `get_text_features(input_ids, attention_mask)` give the projected
features before normalisation, as `CLIPModel`'s do; `forward` gives both normalised and the logits scaled
by the learnt temperature. Pixels are normalised with mean = std = 0.5 (the folder's image processor)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel
from transformers.utils.generic import ModelOutput

from .configuration_m2_encoder import M2EncoderConfig
from .network import M2Encoder


@dataclass
class M2EncoderOutput(ModelOutput):
    logits_per_image: torch.Tensor | None = None
    logits_per_text: torch.Tensor | None = None
    image_embeds: torch.Tensor | None = None
    text_embeds: torch.Tensor | None = None


class M2EncoderModel(PreTrainedModel):
    config_class = M2EncoderConfig
    base_model_prefix = "m2"
    main_input_name = "pixel_values"

    def __init__(self, config: M2EncoderConfig):
        super().__init__(config)
        self.m2 = M2Encoder(config)
        self.post_init()

    def _init_weights(self, module: torch.nn.Module) -> None:
        """The network initialises itself when built; a folder's weights cover every tensor."""

    def get_image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.m2.encode_image(pixel_values, normalize=False)

    def get_text_features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        return self.m2.encode_text(input_ids, attention_mask, normalize=False)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        **kwargs,
    ) -> M2EncoderOutput:
        image = text = per_image = None
        if pixel_values is not None:
            image = F.normalize(self.get_image_features(pixel_values), dim=-1)
        if input_ids is not None:
            text = F.normalize(self.get_text_features(input_ids, attention_mask), dim=-1)
        if image is not None and text is not None:
            per_image = self.m2.logit_scale.exp().clamp(max=100.0) * image @ text.t()
        return M2EncoderOutput(
            logits_per_image=per_image,
            logits_per_text=None if per_image is None else per_image.t(),
            image_embeds=image,
            text_embeds=text,
        )
