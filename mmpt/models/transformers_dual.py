"""The dual encoders transformers ships (CLIPModel, ChineseCLIPModel, SiglipModel, Siglip2Model, AltCLIPModel) as
mmpt image-text models: transformers' own modelling code, its tokenizer, and its image processor's steps as a
torchvision transform.

The model is built from its config (`from_config`); pretrained weights are loaded by the method, through
transformers' `from_pretrained` (safetensors or pickles read with `weights_only`; remote modelling code only
where `trust_remote_code` says so).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from PIL import Image
from timm.layers.patch_dropout import PatchDropout
from torch import nn

from mmpt.config import ConfigError
from mmpt.errors import first_line
from mmpt.models.locking import TowerGroups, largest_layer_list, layered_groups
from mmpt.models.lora import base_state, load_base_state
from mmpt.models.pretrained_towers import transformers_config
from mmpt.models.switches import TowerSwitches

KEY = "method.model"
# model_type -> whether its text tower reads the padding mask: the BERT-family ones (bidirectional attention) do;
# CLIP's pools at the end token with causal attention, which no later padding reaches; SigLIP's pools the last
# token of a fixed-length, unmasked sequence, as it was trained.
DUAL_ENCODERS = {"clip": False, "chinese_clip": True, "altclip": True, "siglip": False, "siglip2": False}
SIGMOID_TYPES = ("siglip", "siglip2")
LONGEST_CONTEXT = 77  # CLIP's; BERT-family text towers allow 512 but were trained on short captions
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def load_config(source: str, trust_remote_code: bool = False) -> Any:
    """The transformers config of `source` (a folder, or a hub name: its cache, or a download where a network
    exists); ConfigError naming `method.model` where it cannot be read or is not one of `DUAL_ENCODERS`."""
    config = transformers_config(source, KEY, trust_remote_code)
    if config.model_type not in DUAL_ENCODERS:
        known = ", ".join(DUAL_ENCODERS)
        raise ConfigError(
            f"config key '{KEY}': {source} is a '{config.model_type}' model, not a dual encoder mmpt trains ({known})"
        )
    return config


def check_weights(source: str) -> None:
    """A local folder must hold weights in one of transformers' layouts (a hub name is fetched when loaded)."""
    folder = Path(source).expanduser()
    if folder.is_dir() and not any((folder / name).is_file() for name in WEIGHT_FILES):
        raise ConfigError(f"config key '{KEY}': {folder} holds no weights (none of {', '.join(WEIGHT_FILES)})")


def context_length(config: Any, chosen: int | None) -> int:
    """Tokens per caption: `chosen`, else the text tower's position table capped at CLIP's 77."""
    longest = int(config.text_config.max_position_embeddings)
    if chosen is not None and chosen > longest:
        raise ConfigError(f"config key 'method.context_length': {chosen} exceeds the text tower's {longest} positions")
    return chosen or min(longest, LONGEST_CONTEXT)


