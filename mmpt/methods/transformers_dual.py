"""`transformers`: fine-tune a dual encoder transformers ships (CLIPModel, ChineseCLIPModel, SiglipModel,
Siglip2Model, AltCLIPModel; a hub name or a local folder) on mmpt's data, engine, evaluation and export.

The model, tokenizer and image preprocessing are the checkpoint's (transformers' code); the loss is the
checkpoint's own (sigmoid for SigLIP and SigLIP 2, contrastive otherwise) unless `method.loss` chooses.
The run directory keeps the checkpoint's config, tokenizer and image processor (no weights) in `transformers/`,
so a run or release builds the model without the original checkpoint.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Literal, cast

from pydantic import Field
from torch import nn
from torchvision import transforms as T

from mmpt.config import Config, ConfigError, Section
from mmpt.errors import first_line
from mmpt.methods import register
from mmpt.methods.base import EngineNeeds, MethodConfig
from mmpt.methods.image_text import (
    TINY_IMAGE_TEXT_DATA,
    ContrastiveLossConfig,
    ImageTextLossConfig,
    ImageTextMethod,
    SigmoidLossConfig,
    eval_batch_size_field,
)
from mmpt.methods.teacher import DistillOption
from mmpt.methods.towers import Tower, image_text_towers
from mmpt.models.locking import TowerGroups, TowerLocks, lock_towers
from mmpt.models.lora import LoraOption, add_lora
from mmpt.models.switches import TowerSwitches
from mmpt.models.transformers_dual import (
    SIGMOID_TYPES,
    CenterCropFloor,
    TransformersDualEncoder,
    TransformersTokenizer,
    check_weights,
    context_length,
    image_size,
    load_config,
    read_image_processor,
    read_tokenizer,
)

FOLDER = "transformers"  # in the run directory: the checkpoint's config, tokenizer and image processor


class ImagePreprocessing(Section):
    """The checkpoint image processor's steps, read from it when the run starts (PIL resizing, as transformers'
    "pil" backend; its torchvision backend resizes tensors and differs by a few grey levels)."""

    height: int = Field(gt=0, description="height of the model's input images")
    width: int = Field(gt=0, description="width of the model's input images")
    shortest_edge: int | None = Field(
        default=None, gt=0, description="resize the shorter side to this, then center-crop (null: resize to the size)"
    )
    interpolation: Literal["nearest", "bilinear", "bicubic", "lanczos", "box", "hamming"] = "bicubic"
    mean: tuple[float, float, float]
    std: tuple[float, float, float]


class TransformersConfig(MethodConfig, TowerSwitches, TowerLocks, LoraOption, DistillOption):
    """`grad_checkpointing` covers both towers (transformers' activation checkpointing); `patch_dropout` the image
    tower's patch tokens after its embeddings (not SigLIP 2's, whose patches carry a mask)."""

    name: Literal["transformers"] = "transformers"
    model: str = Field(description="a transformers dual encoder: a local folder (save_pretrained's) or a hub name")
    trust_remote_code: bool = Field(
        default=False, description="let transformers run modelling code the checkpoint ships"
    )
    loss: ImageTextLossConfig | None = Field(
        default=None,
        description="the training loss: contrastive or sigmoid (null: the checkpoint's own, sigmoid for SigLIP and "
        "SigLIP 2)",
    )
    context_length: int | None = Field(
        default=None, gt=0, description="tokens per caption (null: the text tower's positions, at most 77)"
    )
    image: ImagePreprocessing | None = Field(
        default=None, description="image preprocessing (null: the checkpoint's image processor's, filled in at start)"
    )
    eval_batch_size: int = eval_batch_size_field()


def preprocessing_of(processor: Any) -> ImagePreprocessing:
    """What `processor` (a transformers image processor) does, as mmpt's settings."""
    from PIL import Image

    if abs(float(processor.rescale_factor) - 1 / 255) > 1e-12 or not processor.do_normalize:
        raise ConfigError("config key 'method.model': its image processor does not rescale by 1/255 and normalize")
    height, width = image_size(processor)
    shortest = None
    if not getattr(processor, "max_num_patches", None) and not processor.size.height:
        shortest = int(processor.size.shortest_edge)
    return ImagePreprocessing(
        height=height,
        width=width,
        shortest_edge=shortest,
        interpolation=cast(Any, Image.Resampling(processor.resample).name.lower()),
        mean=tuple(processor.image_mean),
        std=tuple(processor.image_std),
    )


