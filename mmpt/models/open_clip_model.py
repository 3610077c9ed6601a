"""Any open_clip architecture as an mmpt image-text model, built from its name or a JSON model config.

open_clip keeps `logit_scale` (and SigLIP's `logit_bias`) as 0-D parameters, which DeepSpeed cannot flatten; they
are re-made with shape [1] (same values), and every other parameter is open_clip's own.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import open_clip
import torch
from timm.layers.patch_dropout import PatchDropout
from torch import nn

from mmpt.config import ConfigError
from mmpt.models.switches import TowerSwitches

# open_clip model configs that travel with mmpt (`<name>.json` beside this file), known by name wherever it is
# installed: the open_clip demo's and the benchmarks' small ViT.
SHIPPED_MODEL_CONFIGS = Path(__file__).parent


def register_model_config(model: str) -> str:
    """The open_clip name of `model`: a known name, a JSON config file registered under its stem, or the name of
    one of mmpt's shipped configs (registered on first use)."""
    shipped = SHIPPED_MODEL_CONFIGS / f"{model}.json"
    if model.endswith(".json") or (model not in open_clip.list_models() and shipped.is_file()):
        path = Path(model) if model.endswith(".json") else shipped
        if not path.is_file():
            raise ConfigError(f"config key 'method.model': open_clip model config {path} does not exist")
        try:
            open_clip.add_model_config(path)
        except ValueError as exc:  # json's decode error
            raise ConfigError(f"config key 'method.model': {path} is not a JSON model config ({exc})") from None
        return path.stem
    if model not in open_clip.list_models():
        raise ConfigError(
            f"config key 'method.model': {model!r} is not an open_clip model (see open_clip.list_models())"
        )
    return model


def preprocess_settings(model: str, image_size: int | None = None) -> dict:
    """open_clip's preprocessing settings of `model` (its vision_cfg keys, open_clip's defaults otherwise)."""
    config = open_clip.get_model_config(register_model_config(model))
    if config is None:
        raise ValueError(f"config key 'method.model': open_clip knows no model {model!r}")
    vision = config.get("vision_cfg", {})
    return {
        "image_size": image_size or vision["image_size"],
        "mean": tuple(vision.get("image_mean", open_clip.OPENAI_DATASET_MEAN)),
        "std": tuple(vision.get("image_std", open_clip.OPENAI_DATASET_STD)),
        "interpolation": vision.get("image_interpolation", "bicubic"),
        "resize_mode": vision.get("image_resize_mode", "shortest"),
    }


def create_open_clip(
    model: str, image_size: int | None, logits: dict[str, Any], quick_gelu: bool = False, device: str | None = None
) -> Any:
    """open_clip's network for `model`, randomly initialised (weights are mmpt's to load); on `device`, by
    default torch's current default device (the meta device inside `with torch.device("meta")`, where open_clip
    moving the model to the CPU would fail). open_clip's warning that the model is "initialized randomly" is
    left out: mmpt loads the weights next, and says what it loaded."""
    quiet = _WithoutRandomInitWarning()
    logging.getLogger().addFilter(quiet)
    try:
        return open_clip.create_model(
            register_model_config(model),
            pretrained=None,
            force_image_size=image_size,
            force_quick_gelu=quick_gelu,
            device=device or torch.get_default_device(),
            **logits,
        )
    finally:
        logging.getLogger().removeFilter(quiet)


class _WithoutRandomInitWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("No pretrained weights loaded for model")


class OpenClipModel(nn.Module):
    """An open_clip model; images are expected normalised with `image_mean` / `image_std` (its preprocessing's)."""

    def __init__(
        self,
        model: str,
        image_size: int | None = None,
        switches: TowerSwitches | None = None,
        logits: dict[str, Any] | None = None,
        quick_gelu: bool = False,
    ):
        """`logits`: open_clip's `init_logit_scale` / `init_logit_bias` where the loss wants others than the
        architecture's (a bias makes open_clip keep `logit_bias`); `quick_gelu`: as OpenAI's weights need."""
        super().__init__()
        switches = switches or TowerSwitches()
        # open_clip builds one of several CLIP classes; all have encode_image, encode_text and logit_scale
        self.clip: Any = create_open_clip(model, image_size, logits or {}, quick_gelu)
        if switches.patch_dropout:
            self._swap_patch_dropout(model, switches.patch_dropout)
        self.set_grad_checkpointing(switches.grad_checkpointing)
        settings = preprocess_settings(model, image_size)
        self.image_mean, self.image_std = settings["mean"], settings["std"]
        for name in ("logit_scale", "logit_bias"):
            if getattr(self.clip, name, None) is not None:
                value = getattr(self.clip, name).detach().reshape(1).clone()
                delattr(self.clip, name)
                setattr(self.clip, name, nn.Parameter(value))

    def _swap_patch_dropout(self, model: str, prob: float) -> None:
        """open_clip's patch dropout draws its patch choice on the host and indexes the device tensor with it
        (two host-to-device copies a step); timm's draws on the device and gathers, with the same result."""
        current = getattr(self.clip.visual, "patch_dropout", None)
        if current is None:
            raise ConfigError(
                f"config key 'method.patch_dropout': open_clip model {model!r} has no patch tokens (patch dropout "
                "needs a ViT image tower); set it to 0"
            )
        prefix = 1 if getattr(current, "exclude_first_token", True) else 0
        self.clip.visual.patch_dropout = PatchDropout(prob, num_prefix_tokens=prefix)

    @property
    def grad_checkpointing(self) -> bool:
        return self._grad_checkpointing

    def set_grad_checkpointing(self, enabled: bool = True) -> None:
        """open_clip's switch: both towers' transformer blocks (a ResNet image tower is not checkpointed)."""
        self.clip.set_grad_checkpointing(enabled)
        self._grad_checkpointing = enabled

    def encode_image(self, images: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        return self.clip.encode_image(images, normalize=normalize)

    def encode_text(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, normalize: bool = True
    ) -> torch.Tensor:
        return self.clip.encode_text(input_ids, normalize=normalize)  # open_clip pools at the end token itself

    def forward(self, images: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
        """(image features, text features, logit scale multiplier clamped at 100) and, for a model with one (SigLIP
        architectures, or built for the sigmoid loss), the logit bias: as open_clip trains."""
        features = self.encode_image(images), self.encode_text(input_ids)
        scale, bias = self.clip.logit_scale.exp().clamp(max=100.0), getattr(self.clip, "logit_bias", None)
        return (*features, scale) if bias is None else (*features, scale, bias)


class OpenClipTokenizer:
    """open_clip's tokenizer for `model`, returning {"input_ids", "attention_mask"} like mmpt's tokenizers."""

    def __init__(self, model: str):
        self.model = model
        self._tokenizer = open_clip.get_tokenizer(register_model_config(model))

    def __call__(self, texts: list[str]) -> dict[str, torch.Tensor]:
        ids = self._tokenizer(list(texts))
        return {"input_ids": ids, "attention_mask": (ids != 0).long()}

    def __getstate__(self):
        return {"model": self.model}  # rebuilt in loader workers, where the config must be registered again

    def __setstate__(self, state):
        self.__init__(state["model"])