class TransformersDualEncoder(nn.Module):
    """`hf` is the transformers model; its 0-D `logit_scale` is re-made with shape [1] (DeepSpeed flattens no 0-D
    parameter). `logit_bias`: where the loss wants one and the checkpoint has none, a new one starting there."""

    def __init__(self, config: Any, logit_bias: float | None = None, switches: TowerSwitches | None = None):
        from transformers import AutoModel

        super().__init__()
        self.model_type: str = config.model_type
        self.hf: Any = AutoModel.from_config(config)
        self.reads_mask = DUAL_ENCODERS[self.model_type]
        scale = self.hf.logit_scale
        self.scale_shape = scale.shape  # the checkpoint's: 0-D, or [1] (SigLIP's)
        del self.hf.logit_scale
        self.hf.logit_scale = nn.Parameter(scale.detach().reshape(1).clone())
        own = getattr(self.hf, "logit_bias", None)
        self.reads_bias = logit_bias is not None
        if logit_bias is not None and own is None:
            self.logit_bias = nn.Parameter(torch.full((1,), float(logit_bias)))
        elif logit_bias is None and own is not None:
            own.requires_grad_(False)  # the contrastive loss reads no bias
        self.patch_size = int(config.vision_config.patch_size)
        self.context_length = LONGEST_CONTEXT  # the method sets the run's
        switches = switches or TowerSwitches()
        self.set_grad_checkpointing(switches.grad_checkpointing)
        if switches.patch_dropout:
            self._add_patch_dropout(switches.patch_dropout)
        self.image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
        self.image_std: tuple[float, ...] = (0.5, 0.5, 0.5)

    @property
    def bias(self) -> nn.Parameter | None:
        """The logit bias the loss reads: the checkpoint's, or the one added for the sigmoid loss; None for the
        contrastive loss."""
        if not self.reads_bias:
            return None
        own = getattr(self.hf, "logit_bias", None)
        return own if own is not None else self.logit_bias

    def _add_patch_dropout(self, prob: float) -> None:
        """timm's patch dropout on the image embeddings' output (the class token kept where there is one)."""
        if self.model_type == "siglip2":
            raise ConfigError(
                "config key 'method.patch_dropout': SigLIP 2's image tower masks its patches itself; set it to 0"
            )
        embeddings = self.hf.vision_model.embeddings
        prefix = 1 if hasattr(embeddings, "class_embedding") else 0
        self.patch_dropout = PatchDropout(prob, num_prefix_tokens=prefix)
        embeddings.register_forward_hook(lambda module, args, tokens: self.patch_dropout(tokens))

    def tower_groups(self) -> dict[str, TowerGroups]:
        """Each tower's parameters by block (for locking): its embeddings, its layers, its final norm, head and
        projection (SigLIP's towers hold theirs; the others' projections sit beside them)."""
        towers = {}
        for name, tower, projection in (
            ("image", self.hf.vision_model, "visual_projection"),
            ("text", self.hf.text_model, "text_projection"),
        ):
            after = [getattr(self.hf, projection)] if hasattr(self.hf, projection) else []
            towers[name] = layered_groups(tower, largest_layer_list(tower), *after)
        return towers

    def set_grad_checkpointing(self, enabled: bool = True) -> None:
        if enabled:
            self.hf.activation_checkpointing_enable({"use_reentrant": False})
        else:
            self.hf.activation_checkpointing_disable()
        self.grad_checkpointing = enabled

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The transformers model's own state dict (its logit scale 0-D again)."""
        state = {name: value.detach() for name, value in base_state(self.hf).items()}
        state["logit_scale"] = state["logit_scale"].reshape(self.scale_shape)
        return state

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load a transformers model's state dict (0-D or [1] logit scale) strictly (LoRA adapters aside)."""
        state = dict(state)
        state["logit_scale"] = state["logit_scale"].reshape(1)
        load_base_state(self.hf, state)

    def _image_inputs(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.model_type != "siglip2":
            return {"pixel_values": images}
        # SigLIP 2 reads patches [B, N, p*p*C] (channels last inside a patch), a patch mask and the patch grid
        b, c, h, w = images.shape
        p = self.patch_size
        patches = images.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 3, 5, 1).reshape(b, -1, p * p * c)
        grid = torch.tensor([[h // p, w // p]], device=images.device).expand(b, 2)
        mask = torch.ones(patches.shape[:2], dtype=torch.long, device=images.device)
        return {"pixel_values": patches, "pixel_attention_mask": mask, "spatial_shapes": grid}

    def encode_image(self, images: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        features = self.hf.get_image_features(**self._image_inputs(images)).pooler_output
        return F.normalize(features, dim=-1) if normalize else features

    def encode_text(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, normalize: bool = True
    ) -> torch.Tensor:
        mask = None
        if self.reads_mask and attention_mask is not None:
            # given as the additive [B, 1, 1, L] mask: transformers then skips its check whether any token is
            # padding, which reads the device from the host
            dtype = self.hf.text_projection.weight.dtype
            mask = (1 - attention_mask[:, None, None, :].to(dtype)) * torch.finfo(dtype).min
        features = self.hf.get_text_features(input_ids=input_ids, attention_mask=mask).pooler_output
        return F.normalize(features, dim=-1) if normalize else features

    def forward(self, images: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
        """(image features, text features, logit scale multiplier clamped at 100) and the bias where the loss
        reads one, as `OpenClipModel` gives them."""
        features = self.encode_image(images), self.encode_text(input_ids, attention_mask)
        scale = self.hf.logit_scale.exp().clamp(max=100.0)
        return (*features, scale) if self.bias is None else (*features, scale, self.bias)


class TransformersTokenizer:
    """The checkpoint's tokenizer as mmpt's tokenizers are called: texts -> {"input_ids", "attention_mask"}, padded
    to `context_length` (SigLIP's text tower was trained on padded, unmasked sequences of that length)."""

    def __init__(self, folder: str | Path, context_length: int):
        self.folder, self.context_length = str(folder), context_length
        self._tokenizer = read_tokenizer(self.folder)

    def __call__(self, texts: list[str]) -> dict[str, torch.Tensor]:
        found = self._tokenizer(
            list(texts), padding="max_length", truncation=True, max_length=self.context_length, return_tensors="pt"
        )
        return {"input_ids": found["input_ids"], "attention_mask": found["attention_mask"]}

    @property
    def vocab_size(self) -> int:
        return len(self._tokenizer)

    def __getstate__(self):
        return {"folder": self.folder, "context_length": self.context_length}

    def __setstate__(self, state):
        self.__init__(state["folder"], state["context_length"])


class CenterCropFloor:
    """A center crop whose offsets round down, as transformers' image processors crop (torchvision rounds)."""

    def __init__(self, height: int, width: int):
        self.height, self.width = height, width

    def __call__(self, image: Image.Image) -> Image.Image:
        left, top = (image.width - self.width) // 2, (image.height - self.height) // 2
        return image.crop((left, top, left + self.width, top + self.height))

    def __repr__(self) -> str:
        return f"CenterCropFloor({self.height}, {self.width})"


def read_image_processor(folder: str | Path) -> Any:
    """The checkpoint's image processor, PIL backend: the resizing mmpt's PIL pipeline reproduces exactly."""
    from transformers import AutoImageProcessor

    try:
        return AutoImageProcessor.from_pretrained(str(folder), backend="pil")
    except Exception as exc:  # neither file, or one transformers cannot read
        raise ConfigError(
            f"config key '{KEY}': cannot read an image processor (preprocessor_config.json or processor_config.json) "
            f"from {folder}: {first_line(exc)}"
        ) from None


def read_tokenizer(folder: str | Path, trust_remote_code: bool = False) -> Any:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
    except Exception as exc:  # no tokenizer files
        raise ConfigError(f"config key '{KEY}': cannot read a tokenizer from {folder}: {first_line(exc)}") from None
    if len(tokenizer) <= len(set(tokenizer.all_special_tokens)):  # transformers makes one from the config alone
        raise ConfigError(
            f"config key '{KEY}': {folder} has no tokenizer files (the tokenizer read from it knows only its "
            f"special tokens {tokenizer.all_special_tokens})"
        )
    return tokenizer


def image_size(processor: Any) -> tuple[int, int]:
    """(height, width) of the images the processor gives; SigLIP 2's as a square of its most patches."""
    if getattr(processor, "max_num_patches", None):
        side = math.isqrt(int(processor.max_num_patches)) * int(processor.patch_size)
        return side, side
    crop = processor.crop_size if getattr(processor, "do_center_crop", False) else None
    size = crop or processor.size
    if size.height:
        return int(size.height), int(size.width)
    return int(size.shortest_edge), int(size.shortest_edge)
