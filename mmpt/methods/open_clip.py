"""`open_clip`: train any open_clip architecture (by name or JSON config) on mmpt's engine and data.

Same data, loss (global InfoNCE over all ranks) and zero-shot evaluation as `clip`; the model,
its tokenizer and its preprocessing (resize, crop, mean/std) are open_clip's. This is what the
throughput comparison with open_clip's own trainer runs.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any, Literal, cast

import open_clip
from open_clip import image_transform
from pydantic import Field
from torch import nn

from mmpt.config import Config
from mmpt.methods import register
from mmpt.methods.base import EngineNeeds, MethodConfig, OpenClipFolder
from mmpt.methods.image_text import (
    ContrastiveLossConfig,
    ImageTextLossConfig,
    ImageTextMethod,
    SigmoidLossConfig,
    eval_batch_size_field,
    initial_logits,
)
from mmpt.methods.teacher import DistillOption
from mmpt.methods.towers import Tower, image_text_towers
from mmpt.models.locking import TowerGroups, TowerLocks, largest_layer_list, layered_groups
from mmpt.models.lora import LoraOption, add_lora, load_base_state
from mmpt.models.open_clip_model import (
    OpenClipModel,
    OpenClipTokenizer,
    create_open_clip,
    preprocess_settings,
    register_model_config,
)
from mmpt.models.open_clip_weights import fit_to, read_weights, tag_preprocessing, tag_settings, weights_file
from mmpt.models.switches import TowerSwitches


class OpenClipConfig(MethodConfig, TowerSwitches, TowerLocks, LoraOption, DistillOption):
    """`grad_checkpointing` covers both towers (open_clip's switch); `patch_dropout` the ViT image tower; the locks
    are open_clip's own (`lock_image_tower`, `lock_text_tower`), as open_clip_train's --lock-image / --lock-text."""

    name: Literal["open_clip"] = "open_clip"
    model: str = Field(description="open_clip model name (e.g. ViT-B-32) or a path to a model config .json")
    image_size: int | None = Field(
        default=None, gt=0, description="force this input resolution (open_clip's force_image_size)"
    )
    eval_batch_size: int = eval_batch_size_field()
    loss: ImageTextLossConfig | None = Field(
        default=None,
        description="the training loss: contrastive or sigmoid (null: the architecture's own, sigmoid for the "
        "SigLIP architectures that have a logit bias, contrastive otherwise)",
    )
    pretrained: str | None = Field(
        default=None,
        description="initial weights: a pretrained tag of method.model (open_clip's cache, else a download), "
        "hf-hub:org/name, or a local file (a state dict .pt/.bin/.safetensors, or an open_clip_train checkpoint); "
        "a tag's preprocessing (mean, std, resize) is used with it",
    )


MODEL_CONFIG_FOLDER = "open_clip_config"  # a run's or release's copy of a JSON model config


class OpenClipMethod(ImageTextMethod[OpenClipConfig]):
    name = "open_clip"
    config_class = OpenClipConfig
    tower_switches = "method"
    # The model is named by an open_clip config (no size keys to shrink): the small one the benchmarks use.
    tiny_overrides = (
        'data.train.sources=[{{shards: "{digits}/train/en-*.tar"}}]',
        'data.eval=[{{dataset: "{digits}/zeroshot", task: zeroshot_classification, languages: [en]}}]',
        "method.model=bench-vit-tiny",
        "method.pretrained=null",  # a tag of the named architecture: none for the tiny one
    )
    uses_attention_mask = False  # open_clip's text tower pools at the end token

    def input_paths(self, cfg: Config) -> dict[str, str | None]:
        model = self.settings(cfg).model
        return {**super().input_paths(cfg), "method.model": model if model.endswith(".json") else None}

    def prepare_files(self, cfg: Config, run_dir: Path) -> None:
        """A JSON model config is kept in the run (open_clip ships its tokenizer), under its own name, which
        open_clip registers the model by."""
        model = self.settings(cfg).model
        if model.endswith(".json"):
            (run_dir / MODEL_CONFIG_FOLDER).mkdir(parents=True, exist_ok=True)
            target = run_dir / MODEL_CONFIG_FOLDER / Path(model).name
            if Path(model).resolve() != target.resolve():
                shutil.copyfile(model, target)

    def release_files(self, cfg: Config) -> list[str]:
        return [MODEL_CONFIG_FOLDER] if self.settings(cfg).model.endswith(".json") else []

    def use_carried_files(self, cfg: Config, folder: Path) -> None:
        model = self.settings(cfg).model
        carried = folder / MODEL_CONFIG_FOLDER / Path(model).name
        if model.endswith(".json") and carried.is_file():
            self.settings(cfg).model = str(carried)

    def tokenizer(self, cfg: Config, run_dir: Path) -> OpenClipTokenizer:
        return OpenClipTokenizer(self.settings(cfg).model)

    def image_transform(self, cfg: Config, train: bool):
        visual = self._preprocess(cfg)  # exactly image_transform's keyword arguments
        return image_transform(visual.pop("image_size"), is_train=train, **visual)

    def _preprocess(self, cfg: Config) -> dict:
        """open_clip's preprocessing settings of the model (a pretrained tag's where one is named); the model
        normalises training images with the same."""
        m = self.settings(cfg)
        return {**preprocess_settings(m.model, m.image_size), **tag_preprocessing(self._name(cfg), m.pretrained)}

    def _name(self, cfg: Config) -> str:
        return register_model_config(self.settings(cfg).model)

    def _model_config(self, cfg: Config) -> dict[str, Any]:
        """open_clip's config of the named model (registered first if it is a JSON file)."""
        return open_clip.get_model_config(self._name(cfg)) or {}

    def _quick_gelu(self, cfg: Config) -> bool:
        """OpenAI's weights were trained with QuickGELU; open_clip's tags say so."""
        return bool(tag_settings(self._name(cfg), self.settings(cfg).pretrained).get("quick_gelu", False))

    def _has_logit_bias(self, cfg: Config) -> bool:
        return self._model_config(cfg).get("init_logit_bias") is not None

    def loss_spec(self, cfg: Config) -> ContrastiveLossConfig | SigmoidLossConfig:
        chosen = self.settings(cfg).loss
        if chosen is not None:
            return chosen
        return SigmoidLossConfig() if self._has_logit_bias(cfg) else ContrastiveLossConfig()

    def build_model(self, cfg: Config, run_dir: Path) -> OpenClipModel:
        settings, logits = self.settings(cfg), self._logits(cfg)
        model = OpenClipModel(settings.model, settings.image_size, settings, logits, self._quick_gelu(cfg))
        if settings.lock_image is not None:  # open_clip's own locking: the parameters stop requiring gradients
            model.clip.lock_image_tower(unlocked_groups=settings.lock_image, freeze_bn_stats=True)
        if settings.lock_text is not None:
            model.clip.lock_text_tower(unlocked_layers=settings.lock_text)
        preprocess = self._preprocess(cfg)
        model.image_mean, model.image_std = preprocess["mean"], preprocess["std"]
        if settings.lora is not None:
            add_lora(model, settings.lora, within=model.clip)
        return model

    def _logits(self, cfg: Config) -> dict[str, Any]:
        loss = self.loss_spec(cfg)
        if isinstance(loss, ContrastiveLossConfig):
            return {"init_logit_bias": None}  # no bias, whatever the architecture says
        return {} if self._has_logit_bias(cfg) else initial_logits(loss)

    def check_initial_weights(self, cfg: Config) -> None:
        pretrained = self.settings(cfg).pretrained
        if pretrained is None:
            return
        path = weights_file(self._name(cfg), pretrained)
        meta = create_open_clip(
            self.settings(cfg).model, self.settings(cfg).image_size, self._logits(cfg), self._quick_gelu(cfg), "meta"
        )
        fit_to(meta, read_weights(path), path, f"open_clip model {self.settings(cfg).model}")

    def load_initial_weights(self, model: nn.Module, cfg: Config) -> str | None:
        pretrained = self.settings(cfg).pretrained
        if pretrained is None:
            return None
        path = weights_file(self._name(cfg), pretrained)
        clip, weights = cast(OpenClipModel, model).clip, read_weights(path)
        in_file = set(weights)
        state = fit_to(clip, weights, path, f"open_clip model {self.settings(cfg).model}")
        load_base_state(clip, state)
        new = sorted(set(state) - in_file)  # SigLIP's bias, where the sigmoid loss is chosen for CLIP weights
        kept = f"{len(state) - len(new)} of {len(state)} tensors from {path} (open_clip weights, strict"
        return f"initialised {kept}{'; new: ' + ', '.join(new) if new else ''})"

    def tower_groups(self, model: OpenClipModel) -> dict[str, TowerGroups]:
        """The ViT or ResNet image tower by its blocks; the text transformer (in a custom-text model its own module,
        else spread over the CLIP module: embeddings, blocks, final norm and projection)."""
        clip = model.clip
        image = layered_groups(clip.visual, largest_layer_list(clip.visual))
        if hasattr(clip, "text"):
            return {"image": image, "text": layered_groups(clip.text, largest_layer_list(clip.text))}
        embeddings = [clip.token_embedding.weight, clip.positional_embedding]
        blocks = [list(block.parameters()) for block in clip.transformer.resblocks]
        head = [*clip.ln_final.parameters(), clip.text_projection]
        return {"image": image, "text": [embeddings, *blocks, head]}

    def engine_needs(self, model: OpenClipModel, cfg: Config) -> EngineNeeds:
        # open_clip's image tower, and its text transformer (`text` in its custom-text models)
        text = model.clip.text if hasattr(model.clip, "text") else model.clip.transformer
        return EngineNeeds(compilable=(model.clip.visual, text), **self.image_text_needs(model, cfg))

    # --- export ---

    export_formats = ("open_clip", "transformers")  # an open_clip model already; a plain ViT CLIP as CLIPModel

    def export_problem(self, cfg: Config, fmt: str) -> str | None:
        if fmt != "transformers":
            return None
        from mmpt.models.open_clip_to_clip_model import convertible

        problem = convertible(self._model_config(cfg))
        if problem is None and isinstance(self.loss_spec(cfg), SigmoidLossConfig):
            problem = "transformers' CLIPModel has no place for the logit bias the sigmoid loss trained"
        return None if problem is None else f"{problem} (use --format open_clip, onnx or release)"

    def transformers_export(self, model: nn.Module, cfg: Config, run_dir: Path, out: Path) -> None:
        """A `CLIPModel` folder (`mmpt.models.open_clip_to_clip_model`) with open_clip's tokenizer and preprocessing."""
        from mmpt.models.open_clip_to_clip_model import write_clip_model, write_tokenizer

        clip = cast(OpenClipModel, model).clip
        write_clip_model(clip, self._model_config(cfg), self._quick_gelu(cfg), self._preprocess(cfg), out)
        write_tokenizer(self.tokenizer(cfg, run_dir)._tokenizer, out)

    def export_towers(self, model: nn.Module, cfg: Config) -> list[Tower]:
        size = self._preprocess(cfg)["image_size"]
        size = size if isinstance(size, int) else size[0]
        clip: Any = cast(OpenClipModel, model).clip  # open_clip's CLIP: vocab_size and context_length are attributes
        # its text tower adds its fixed position table to exactly context_length tokens: a fixed length
        return image_text_towers(model, size, int(clip.vocab_size), int(clip.context_length), False)

    def architecture(self, cfg: Config, run_dir: Path) -> str:
        m = self.settings(cfg)
        size = f", image size forced to {m.image_size}" if m.image_size else ""
        return f"open_clip architecture `{Path(m.model).stem}` ({m.model}{size}): open_clip's own model code"

    def open_clip_preprocess(self, cfg: Config) -> dict[str, Any]:
        found = self._preprocess(cfg)
        size = found.pop("image_size")
        return {
            "size": size,
            **found,
            "mean": [float(v) for v in found["mean"]],
            "std": [float(v) for v in found["std"]],
        }

    def open_clip_export(self, model: nn.Module, cfg: Config, run_dir: Path, out: Path) -> OpenClipFolder:
        """open_clip's own network: its parameters renamed back (`clip.` dropped, `logit_scale` 0-D again), its
        model config with the forced image size applied; a Hugging Face tokenizer it names is saved in `out`."""
        m = self.settings(cfg)
        name = register_model_config(m.model)
        config: dict[str, Any] = copy.deepcopy(open_clip.get_model_config(name) or {})
        if m.image_size:
            config["vision_cfg"]["image_size"] = m.image_size
        if self._quick_gelu(cfg):
            config["quick_gelu"] = True  # as the model was built for OpenAI's weights
        bias = getattr(cast(OpenClipModel, model).clip, "logit_bias", None)  # as trained, whatever the architecture
        config.pop("init_logit_bias", None)
        if bias is not None:
            config["init_logit_bias"] = bias.item()
        if config.get("text_cfg", {}).get("hf_tokenizer_name"):
            tokenizer: Any = open_clip.get_tokenizer(name)  # an HFTokenizer: local-dir: reads it from the folder
            tokenizer.save_pretrained(str(out))
        state = {
            key[len("clip.") :]: (value.reshape(()) if key in ("clip.logit_scale", "clip.logit_bias") else value)
            for key, value in model.state_dict().items()
        }
        return OpenClipFolder(config, state)


METHOD = register(OpenClipMethod())