class TransformersMethod(ImageTextMethod[TransformersConfig]):
    name = "transformers"
    config_class = TransformersConfig
    tower_switches = "method"
    tiny_overrides = (*TINY_IMAGE_TEXT_DATA, "method.model={transformers_clip}")

    def _config(self, cfg: Config) -> Any:
        m = self.settings(cfg)
        return load_config(m.model, m.trust_remote_code)

    def _run_config(self, run_dir: Path, cfg: Config) -> Any:
        """The checkpoint's config as the run keeps it (the source's before `prepare` ran)."""
        folder = run_dir / FOLDER
        return load_config(str(folder)) if folder.is_dir() else self._config(cfg)

    def resolve_defaults(self, cfg: Config) -> None:
        """The checkpoint's own loss, caption length and image preprocessing, named in the run's config: a run or
        release then builds without the checkpoint."""
        m = self.settings(cfg)
        m.context_length = context_length(self._config(cfg), m.context_length)
        m.loss = self.loss_spec(cfg)
        if m.image is None:
            m.image = preprocessing_of(read_image_processor(m.model))

    def input_paths(self, cfg: Config) -> dict[str, str | None]:
        return {}  # `method.model` may name a hub checkpoint: `load_config` says what is missing

    def check_initial_weights(self, cfg: Config) -> None:
        m = self.settings(cfg)
        check_weights(m.model)
        read_tokenizer(m.model, m.trust_remote_code)

    def loss_spec(self, cfg: Config) -> ContrastiveLossConfig | SigmoidLossConfig:
        chosen = self.settings(cfg).loss
        if chosen is not None:
            return chosen
        return SigmoidLossConfig() if self._config(cfg).model_type in SIGMOID_TYPES else ContrastiveLossConfig()

    def prepare_files(self, cfg: Config, run_dir: Path) -> None:
        """The checkpoint's config, tokenizer and image processor (no weights) into the run directory."""
        m, folder = self.settings(cfg), run_dir / FOLDER
        if Path(m.model).expanduser().resolve() == folder.resolve():
            return
        self._config(cfg).save_pretrained(folder)
        read_tokenizer(m.model, m.trust_remote_code).save_pretrained(folder)
        read_image_processor(m.model).save_pretrained(folder)

    def release_files(self, cfg: Config) -> list[str]:
        return [FOLDER]

    def tokenizer(self, cfg: Config, run_dir: Path) -> TransformersTokenizer:
        folder = run_dir / FOLDER
        source = folder if folder.is_dir() else Path(self.settings(cfg).model)
        return TransformersTokenizer(
            source, context_length(self._run_config(run_dir, cfg), self.settings(cfg).context_length)
        )

    def _image(self, cfg: Config) -> ImagePreprocessing:
        m = self.settings(cfg)
        return m.image or preprocessing_of(read_image_processor(m.model))

    def image_transform(self, cfg: Config, train: bool) -> T.Compose:
        """The image processor's steps on PIL images; training draws open_clip's crop (RandomResizedCrop, scale
        0.9-1) instead."""
        image = self._image(cfg)
        size, interpolation = (image.height, image.width), T.InterpolationMode(image.interpolation)
        steps: list[Any]
        if train:
            steps = [T.RandomResizedCrop(size, scale=(0.9, 1.0), interpolation=interpolation)]
        elif image.shortest_edge is None:
            steps = [T.Resize(size, interpolation=interpolation)]
        else:
            steps = [T.Resize(image.shortest_edge, interpolation=interpolation), CenterCropFloor(*size)]
        return T.Compose([*steps, T.ToTensor(), T.Normalize(image.mean, image.std)])

    def build_model(self, cfg: Config, run_dir: Path) -> TransformersDualEncoder:
        loss, m = self.loss_spec(cfg), self.settings(cfg)
        bias = -10.0 if isinstance(loss, SigmoidLossConfig) else None  # SigLIP's start, where the checkpoint has none
        config = self._run_config(run_dir, cfg)
        model = TransformersDualEncoder(config, bias, m)
        model.context_length = context_length(config, m.context_length)
        image = self._image(cfg)
        model.image_mean, model.image_std = image.mean, image.std
        lock_towers(self.tower_groups(model), m, model)
        if m.lora is not None:
            add_lora(model, m.lora, within=model.hf)
        return model

    def load_initial_weights(self, model: nn.Module, cfg: Config) -> str | None:
        """The checkpoint's weights through transformers' `from_pretrained` (its file layouts and renames), strictly."""
        from transformers import AutoModel

        m = self.settings(cfg)
        try:
            loaded, info = AutoModel.from_pretrained(
                m.model, trust_remote_code=m.trust_remote_code, output_loading_info=True, dtype="float32"
            )
        except Exception as exc:
            raise ConfigError(
                f"config key 'method.model': cannot load weights from {m.model}: {first_line(exc)}"
            ) from None
        problems = [
            (kind, names) for kind in ("missing_keys", "unexpected_keys", "mismatched_keys") if (names := info[kind])
        ]
        if problems:
            kind, names = problems[0]
            raise ConfigError(f"config key 'method.model': {m.model}: {kind.replace('_', ' ')}: {sorted(names)[0]}")
        state = loaded.state_dict()
        cast(TransformersDualEncoder, model).load_hf_state_dict(state)
        return f"initialised {len(state)} of {len(state)} tensors from {m.model} ({type(loaded).__name__}, strict)"

    def tower_groups(self, model: TransformersDualEncoder) -> dict[str, TowerGroups]:
        return model.tower_groups()

    def engine_needs(self, model: TransformersDualEncoder, cfg: Config) -> EngineNeeds:
        return EngineNeeds(compilable=(model.hf.vision_model, model.hf.text_model), **self.image_text_needs(model, cfg))

    # --- export ---

    export_formats = ("transformers",)

    def transformers_export(self, model: nn.Module, cfg: Config, run_dir: Path, out: Path) -> None:
        """The transformers model with its trained weights (the logit scale in its own shape; a bias mmpt added for
        the sigmoid loss has no place there and is left out, said in a note), and the run's tokenizer and image
        processor; the tokenizer truncates where training did (`model_max_length`: the model's context length)."""
        dual = cast(TransformersDualEncoder, model)
        added = getattr(dual, "logit_bias", None)
        if added is not None:
            print(
                f"note: {type(dual.hf).__name__} has no logit bias: the one the sigmoid loss trained "
                f"({added.item():.4g}) is not in the export (rankings are unchanged; sigmoid probabilities need it)",
                file=sys.stderr,
            )
        dual.hf.save_pretrained(out, state_dict=dual.hf_state_dict())
        tokenizer = read_tokenizer(run_dir / FOLDER)
        tokenizer.model_max_length = dual.context_length
        tokenizer.save_pretrained(out)
        read_image_processor(run_dir / FOLDER).save_pretrained(out)

    def export_towers(self, model: nn.Module, cfg: Config) -> list[Tower]:
        dual = cast(TransformersDualEncoder, model)
        vocab = int(dual.hf.config.text_config.vocab_size)
        return image_text_towers(model, self._image(cfg).height, vocab, dual.context_length, dual.reads_mask)

    def architecture(self, cfg: Config, run_dir: Path) -> str:
        config = self._run_config(run_dir, cfg)
        return (
            f"transformers `{config.architectures[0] if config.architectures else config.model_type}` from "
            f"{self.settings(cfg).model}: transformers' own model code"
        )


METHOD = register(TransformersMethod())
