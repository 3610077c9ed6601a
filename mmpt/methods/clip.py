"""`clip`: a two-tower image-text model trained with the global contrastive loss.

The reference method of the spine: a timm image tower, a BERT text tower trained from scratch with
a corpus-trained bilingual tokenizer, and zero-shot classification in every configured language at
the end of training.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Literal, cast

import torch
from open_clip import image_transform
from open_clip.constants import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD
from pydantic import Field, model_validator
from torch import nn
from torchvision import transforms as T
from transformers import BertConfig

from mmpt.config import Config, ConfigError
from mmpt.data.tokenizer import TextTokenizer
from mmpt.methods import register
from mmpt.methods.base import EngineNeeds, MethodConfig, OpenClipFolder, count
from mmpt.methods.image_text import (
    TINY_IMAGE_TEXT_DATA,
    ImageTextLossConfig,
    ImageTextMethod,
    PlacementAugment,
    eval_batch_size_field,
    image_text_loss_field,
    initial_logits,
)
from mmpt.methods.teacher import DistillOption
from mmpt.methods.towers import Tower, image_text_towers
from mmpt.models.clip import ClipModel, ImageTowerConfig, TextTowerConfig
from mmpt.models.locking import TowerGroups, TowerLocks, layered_groups, lock_towers, timm_groups
from mmpt.models.lora import LoraOption, add_lora, load_base_state
from mmpt.models.pretrained_towers import check_image_weights, image_weights, text_config, text_encoder, text_weights
from mmpt.models.switches import timm_tower

# A `clip` image tower's timm arguments that open_clip's timm adapter sets itself (as `vision_cfg` keys); they
# are training-time regularisers and change no weight. Any other argument (img_size, depth, patch_size, ...)
# builds a network open_clip cannot build, since its adapter passes no other timm.create_model arguments.
OPEN_CLIP_TIMM_KWARGS = {"drop_path_rate": "timm_drop_path"}
TEXT_ENCODER = "text_encoder"  # in the run directory: the pretrained text encoder's config


class ClipConfig(MethodConfig, TowerLocks, LoraOption, DistillOption):
    name: Literal["clip"] = "clip"
    image: ImageTowerConfig = Field(default_factory=ImageTowerConfig)
    text: TextTowerConfig = Field(default_factory=TextTowerConfig)
    embed_dim: int = Field(default=256, gt=0)
    tokenizer: str | None = Field(
        default=None,
        description="path of a `tokenizers` tokenizer.json (copied into the run directory); null with "
        "text.pretrained: that checkpoint's tokenizer",
    )
    image_mean: tuple[float, float, float] = OPENAI_DATASET_MEAN
    image_std: tuple[float, float, float] = OPENAI_DATASET_STD
    augment: PlacementAugment = Field(
        default_factory=PlacementAugment, description="added to open_clip's training transform (crop 0.9-1)"
    )
    eval_batch_size: int = eval_batch_size_field()
    loss: ImageTextLossConfig = image_text_loss_field()

    @model_validator(mode="after")
    def _a_tokenizer(self) -> ClipConfig:
        if self.tokenizer is None and self.text.pretrained is None:
            raise ValueError(
                "set method.tokenizer (a tokenizer.json), or method.text.pretrained to an encoder with one"
            )
        return self


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
    )

    def tokenizer_file_name(self, cfg: Config) -> str:
        return "tokenizer.json"

    def tokenizer_source(self, cfg: Config) -> str | None:
        return self.settings(cfg).tokenizer

    def load_tokenizer(self, path: Path, cfg: Config) -> TextTokenizer:
        return TextTokenizer(path, self.settings(cfg).text.context_length)

    def prepare_files(self, cfg: Config, run_dir: Path) -> None:
        """The tokenizer (method.tokenizer's, or the pretrained text encoder's as a tokenizer.json) and the
        pretrained text encoder's config, so that the run builds its model without the checkpoint."""
        m = self.settings(cfg)
        if m.tokenizer is not None:
            super().prepare_files(cfg, run_dir)
        elif m.text.pretrained is not None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(m.text.pretrained)
            tokenizer.backend_tokenizer.save(str(run_dir / self.tokenizer_file_name(cfg)))
        if m.text.pretrained is not None:
            text_config(m.text.pretrained).save_pretrained(run_dir / TEXT_ENCODER)

    def release_files(self, cfg: Config) -> list[str]:
        return [*super().release_files(cfg), *([TEXT_ENCODER] if self.settings(cfg).text.pretrained else [])]

    def check_initial_weights(self, cfg: Config) -> None:
        super().check_initial_weights(cfg)
        m = self.settings(cfg)
        if m.image.pretrained is not None:
            check_image_weights(m.image.timm_name, m.image.pretrained)
        if m.text.pretrained is not None:
            text_config(m.text.pretrained)

    def load_initial_weights(self, model: nn.Module, cfg: Config) -> str | None:
        m, clip, loaded = self.settings(cfg), cast(ClipModel, model), []
        if m.image.pretrained is not None:
            load_base_state(clip.visual, image_weights(m.image.timm_name, m.image.pretrained, m.image.timm_kwargs))
            loaded.append(f"image tower from {m.image.pretrained} ({m.image.timm_name})")
        if m.text.pretrained is not None:
            load_base_state(clip.text, text_weights(m.text.pretrained, clip.text.config))
            loaded.append(f"text tower from {m.text.pretrained}")
        return "; ".join(loaded) or None

    def image_transform(self, cfg: Config, train: bool):
        m = self.settings(cfg)
        transform = image_transform(m.image.image_size, is_train=train, mean=m.image_mean, std=m.image_std)
        return m.augment.apply_to(cast(T.Compose, transform)) if train else transform

    def build_model(self, cfg: Config, run_dir: Path) -> ClipModel:
        m = self.settings(cfg)
        text = m.text
        if text.vocab_size is None and text.pretrained is None:
            text = text.model_copy(update={"vocab_size": self.tokenizer(cfg, run_dir).vocab_size})
        encoder = None if text.pretrained is None else text_encoder(self._text_encoder_config(m, run_dir))
        model = ClipModel(
            m.image,
            text,
            m.embed_dim,
            image_mean=m.image_mean,
            image_std=m.image_std,
            text_encoder=encoder,
            **initial_logits(m.loss),
        )
        lock_towers(self.tower_groups(model), m, model)
        if m.lora is not None:
            add_lora(model, m.lora)
        return model

    def tower_groups(self, model: ClipModel) -> dict[str, TowerGroups]:
        return {
            "image": timm_groups(model.visual, model.image_projection),
            "text": layered_groups(model.text, model.text.encoder.layer, model.text_projection),
        }

    def engine_needs(self, model: ClipModel, cfg: Config) -> EngineNeeds:
        # the timm image tower, the BERT text tower
        return EngineNeeds(compilable=(model.visual, model.text), **self.image_text_needs(model, cfg))

    # --- export ---

    export_formats = ("open_clip", "transformers")  # transformers: a ChineseCLIPModel, where the layout fits

    def export_towers(self, model: nn.Module, cfg: Config) -> list[Tower]:
        clip = cast(ClipModel, model)
        text = clip.text.config
        return image_text_towers(
            clip, self.settings(cfg).image.image_size, text.vocab_size, text.max_position_embeddings, True
        )

    @staticmethod
    def _text_encoder_config(m: ClipConfig, run_dir: Path) -> Any:
        """The pretrained text encoder's config: the run's copy, else the checkpoint's."""
        saved = run_dir / TEXT_ENCODER
        return text_config(str(saved) if saved.is_dir() else cast(str, m.text.pretrained))

    def architecture(self, cfg: Config, run_dir: Path) -> str:
        m = self.settings(cfg)
        text, image = m.text, m.image
        extra = f" (timm arguments {json.dumps(image.timm_kwargs)})" if image.timm_kwargs else ""
        tower = f"a BERT text tower of {count(text.layers, 'layer')}, width {text.width}, {count(text.heads, 'head')}"
        if text.pretrained is not None:  # the checkpoint's size, not the size keys (unread then)
            encoder = self._text_encoder_config(m, run_dir)
            size = [int(getattr(encoder, k, 0)) for k in ("num_hidden_layers", "hidden_size", "num_attention_heads")]
            tower = f"a {encoder.model_type} text tower (from {text.pretrained})" + (
                f" of {count(size[0], 'layer')}, width {size[1]}, {count(size[2], 'head')}" if all(size) else ""
            )
        return (
            f"two towers: a timm `{image.timm_name}` image tower{extra} at {image.image_size} px, and {tower}, "
            f"{text.context_length} tokens "
            f"({'mean-pooled' if text.pooling == 'mean' else 'pooled at [CLS]'}); "
            f"each projected to {m.embed_dim}-d features, L2-normalised"
        )

    def export_problem(self, cfg: Config, fmt: str) -> str | None:
        # open_clip builds a timm image tower (TimmModel) and a Hugging Face text tower (HFTextEncoder, mean
        # pooling, linear projection): the `clip` model exactly, when timm gets no argument open_clip cannot pass.
        if fmt == "transformers":
            return self._chinese_clip_problem(cfg)
        extra = sorted(set(self.settings(cfg).image.timm_kwargs) - set(OPEN_CLIP_TIMM_KWARGS))
        if fmt == "open_clip" and extra:
            return (
                f"open_clip cannot build this clip image tower: config key 'method.image.timm_kwargs' sets "
                f"{', '.join(extra)}, and open_clip's timm adapter passes no such timm.create_model argument "
                "(use --format onnx or release)"
            )
        return None

    def _chinese_clip_problem(self, cfg: Config) -> str | None:
        """Checked on the networks built on the meta device (no memory, no weights read)."""
        from mmpt.models.clip_to_chinese_clip import text_problem, vision_problem

        m = self.settings(cfg)
        with torch.device("meta"):
            visual = timm_tower(m.image.timm_name, m.image.timm_kwargs, m.image, "method.image")
        text = BertConfig()  # a new tower's; a pretrained one's where it can be read here
        if m.text.pretrained is not None:
            try:
                text = text_config(m.text.pretrained)
            except ConfigError:  # an uncached hub name: its type is checked on the built tower at export
                pass
        problem = vision_problem(visual) or text_problem(text, m.text.pooling)
        return None if problem is None else f"transformers' ChineseCLIPModel has no place for {problem}"

    def transformers_export(self, model: nn.Module, cfg: Config, run_dir: Path, out: Path) -> None:
        """A `ChineseCLIPModel` folder (`mmpt.models.clip_to_chinese_clip`) with the run's tokenizer."""
        from mmpt.models.clip_to_chinese_clip import text_problem, write_chinese_clip_model

        problem = text_problem(cast(ClipModel, model).text.config, self.settings(cfg).text.pooling)
        if problem is not None:
            raise ConfigError(f"transformers' ChineseCLIPModel has no place for {problem}")
        write_chinese_clip_model(model, self.open_clip_preprocess(cfg), out)
        cast(TextTokenizer, self.tokenizer(cfg, run_dir)).save_pretrained(out)

    def open_clip_preprocess(self, cfg: Config) -> dict[str, Any]:
        m = self.settings(cfg)
        return {  # open_clip.image_transform's interpolation and resize mode, which clip uses
            "size": m.image.image_size,
            "mean": [float(v) for v in m.image_mean],
            "std": [float(v) for v in m.image_std],
            "interpolation": "bicubic",
            "resize_mode": "shortest",
        }

    def open_clip_export(self, model: nn.Module, cfg: Config, run_dir: Path, out: Path) -> OpenClipFolder:
        """open_clip's CustomTextCLIP with its timm image adapter (`timm_model_name`, the timm network's own
        pooling, a bias-free linear projection) and its Hugging Face text adapter (`hf_model_name`: a BERT built
        from `config.json` in `out`, mean pooling over non-padding tokens, a bias-free linear projection).
        open_clip reads the padding from `pad_token_id`, mmpt from the tokenizer's mask: the same positions,
        since the tokenizer pads with that id. `hf_model_name` is `out`'s absolute path."""
        m, clip = self.settings(cfg), cast(ClipModel, model)
        tokenizer = cast(TextTokenizer, self.tokenizer(cfg, run_dir))
        text_config = copy.deepcopy(clip.text.config)
        text_config.pad_token_id = tokenizer.pad_id  # open_clip's HFTextEncoder masks the positions holding this id
        text_config.save_pretrained(out)
        tokenizer.save_pretrained(out)
        folder = str(out.resolve())
        vision: dict[str, Any] = {
            "image_size": m.image.image_size,
            "timm_model_name": m.image.timm_name,
            "timm_model_pretrained": False,
            "timm_pool": "",  # the timm network's own pooling, as mmpt builds it
            "timm_proj": "linear",
            "timm_proj_bias": False,
        }
        for key, value in m.image.timm_kwargs.items():
            vision[OPEN_CLIP_TIMM_KWARGS[key]] = value
        config: dict[str, Any] = {
            "embed_dim": m.embed_dim,
            "vision_cfg": vision,
            "text_cfg": {
                "hf_model_name": folder,
                "hf_tokenizer_name": folder,
                "hf_model_pretrained": False,
                "hf_proj_type": "linear",
                "hf_pooler_type": "mean_pooler" if m.text.pooling == "mean" else "cls_last_hidden_state_pooler",
                "context_length": tokenizer.context_length,
            },
        }
        if clip.logit_bias is not None:  # open_clip then makes a `logit_bias` parameter (the value is the state's)
            config["init_logit_bias"] = float(clip.logit_bias)
        state = {}
        for key, value in clip.state_dict().items():  # open_clip's names: CustomTextCLIP, TimmModel, HFTextEncoder
            if key.startswith("visual."):
                state["visual.trunk." + key[len("visual.") :]] = value
            elif key == "image_projection.weight":
                state["visual.head.proj.weight"] = value
            elif key.startswith("text."):
                state["text.transformer." + key[len("text.") :]] = value
            elif key == "text_projection.weight":
                state["text.proj.weight"] = value
            elif key in ("logit_scale", "logit_bias"):  # open_clip keeps both 0-D
                state[key] = value.reshape(())
            else:
                raise KeyError(f"{key}: no open_clip counterpart known for this clip parameter")
        return OpenClipFolder(
            config,
            state,
            notes=(
                "The text tower is open_clip's Hugging Face adapter over the BERT in `config.json`; "
                "`hf_model_name` and `hf_tokenizer_name` in the model config and `open_clip_config.json` name "
                "this folder by its absolute path: edit both after moving it.",
            ),
            files=(
                ("config.json", "the BERT text tower's Hugging Face config"),
                ("tokenizer.json, tokenizer_config.json", "the tokenizer (Hugging Face fast tokenizer files)"),
            ),
        )


METHOD = register(ClipMethod())
