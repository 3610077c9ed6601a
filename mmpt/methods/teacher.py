"""Distillation from a frozen teacher (`method.distill` of the image-text methods).

The teacher is any image-text model mmpt can build: an mmpt release or finished run (its directory), or a
`method:` section of its own naming initial weights the way a run names them (open_clip's `pretrained`, the
transformers method's `model`, the M²-Encoder's `init_from`). It reads the student's pixels (the same crop,
resized to its input size and normalised its own way) and the same raw caption through its own tokenizer
(`teacher_input_ids` in the batch), without gradient, in the training precision.

The engine builds it as it builds the student (`Method.teacher`): under ZeRO-3 partitioned from the start, so
no rank holds it whole. It sits inside the loss module (`Distilled`), outside the model: exports and the run's
weights never contain it, and the optimizer never sees it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from pydantic import Field, ValidationError
from torch import nn

from mmpt.artifacts import RELEASE_CONFIG, RUN_CONFIG, WEIGHTS, ReleaseError, has_weights, release_record
from mmpt.config import Config, ConfigError, Section
from mmpt.data.image_text import normalize_pixels
from mmpt.errors import first_line
from mmpt.losses.distill import distillation_loss
from mmpt.models.tensor_files import SafetensorsTensors, TensorReader, check_covers, load_strictly, read_safetensors

KEY = "method.distill.teacher"
FOLDER = "teacher"  # in the run directory: a teacher named by a method section, its config and tokenizer files


class DistillConfig(Section):
    """`method.distill`: the teacher and how much its similarities weigh."""

    teacher: str | dict[str, Any] = Field(
        description="an mmpt release or finished run directory, or a method section of an image-text method naming "
        "its initial weights (e.g. {name: open_clip, model: ViT-B-32, pretrained: openai})"
    )
    weight: float = Field(default=1.0, gt=0, description="the distillation term's weight beside the training loss")
    temperature: float = Field(
        default=1.0, gt=0, description="both models' logits are divided by it before their softmax (1: open_clip's)"
    )


class DistillOption(Section):
    """The `method.distill` key of the image-text methods."""

    distill: DistillConfig | None = Field(default=None, description="distil from a frozen teacher (null: no teacher)")


@dataclass
class Teacher:
    """How to build a run's teacher: its method and config, the folder its files are read from, and, for a
    release or run, its weights file (None: the method's own initial weights)."""

    method: Any  # an image-text method (image and text towers)
    cfg: Config
    files: Path
    weights: Path | None
    settings: DistillConfig

    def build(self) -> nn.Module:
        return self.method.build_model(self.cfg, self.files)

    def load(self, model: nn.Module) -> str | None:
        if self.weights is None:
            return self.method.load_initial_weights(model, self.cfg)
        load_strictly(model, read_safetensors(self.weights.parent), str(self.weights.parent), "the teacher's config")
        return f"weights of {self.weights.parent}"

    def tensors(self) -> Callable[[nn.Module], tuple[str, TensorReader]] | None:
        """Where the teacher's weights are a release's, rank 0 reads them tensor by tensor under ZeRO-3."""
        if self.weights is None:
            return self.method.initial_tensors(self.cfg)
        path = self.weights
        return lambda model: (f"weights of {path.parent}", SafetensorsTensors(path))

    def tokenizer(self):
        return self.method.tokenizer(self.cfg, self.files)

    def image_size(self) -> tuple[int, int]:
        """The teacher's input size: what its evaluation transform makes of an image."""
        from PIL import Image

        pixels = self.method.image_transform(self.cfg, train=False)(Image.new("RGB", (97, 89)))
        return int(pixels.shape[-2]), int(pixels.shape[-1])

    def around(self, loss: nn.Module, model: nn.Module) -> Distilled:
        return Distilled(loss, model, self.settings, self.image_size())


def teacher_of(cfg: Config, run_dir: Path) -> Teacher | None:
    """The teacher `cfg` names (None: none); errors name the key."""
    settings = getattr(cfg.method, "distill", None)
    if settings is None:
        return None
    from mmpt.methods import get_method

    spec = settings.teacher
    try:
        if isinstance(spec, str):
            files = Path(spec).expanduser()
            if not files.is_dir():
                raise ReleaseError(f"{spec} is not a directory (an mmpt release or finished run)")
            try:
                teacher_cfg = directory_config(files)
            except ReleaseError as exc:
                hint = f"a transformers model folder is a teacher as {{name: transformers, model: {files}}}"
                raise ReleaseError(f"{exc}; {hint}") from None
            if not has_weights(files):
                raise ReleaseError(f"{files} has no {WEIGHTS}: not a finished run or release")
            weights: Path | None = files / WEIGHTS
        else:
            teacher_cfg, files, weights = None, run_dir / FOLDER, None
        method = get_method(teacher_cfg.method_name if teacher_cfg is not None else cast(dict, spec).get("name"))
        if set(method.tower_names) != {"image", "text"}:
            raise ConfigError(f"method '{method.name}' is not an image-text model")
        if teacher_cfg is None:
            teacher_cfg = cfg.model_copy(update={"method": method.config_class.model_validate(spec)})
        method.resolve_defaults(teacher_cfg)
    except ValidationError as exc:
        where = ".".join(str(part) for part in exc.errors()[0]["loc"])
        raise ConfigError(f"config key '{KEY}.{where}': {exc.errors()[0]['msg']}") from None
    except (ConfigError, ReleaseError, ValueError, FileNotFoundError) as exc:
        raise teacher_error(exc) from None
    return Teacher(method, teacher_cfg, files, weights, settings)


def directory_config(directory: Path) -> Config:
    """The config a release (`config.json`) or run (`config.yaml`) directory was trained with, validated by its
    method's schema."""
    from mmpt.config import read_config, validate_sections
    from mmpt.methods import get_method

    if (directory / RELEASE_CONFIG).is_file():
        data, origins, top = release_record(directory)["config"], {}, directory
    elif (directory / RUN_CONFIG).is_file():
        data, origins, top = read_config(directory / RUN_CONFIG)
    else:
        raise ReleaseError(f"{directory} has neither {RELEASE_CONFIG} (a release) nor {RUN_CONFIG} (a training run)")
    method = get_method((data.get("method") or {}).get("name"))
    cfg = validate_sections(data, origins, str(top), method.config_class)
    method.use_carried_files(cfg, directory)
    return cfg


def teacher_error(exc: Exception) -> ConfigError:
    """`exc` as one line naming the teacher's key (its own method key where the message names one)."""
    message = first_line(exc)
    inner = re.match(r"config key 'method\.([^']+)'(.*)", message)
    if inner:
        return ConfigError(f"config key '{KEY}.{inner[1]}'{inner[2]}")
    return ConfigError(f"config key '{KEY}': {message}")


def prepare_teacher(cfg: Config, run_dir: Path) -> None:
    """A teacher named by a method section keeps its files (tokenizer, model config) in the run directory."""
    teacher = teacher_of(cfg, run_dir)
    if teacher is not None and teacher.weights is None:
        teacher.method.prepare(teacher.cfg, teacher.files)


def check_teacher(cfg: Config) -> None:
    """Before any process starts: the teacher resolves, its files exist and its weights fit its architecture
    (built on the meta device, without memory)."""
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        teacher = teacher_of(cfg, Path(scratch))
        if teacher is None:
            return
        try:
            if teacher.weights is None:  # a release or run keeps its own files: the paths its config names may be gone
                for key, path in teacher.method.input_paths(teacher.cfg).items():
                    if path is not None and not Path(path).exists():
                        raise ConfigError(f"{key}: {path} does not exist")
                teacher.method.check_initial_weights(teacher.cfg)
            else:
                with torch.device("meta"):
                    model = teacher.build()
                expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
                found = SafetensorsTensors(teacher.weights).shapes()
                check_covers(str(teacher.weights), found, expected, f"its '{teacher.method.name}' config")
        except Exception as exc:  # a tokenizer or model file the teacher's own code could not read
            raise teacher_error(exc) from None


class Distilled(nn.Module):
    """The student's own loss, beside a frozen teacher whose similarities the student is also pulled towards
    (`mmpt.losses.distill`). `pool` is the student loss's: pooled accumulation pools the student's features;
    the distillation term is each micro-batch's own, weighted 1/K so that the K passes sum to their mean."""

    def __init__(self, loss: nn.Module, teacher: nn.Module, settings: DistillConfig, image_size: tuple[int, int]):
        super().__init__()
        self.loss, self.teacher = loss, teacher.requires_grad_(False).eval()
        self.weight, self.temperature, self.image_size = settings.weight, settings.temperature, image_size

    def train(self, mode: bool = True) -> Distilled:
        super().train(mode)
        self.teacher.eval()  # no dropout, batch norm statistics kept
        return self

    def pool(self, *args: Any) -> Any:
        return cast(Any, self.loss).pool(*args)

    @torch.no_grad()
    def teacher_features(self, batch: dict[str, Any]) -> list[torch.Tensor]:
        """The teacher's (image features, text features, logit scale, ...) of a training batch (uint8 pixels)."""
        pixels = batch["image"]
        if pixels.is_floating_point():
            raise ValueError("distillation reads the loader's uint8 pixels; this batch is already normalised")
        if tuple(pixels.shape[-2:]) != self.image_size:
            resized = F.interpolate(pixels.float(), size=self.image_size, mode="bicubic", antialias=True)
            pixels = resized.clamp_(0, 255).round_().to(torch.uint8)
        teacher: Any = self.teacher
        images = normalize_pixels(pixels, teacher.image_mean, teacher.image_std, next(teacher.parameters()).dtype)
        return list(self.teacher(images, batch["teacher_input_ids"], batch.get("teacher_attention_mask")))

    def forward(
        self,
        image_features: torch.Tensor,
        text_features: torch.Tensor,
        logit_scale: torch.Tensor,
        batch: dict[str, Any],
        micro_batches: int = 1,
    ) -> torch.Tensor:
        """The weighted distillation term of one micro-batch (of `micro_batches` pooled in a step)."""
        teacher_images, teacher_texts, teacher_scale, *_ = self.teacher_features(batch)
        term = distillation_loss(
            image_features, text_features, logit_scale, teacher_images, teacher_texts, teacher_scale, self.temperature
        )
        return term * (self.weight / micro_batches)
