"""`m2_encoder`: the M²-Encoder multiway model trained with GBA-ITC.

Model and preprocessing follow the official inference code; the loss is our exact definition of
GBA-ITC (`losses/grouped_itc.py`). `init_from` starts from an official `.ckpt`.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, cast

import torch
from pydantic import Field, field_validator, model_validator
from torch import nn
from torchvision import transforms as T

from mmpt import distributed as mdist
from mmpt.artifacts import WEIGHTS, ReleaseError, atomic_torch_save
from mmpt.config import Config, Section
from mmpt.data.tokenizer import TextTokenizer
from mmpt.eval.retrieval import official_caption_normalization
from mmpt.losses.grouped_itc import GroupedContrastiveLoss
from mmpt.methods import register
from mmpt.methods.base import EngineNeeds, MethodConfig, OfficialFolder, count
from mmpt.methods.image_text import TINY_IMAGE_TEXT_DATA, ImageTextMethod, PlacementAugment, eval_batch_size_field
from mmpt.methods.teacher import DistillOption
from mmpt.methods.towers import Tower, image_text_towers
from mmpt.models.locking import TowerGroups, TowerLocks, lock_towers
from mmpt.models.m2_encoder import PRESETS, M2Encoder, M2EncoderConfig
from mmpt.models.m2_official import SCALARS, OfficialTensors, load_official, load_release_weights
from mmpt.models.m2_remote.glm_tokenizer import GLMTokenizer
from mmpt.models.tensor_files import SafetensorsTensors, TensorReader
from mmpt.pretrained import MODELS, InitialWeights, initial_weights
from mmpt.registry import NotRegistered

OFFICIAL_MEAN, OFFICIAL_STD = M2Encoder.image_mean, M2Encoder.image_std  # the official inception_normalize


class GbaItcConfig(Section):
    name: Literal["gba_itc"] = "gba_itc"
    group_size: int | Literal["auto", "world"] = Field(
        default="world",
        description="ranks per gathering group: an int dividing the world size, auto (ranks per node), world",
    )
    accumulation_steps: int | None = Field(
        default=None, gt=0, description="K micro-batches pooled per step; must equal train.grad_accum (null: follow it)"
    )
    tile_size: int = Field(default=0, ge=0, description="column tile width of the logits; 0 = untiled")


class AugmentConfig(PlacementAugment):
    """Training augmentation; the official recipe is crop 0.8-1, horizontal flip, RandAugment(2, 7) (no placement)."""

    crop_scale: tuple[float, float] = (0.8, 1.0)
    hflip: bool = True
    randaugment: bool = True


class M2Config(MethodConfig, TowerLocks, DistillOption):
    name: Literal["m2_encoder"] = "m2_encoder"
    model: str = Field(default="m2-encoder-0.4b", description=f"architecture preset: {', '.join(PRESETS.names())}")
    arch: M2EncoderConfig = Field(
        default_factory=M2EncoderConfig, description="architecture; keys given here override the `model` preset"
    )
    tokenizer: str | None = Field(
        default=None,
        description="GLM sp.model (SentencePiece, official) or a WordPiece tokenizer.json. None: the one that "
        "comes with init_from (the sp.model of an official download, or a release's or run's own)",
    )
    init_from: str | None = Field(
        default=None,
        description="weights to start from: an official download folder or its .ckpt, an mmpt release or "
        "finished run directory, or hf-hub:<org>/<name> (a release); loaded strictly",
    )
    loss: GbaItcConfig = Field(default_factory=GbaItcConfig)
    augment: AugmentConfig = Field(default_factory=AugmentConfig)
    eval_batch_size: int = eval_batch_size_field()

    @model_validator(mode="after")
    def _a_tokenizer(self) -> M2Config:
        if self.tokenizer is None and self.init_from is None:
            raise ValueError(
                "set method.tokenizer (a GLM sp.model or a tokenizer.json), or method.init_from to "
                "weights that come with one"
            )
        return self

    @field_validator("model")
    @classmethod
    def _a_preset(cls, name: str) -> str:
        try:
            PRESETS.get(name)
        except NotRegistered as exc:
            raise ValueError(str(exc)) from None
        return name

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, values: Any) -> Any:
        if isinstance(values, dict):
            name = values.get("model", "m2-encoder-0.4b")
            # An unknown name is the `model` field's error (a registry's get() has no default).
            preset = PRESETS[name] if name in PRESETS else {}  # noqa: SIM401
            arch = values.get("arch") or {}
            if isinstance(arch, dict):
                values = {**values, "arch": {**preset, **arch}}
        return values


OFFICIAL_CHECKPOINT = "m2_encoder.ckpt"  # `launch/export.py --format official` writes these
OFFICIAL_ARCH = "m2_encoder_arch.json"


def official_state(state: dict[str, torch.Tensor], cfg: Config) -> dict[str, torch.Tensor]:
    """mmpt weights of an M²-Encoder -> the official state dict: the reverse of `mmpt.models.m2_official` (which
    reads the official files): the official key order (the model's parameter order, which
    `tests/data/m2_encoder_*_state_dict.tsv` records), `logit_scale` and `logit_vl_scale` 0-D again, fp32."""
    arch = cast(M2Config, cfg.method).arch
    if arch.vocab_size is None:
        arch = arch.model_copy(update={"vocab_size": state["backbone.text_embed.weight"].shape[0]})
    with torch.device("meta"):
        order = list(M2Encoder(arch).state_dict())
    missing, unexpected = sorted(set(order) - set(state)), sorted(set(state) - set(order))
    if missing or unexpected:
        raise ReleaseError(
            f"the weights do not fit the configured M2-Encoder: missing {missing[:8]}, unexpected {unexpected[:8]}"
        )
    official = {}
    for key in order:
        tensor = state[key].detach().cpu()
        tensor = tensor if tensor.dtype == torch.float32 else tensor.float()
        official[key] = (tensor.reshape(()) if key in SCALARS else tensor).contiguous()
    return official


class M2EncoderMethod(ImageTextMethod[M2Config]):
    name = "m2_encoder"
    config_class = M2Config
    tower_switches = "method.arch"
    tiny_overrides = (
        *TINY_IMAGE_TEXT_DATA,
        "method.tokenizer={digits}/tokenizer.json",
        "method.init_from=null",
        "method.arch.vocab_size=null",
        "method.arch.width=32",
        "method.arch.heads=2",
        "method.arch.lower_layers=1",
        "method.arch.shared_layers=1",
        "method.arch.output_dim=16",
        "method.arch.image_size=32",
        "method.arch.patch_size=8",
        "method.arch.text_positions=32",
        "method.arch.context_length=24",
        "method.arch.position_init_std=0.02",
        "method.loss.accumulation_steps=null",
        "method.loss.tile_size=6",
        "method.augment.randaugment=false",
    )
    caption_normalization = staticmethod(official_caption_normalization)

    def check_config(self, cfg: Config) -> None:
        k = self.settings(cfg).loss.accumulation_steps
        if k is not None and k != cfg.train.grad_accum:
            raise ValueError(f"method.loss.accumulation_steps={k} differs from train.grad_accum={cfg.train.grad_accum}")

    def tokenizer_file_name(self, cfg: Config) -> str:
        return "tokenizer.json" if self.tokenizer_source(cfg).endswith(".json") else "sp.model"

    def tokenizer_source(self, cfg: Config) -> str:
        """`method.tokenizer`, else the tokenizer that comes with `method.init_from` (found on disk, so only
        once training or evaluation starts; config validation reads no file)."""
        settings = self.settings(cfg)
        if settings.tokenizer is not None:
            return settings.tokenizer
        init = settings.init_from
        assert init is not None  # the schema asks for a tokenizer or for weights that bring one
        try:
            found = initial_weights(init).tokenizer
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"config key 'method.init_from': {exc}") from None
        if found is None:
            raise FileNotFoundError(
                f"config key 'method.tokenizer': not set, and {init} (method.init_from) comes with "
                "no sp.model or tokenizer.json"
            )
        return str(found)

    def load_tokenizer(self, path: Path, cfg: Config):
        length = self.settings(cfg).arch.context_length
        return TextTokenizer(path, length) if path.suffix == ".json" else GLMTokenizer(path, length)

    def image_transform(self, cfg: Config, train: bool):
        size, augment = self.settings(cfg).arch.image_size, self.settings(cfg).augment
        finish = [T.ToTensor(), T.Normalize(OFFICIAL_MEAN, OFFICIAL_STD)]
        if not train:  # official eval: squash to a square, no crop
            return T.Compose([T.Resize((size, size), interpolation=T.InterpolationMode.BICUBIC), *finish])
        steps: list[Any] = [
            T.RandomResizedCrop(size, scale=augment.crop_scale, interpolation=T.InterpolationMode.BICUBIC)
        ]
        if augment.hflip:
            steps.append(T.RandomHorizontalFlip())
        if augment.randaugment:
            steps.append(T.RandAugment(num_ops=2, magnitude=7))
        return augment.apply_to(T.Compose([*steps, *finish]))

    def build_model(self, cfg: Config, run_dir: Path) -> M2Encoder:
        arch = self.settings(cfg).arch
        if arch.vocab_size is None:
            arch = arch.model_copy(update={"vocab_size": self.tokenizer(cfg, run_dir).vocab_size})
        model = M2Encoder(arch)
        lock_towers(self.tower_groups(model), self.settings(cfg), model)
        return model

    def resolve_defaults(self, cfg: Config) -> None:
        init = self.settings(cfg).init_from
        if (
            self.settings(cfg).tokenizer is None
            and init is not None
            and (init.startswith("hf-hub:") or Path(init).exists())
        ):  # else preflight says
            self.settings(cfg).tokenizer = self.tokenizer_source(cfg)

    def input_paths(self, cfg: Config) -> dict[str, str | None]:
        init = self.settings(cfg).init_from
        weights = {"method.init_from": None if init is None or init.startswith("hf-hub:") else init}
        if init is not None and weights["method.init_from"] and not Path(init).exists():
            return weights  # said before the tokenizer it would bring
        return {**weights, **super().input_paths(cfg)}

    def load_initial_weights(self, model: M2Encoder, cfg: Config) -> str | None:
        init = self.settings(cfg).init_from
        if not init:
            return None
        source = initial_weights(init)
        if source.kind == "official-m2":
            load_official(model, source.path)
        else:
            load_release_weights(model, source.path)
        return _loaded_line(len(model.state_dict()), source)

    def initial_tensors(self, cfg: Config) -> Callable[[nn.Module], tuple[str, TensorReader]] | None:
        init = self.settings(cfg).init_from
        if not init:
            return None

        def open_for(model: nn.Module) -> tuple[str, TensorReader]:
            source = initial_weights(init)
            if source.kind == "official-m2":
                reader: TensorReader = OfficialTensors(source.path, cast(M2Encoder, model).cfg.num_patches)
            else:
                reader = SafetensorsTensors(source.path / WEIGHTS)
            return _loaded_line(len(reader.shapes()), source), reader

        return open_for

    def build_loss(self, cfg: Config) -> nn.Module:
        spec = self.settings(cfg).loss
        if spec.group_size == "world":
            size = None
        elif spec.group_size == "auto":
            size = mdist.local_world_size()
        else:
            size = spec.group_size
        return GroupedContrastiveLoss(mdist.contiguous_group(size), tile_size=spec.tile_size)

    def tower_groups(self, model: M2Encoder) -> dict[str, TowerGroups]:
        return {"image": m2_tower_groups(model, "A"), "text": m2_tower_groups(model, "B")}

    def engine_needs(self, model: M2Encoder, cfg: Config) -> EngineNeeds:
        # GBA-ITC: the step's K micro-batches form one negative pool. The towers: the modality-expert stack
        # and the shared top (both images and texts run through each, selecting their expert by name).
        return EngineNeeds(
            pool_features=self.pool_features,
            step_pool=self.step_pool,
            merged_step=self.merged_step,
            compilable=(model.backbone.encoder, model.backbone_vl),
            tower_groups=self.tower_groups(model),
        )

    # --- export ---

    export_formats = ("official", "transformers")
    transformers_code = True  # mmpt.models.m2_remote, copied into the folder
    official_layout = (
        "the checkpoint the official M²-Encoder inference code reads (`m2_encoder.ckpt`, Lightning layout) "
        "and its tokenizer"
    )

    def transformers_export(self, model: nn.Module, cfg: Config, run_dir: Path, out: Path) -> None:
        """A folder carrying the network's own code (`mmpt.models.m2_remote`, copied as it is), which
        `AutoModel` / `AutoTokenizer.from_pretrained(out, trust_remote_code=True)` load: the GLM tokenizer (or the
        run's WordPiece one as a plain fast tokenizer) and a `ViTImageProcessor` doing the official evaluation
        preprocessing (squash to a square, bicubic, mean = std = 0.5)."""
        from transformers import ViTImageProcessor

        from mmpt.models.m2_remote.configuration_m2_encoder import M2EncoderConfig as FolderConfig
        from mmpt.models.m2_remote.modeling_m2_encoder import M2EncoderModel
        from mmpt.models.m2_remote.tokenization_m2_encoder import GLMChineseTokenizer

        m2 = cast(M2Encoder, model)
        arch = {**cast(M2EncoderConfig, m2.cfg).model_dump(), "grad_checkpointing": False, "patch_dropout": 0.0}
        FolderConfig.register_for_auto_class()
        M2EncoderModel.register_for_auto_class("AutoModel")
        with torch.device("meta"):
            folder = M2EncoderModel(FolderConfig(**arch))
        folder.m2.load_state_dict(m2.state_dict(), assign=True)
        folder.save_pretrained(out)
        tokenizer = self.tokenizer(cfg, run_dir)
        if isinstance(tokenizer, GLMTokenizer):
            GLMChineseTokenizer.register_for_auto_class("AutoTokenizer")
            GLMChineseTokenizer(tokenizer.model_file, tokenizer.context_length).save_pretrained(str(out))
        else:
            tokenizer.save_pretrained(out)
        size = m2.cfg.image_size
        ViTImageProcessor(
            size={"height": size, "width": size},
            resample=3,
            image_mean=list(OFFICIAL_MEAN),
            image_std=list(OFFICIAL_STD),
        ).save_pretrained(out)

    def export_towers(self, model: nn.Module, cfg: Config) -> list[Tower]:
        arch = cast(M2Encoder, model).cfg
        return image_text_towers(model, arch.image_size, int(arch.vocab_size or 0), arch.context_length, True)

    def architecture(self, cfg: Config, run_dir: Path) -> str:
        m2 = self.settings(cfg)
        a = m2.arch
        return (
            f"M²-Encoder multiway transformer (preset `{m2.model}`): width {a.width}, {count(a.heads, 'head')}, "
            f"{count(a.lower_layers, 'modality-specific layer')} (vision A / text B copies) and "
            f"{count(a.shared_layers, 'shared layer')}, "
            f"{a.image_size}-px images in {a.patch_size}-px patches, {a.context_length} text tokens, "
            f"{a.output_dim}-d features, L2-normalised"
        )

    def official_export(self, cfg: Config, state: dict[str, torch.Tensor], run_dir: Path, out: Path) -> OfficialFolder:
        """The official checkpoint layout, so a model continue-pretrained with mmpt goes back to the official
        inference code: `official_state` in a PyTorch Lightning-style checkpoint (`{"state_dict": ...}`), the
        first layout the official loader and `load_official` look for, saved with `torch.save` (nothing but
        tensors: `torch.load(weights_only=True)` reads it). Beside it the tokenizer (the GLM `sp.model` the
        official code reads, or the run's `tokenizer.json`), as an official download has it, and
        `m2_encoder_arch.json`, the architecture to configure the official code with. What loading drops or
        changes cannot come back: training-only visual-tokenizer weights are not in mmpt's model, and a vision
        position table that loading resized to another image size stays at the model's own grid (the official
        loader resizes it again for its configured size)."""
        official = official_state(state, cfg)
        atomic_torch_save({"state_dict": official}, out / OFFICIAL_CHECKPOINT)
        m2 = self.settings(cfg)
        tokenizer = self.tokenizer_file_name(cfg)
        source = run_dir / tokenizer
        if not source.is_file():
            raise ReleaseError(f"{source} is missing: the model's tokenizer goes beside the checkpoint")
        if source.resolve() != (out / tokenizer).resolve():
            shutil.copyfile(source, out / tokenizer)
        arch = m2.arch.model_dump()
        arch["vocab_size"] = official["backbone.text_embed.weight"].shape[0]
        (out / OFFICIAL_ARCH).write_text(json.dumps({"preset": m2.model, **arch}, indent=2) + "\n")
        glm = tokenizer == "sp.model"
        usage = [
            "### With the official M²-Encoder code",
            "",
            f"Point the official inference code's `load_path` at `{out}/{OFFICIAL_CHECKPOINT}` (a Lightning-style "
            f'`{{"state_dict": ...}}` checkpoint, {len(official)} tensors in the official order) and configure '
            f"it with the architecture in `{OFFICIAL_ARCH}`."
            + (
                " The GLM tokenizer `sp.model` is beside it."
                if glm
                else f" This model was trained with a WordPiece `{tokenizer}`, not the official GLM tokenizer: "
                "the official code's tokenizer does not fit it."
            ),
            "",
            "### With mmpt",
            "",
        ]
        preset = m2.model if m2.model in MODELS and M2EncoderConfig(**PRESETS.get(m2.model)) == m2.arch else None
        if preset is not None and glm:
            usage += [
                "```python",
                "import mmpt",
                f'model, _, preprocess = mmpt.create_model_and_transforms("{preset}", pretrained="{out}")',
                "```",
                "",
                f"or `method.init_from: {out}` to continue training from it.",
            ]
        else:
            usage += [
                f"`method.init_from: {out}` in an `m2_encoder` config with this architecture loads it (strictly)."
            ]
        return OfficialFolder(
            title="an mmpt-trained M²-Encoder in the official checkpoint layout",
            usage=tuple(usage),
            files=(
                (OFFICIAL_CHECKPOINT, "the weights in the official layout"),
                (tokenizer, "the tokenizer"),
                (OFFICIAL_ARCH, "the architecture (mmpt's `method.arch` keys)"),
            ),
        )


def m2_tower_groups(model: M2Encoder, expert: str) -> TowerGroups:
    """A tower's own parameters: its embeddings, its expert (`A` vision, `B` text) in each lower layer, its final
    norm and projections. The shared top layers serve both towers and belong to neither."""
    encoder = model.backbone.encoder

    def own(module: nn.Module) -> list[nn.Parameter]:
        return [p for name, p in module.named_parameters() if expert in name.split(".")]

    vision = expert == "A"
    embed = list((model.backbone.vision_embed if vision else model.backbone.text_embed).parameters())
    heads = (model.itc_image_proj, model.itc_vl_image_proj) if vision else (model.itc_text_proj, model.itc_vl_text_proj)
    last = own(encoder.layer_norm) + [p for head in heads for p in head.parameters()]
    return [embed + own(encoder.embed_positions), *(own(layer) for layer in encoder.layers), last]


METHOD = register(M2EncoderMethod())


def _loaded_line(count: int, source: InitialWeights) -> str:
    return f"initialised {count} of {count} tensors from {source.path} ({source.kind}, strict)"
