"""What every image-text contrastive method shares: tokenizer files, image-text batches, the
features-and-scale training step, and bilingual zero-shot classification."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, Protocol, TypeVar, cast

import torch
from pydantic import Field
from torch import nn
from torchvision import transforms as T

from mmpt.config import Config, ConfigError, EvalSetConfig, Section
from mmpt.data.fields import MissingFieldError, SampleFields
from mmpt.data.image_text import ImageTextDecoder, normalize_pixels, training_image_decode, uint8_transform
from mmpt.data.loader import BatchStream, Source, first_samples
from mmpt.data.shards import DataError, is_remote
from mmpt.errors import first_line
from mmpt.eval import resolve_dataset
from mmpt.eval.retrieval import zeroshot_retrieval
from mmpt.eval.retrieval_formats import check_chinese_clip, is_shard_pattern, read_listing, shard_caption_keys
from mmpt.eval.zeroshot import load_classification_set, zeroshot_classification
from mmpt.losses.grouped_itc import GroupedContrastiveLoss
from mmpt.losses.sigmoid import INIT_LOGIT_BIAS, INIT_LOGIT_SCALE, Exchange, SigmoidLoss
from mmpt.methods.base import EngineNeeds, Method, copy_tokenizer, eval_record, stream_spec
from mmpt.methods.teacher import Distilled, Teacher, prepare_teacher, teacher_of
from mmpt.models.locking import TowerGroups, TowerLocks


def eval_batch_size_field():
    """`method.eval_batch_size` of every image-text method: how many images or captions one forward of an
    evaluation reads (what is evaluated is `data.eval`)."""
    return Field(default=256, gt=0, description="images or captions per forward when evaluating the data.eval sets")


def pooled_accumulation_field():
    return Field(
        default=True,
        description="with train.grad_accum K > 1, the loss sees the K micro-batches of a step as one batch (K times "
        "the negatives; exact, at one extra forward without gradient per micro-batch); false: K small "
        "batches whose gradients are averaged",
    )


def loss_tile_field():
    return Field(
        default=None, gt=0, description="columns of logits computed at a time, recomputed in backward (null: all)"
    )


class ContrastiveLossConfig(Section):
    """CLIP's InfoNCE over every rank's pairs, both directions (`mmpt.losses.grouped_itc`, one group)."""

    name: Literal["contrastive"] = "contrastive"
    tile_size: int | None = loss_tile_field()
    pooled_accumulation: bool = pooled_accumulation_field()


class SigmoidLossConfig(Section):
    """SigLIP's pairwise sigmoid loss with a learnable bias (`mmpt.losses.sigmoid`); a model built for it starts
    at the paper's logit scale 10 and bias -10."""

    name: Literal["sigmoid"] = "sigmoid"
    exchange: Exchange = Field(
        default="bidirectional",
        description="how texts reach the other ranks: bidirectional or ring (neighbour to neighbour, one block "
        "of texts at a time), or gather (all at once)",
    )
    tile_size: int | None = loss_tile_field()
    pooled_accumulation: bool = pooled_accumulation_field()


ImageTextLossConfig = Annotated[ContrastiveLossConfig | SigmoidLossConfig, Field(discriminator="name")]


def image_text_loss_field():
    return Field(default_factory=ContrastiveLossConfig, description="the training loss: contrastive or sigmoid")


def build_image_text_loss(spec: ContrastiveLossConfig | SigmoidLossConfig) -> nn.Module:
    if isinstance(spec, SigmoidLossConfig):
        return SigmoidLoss(spec.exchange, spec.tile_size)
    return GroupedContrastiveLoss(None, tile_size=spec.tile_size or 0)


def initial_logits(spec: ContrastiveLossConfig | SigmoidLossConfig) -> dict[str, float]:
    """A new model's logit scale (and bias) for `spec`'s loss: CLIP's 1/0.07, or SigLIP's 10 and -10."""
    if isinstance(spec, SigmoidLossConfig):
        return {"init_logit_scale": INIT_LOGIT_SCALE, "init_logit_bias": INIT_LOGIT_BIAS}
    return {}


@torch.no_grad()
def in_batch_diagnostics(
    images: torch.Tensor, texts: torch.Tensor, logits: list[torch.Tensor]
) -> dict[str, torch.Tensor]:
    """`training_step`'s diagnostics (logged as train/<name>), what fine-tuners watch (a logit scale stuck at its
    start, retrieval inside the batch not improving): the share of this micro-batch's images whose best text is
    their own caption and the other way round, the logit scale multiplier, and the bias where the loss has one.
    Device tensors: read only when a window is logged."""
    scores = images.detach().float() @ texts.detach().float().T
    targets = torch.arange(scores.shape[0], device=scores.device)
    found = {
        "i2t_acc": (scores.argmax(1) == targets).float().mean(),
        "t2i_acc": (scores.argmax(0) == targets).float().mean(),
        "logit_scale": logits[0].detach().float().reshape(()),
    }
    if len(logits) > 1:
        found["logit_bias"] = logits[1].detach().float().reshape(())
    return found


class PlacementAugment(Section):
    """Random scale and translation at training time (torchvision's RandomAffine, black fill), so a model
    does not learn one size and position of its objects; off unless configured."""

    affine_scale: tuple[float, float] | None = Field(default=None, description="[min, max] zoom factor drawn per image")
    affine_translate: float = Field(
        default=0.0, ge=0.0, lt=1.0, description="largest shift, a fraction of width and height"
    )

    def apply_to(self, transform: T.Compose) -> T.Compose:
        """`transform` with the random placement inserted just before its ToTensor (unchanged when off)."""
        if self.affine_scale is None and self.affine_translate == 0:
            return transform
        steps = list(transform.transforms)
        at = next(i for i, step in enumerate(steps) if isinstance(step, T.ToTensor))
        shift = (self.affine_translate,) * 2 if self.affine_translate else None
        affine = T.RandomAffine(
            degrees=0, translate=shift, scale=self.affine_scale, interpolation=T.InterpolationMode.BILINEAR, fill=0
        )
        return T.Compose([*steps[:at], affine, *steps[at:]])


def model_images(model: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """An image batch as `model` reads it: normalised floats, as `preprocess` gives them.

    Training batches come from the loader as uint8 pixels and are normalised here, on the device, with
    the model's `image_mean` / `image_std`, in the dtype of its parameters (the dtype the engine casts
    floating inputs to). A floating batch is taken as normalised already.
    """
    if images.is_floating_point():
        return images
    mean, std = cast(Sequence[float], model.image_mean), cast(Sequence[float], model.image_std)
    return normalize_pixels(images, mean, std, next(model.parameters()).dtype)


# The image-text methods' test data: both languages of the digits corpus, and its zero-shot set while training.
TINY_IMAGE_TEXT_DATA = (
    'data.train.sources=[{{shards: "{digits}/train/en-*.tar"}}, {{shards: "{digits}/train/zh-*.tar"}}]',
    'data.eval=[{{dataset: "{digits}/zeroshot", task: zeroshot_classification, languages: [zh]}}]',
)


class ImageTextSettings(Protocol):
    """What every image-text method's section has (its other keys are its own)."""

    @property
    def eval_batch_size(self) -> int: ...

    @property
    def loss(self) -> Any: ...


SettingsT = TypeVar("SettingsT", bound=ImageTextSettings)


WORDLESS_IDS = 4  # start, end, padding and one unknown token: ids that tell no word apart


def check_captions_tokenize_apart(tokenize: Any, sources: Sequence[Source], tokenizer: str) -> None:
    """A tokenizer that knows none of the captions' words turns them all into the same few ids, and the run would
    train at chance with no error: refused, from the first captions of each local source's first shard (the same
    on every rank). Judged only where at least 4 of those captions differ."""
    for source in sources:
        if not source.urls or is_remote(source.urls[0]):
            continue
        texts: list[str] = []
        for sample in first_samples(source.urls[0]):
            try:
                texts.extend(source.fields.captions(sample))
            except (MissingFieldError, ValueError):  # counted and skipped by the loader
                continue
        if len({" ".join(text.lower().split()) for text in texts}) < 4:
            continue
        used = torch.unique(tokenize(texts)["input_ids"]).tolist()
        if len(used) <= WORDLESS_IDS:
            raise ConfigError(
                f"{tokenizer}: the first {len(texts)} captions of {source.urls[0]} tokenise to {len(used)} distinct "
                f"ids in all ({used}): the tokenizer knows none of their words"
            )


class ImageTextMethod(Method[SettingsT]):
    """Subclasses supply `tokenizer_file_name`, `load_tokenizer`, `image_transform`, `build_model`, `build_loss`.

    The model must have `encode_image`, `encode_text`, `image_mean` and `image_std` (what its inputs are
    normalised with) and return (image features, text features, logit scale multiplier) from
    `forward(images, input_ids, attention_mask)`. `image_transform` is the float, normalising transform
    released models offer (open_clip's convention); the training loader runs its `uint8_transform`.
    """

    tower_names = ("image", "text")
    intended_use = (
        "Embedding images and texts into one space: text-image retrieval, zero-shot classification with "
        "prompts, and features for downstream models, in the languages and the domain of its training captions "
    )

    def tokenizer_file_name(self, cfg: Config) -> str:
        raise NotImplementedError

    def load_tokenizer(self, path: Path, cfg: Config):
        raise NotImplementedError

    def image_transform(self, cfg: Config, train: bool):
        raise NotImplementedError

    def input_paths(self, cfg: Config) -> dict[str, str | None]:
        return {"method.tokenizer": self.tokenizer_source(cfg)}

    def check_initial_weights(self, cfg: Config) -> None:
        """The tokenizer file is read too: one that is not a tokenizer (a CSV, a vocabulary of another kind) is one
        line naming its key, not an error on every rank once training starts."""
        source = self.tokenizer_source(cfg)
        if source is not None and Path(source).is_file():
            try:
                self.load_tokenizer(Path(source), cfg)
            except Exception as exc:
                message = f"cannot read a tokenizer from {source}: {first_line(exc)}"
                raise ConfigError(f"config key 'method.tokenizer': {message}") from None

    def check_eval_set(self, cfg: Config, eval_set: EvalSetConfig) -> None:
        """A classification folder's class names in each language; a retrieval listing file read and its images
        found; Chinese-CLIP's images file and its first image decoded (that layout and the shards are read whole
        only when evaluated)."""
        listing = Path(eval_set.dataset)
        if eval_set.task == "zeroshot_classification" and listing.is_dir():
            for language in eval_set.languages:
                try:
                    load_classification_set(eval_set.dataset, language, eval_set.foreign_class_names)
                except (DataError, ValueError) as exc:  # ValueError: class names that are ids or foreign
                    raise ValueError(f"({language}) {exc}") from None
        elif eval_set.task == "zeroshot_retrieval" and listing.name.endswith("_texts.jsonl") and listing.is_file():
            check_chinese_clip(listing)
        elif eval_set.task == "zeroshot_retrieval" and listing.is_file() and not is_shard_pattern(eval_set.dataset):
            missing = [f for f in read_listing(listing)[0] if not f.is_file()]
            if missing:
                raise DataError(f"{listing}: image {missing[0]} does not exist ({len(missing)} missing)")

    def tokenizer_source(self, cfg: Config) -> str | None:
        """The tokenizer file a run starts from (`method.tokenizer`; None: the model brings its own); the run
        keeps its own copy."""
        return None

    def prepare(self, cfg: Config, run_dir: Path) -> None:
        self.prepare_files(cfg, run_dir)
        prepare_teacher(cfg, run_dir)

    def prepare_files(self, cfg: Config, run_dir: Path) -> None:
        """The model's own files a run keeps (its tokenizer); `prepare` adds a teacher's."""
        copy_tokenizer(run_dir, self.tokenizer_file_name(cfg), self.tokenizer_source(cfg))

    def teacher(self, cfg: Config) -> Teacher | None:
        return teacher_of(cfg, Path(cfg.run.output_dir))

    def release_files(self, cfg: Config) -> list[str]:
        return [self.tokenizer_file_name(cfg)]

    def preprocessors(self, cfg: Config, run_dir: Path) -> dict[str, Any]:
        return {
            "tokenizer": self.tokenizer(cfg, run_dir),
            "preprocess": self.image_transform(cfg, train=False),
            "preprocess_train": self.image_transform(cfg, train=True),
        }

    def tokenizer(self, cfg: Config, run_dir: Path):
        """The run's own copy of the tokenizer, so a run directory is self-contained."""
        return self.load_tokenizer(run_dir / self.tokenizer_file_name(cfg), cfg)

    def train_data(self, cfg: Config, run_dir: Path, *, rank: int, world_size: int) -> BatchStream:
        """Batches with uint8 images (JPEGs decoded at reduced size); `training_step` normalises them on the device."""
        transform = training_image_decode(uint8_transform(self.image_transform(cfg, train=True)))
        teacher = teacher_of(cfg, run_dir)
        tokenize, spec = self.tokenizer(cfg, run_dir), stream_spec(cfg, rank=rank, world_size=world_size)
        named = self.tokenizer_source(cfg)  # the file the config names (the run keeps a copy), else the model's own
        check_captions_tokenize_apart(tokenize, spec.sources, named or "the model's own tokenizer")
        decoder = ImageTextDecoder(
            transform,
            tokenize,
            attention_mask=self.uses_attention_mask,
            teacher_tokenize=None if teacher is None else teacher.tokenizer(),
        )
        return BatchStream(spec, decoder)

    def loss_spec(self, cfg: Config) -> ContrastiveLossConfig | SigmoidLossConfig:
        """The loss a run trains with (`method.loss`)."""
        return self.settings(cfg).loss

    def build_loss(self, cfg: Config) -> nn.Module:
        return build_image_text_loss(self.loss_spec(cfg))

    def summary_lines(self, cfg: Config) -> list[str]:
        settings = self.settings(cfg)
        lines = [f"loss: {self.loss_spec(cfg).name}"]
        distill = getattr(settings, "distill", None)
        if distill is not None:
            teacher = distill.teacher
            if isinstance(teacher, dict):
                teacher = " ".join(str(teacher[key]) for key in ("name", "model", "pretrained") if teacher.get(key))
            lines.append(
                f"distillation: teacher {teacher}, weight {distill.weight:g}, temperature {distill.temperature:g}"
            )
        locked = settings.locked() if isinstance(settings, TowerLocks) else {}
        return lines + [f"the {tower} tower locked by method.lock_{tower}: {kept}" for tower, kept in locked.items()]

    def tower_groups(self, model: nn.Module) -> dict[str, TowerGroups]:
        """{"image": groups, "text": groups}: each tower's parameters from input to output (`mmpt.models.locking`),
        what `method.lock_image` / `lock_text` lock and `optim.layer_decay` scales."""
        return {}

    def image_text_needs(self, model: nn.Module, cfg: Config) -> dict[str, Any]:
        """`EngineNeeds` keys every image-text method has: its towers, and pooled accumulation where the loss config
        asks for it."""
        needs: dict[str, Any] = {"tower_groups": self.tower_groups(model)}
        if self.loss_spec(cfg).pooled_accumulation:
            needs |= {"pool_features": self.pool_features, "step_pool": self.step_pool, "merged_step": self.merged_step}
        return needs

    def engine_needs(self, model: nn.Module, cfg: Config) -> EngineNeeds:
        return EngineNeeds(**self.image_text_needs(model, cfg))

    def pool_features(self, model: nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """Image then text features, in the order `training_step` (the model's forward) computes them."""
        encode_image, encode_text = cast(Any, model).encode_image, cast(Any, model).encode_text
        return encode_image(model_images(model, batch["image"])), encode_text(
            batch["input_ids"], batch.get("attention_mask")
        )

    def step_pool(self, loss: Any, features: list[tuple[torch.Tensor, torch.Tensor]]):
        return loss.pool([image for image, _ in features], [text for _, text in features])

    def merged_step(self, model: nn.Module, loss: nn.Module, micro_batches: list[dict[str, Any]]) -> dict[str, Any]:
        """A pooled step in one pass: the K micro-batches' forwards with gradient, the contrastive loss once over
        all of them, each micro-batch's distillation term weighted 1/K (as `training_step` weighs it pooled)."""
        outputs = [
            model(model_images(model, b["image"]), b["input_ids"], b.get("attention_mask")) for b in micro_batches
        ]
        own = loss.loss if isinstance(loss, Distilled) else loss
        logits = list(outputs[0][2:])  # the logit scale (and bias): the same parameters in every forward
        value = own(torch.cat([out[0] for out in outputs]), torch.cat([out[1] for out in outputs]), *logits)
        terms: dict[str, Any] = {"sigmoid" if isinstance(own, SigmoidLoss) else "contrastive": value}
        if isinstance(loss, Distilled):
            parts = [loss(out[0], out[1], out[2], b, len(outputs)) for out, b in zip(outputs, micro_batches)]
            terms["distill"] = torch.stack(parts).sum()
        each = [in_batch_diagnostics(out[0], out[1], list(out[2:])) for out in outputs]
        return {**terms, "train": {name: torch.stack([d[name] for d in each]).mean() for name in each[0]}}

    def training_step(
        self, model: nn.Module, loss: nn.Module, batch: dict[str, Any], pool: Any = None, index: int = 0
    ) -> dict[str, Any]:
        """The model gives (image features, text features, logit scale) and, built for the sigmoid loss, its bias.
        With a teacher (`Distilled`), its term joins the student's own loss."""
        images = model_images(model, batch["image"])
        image_features, text_features, *logits = model(images, batch["input_ids"], batch.get("attention_mask"))
        own = loss.loss if isinstance(loss, Distilled) else loss
        if pool is None:
            value = own(image_features, text_features, *logits)
        else:
            value = own(image_features, text_features, *logits, pool=pool, slot=index)
        terms = {"sigmoid" if isinstance(own, SigmoidLoss) else "contrastive": value}
        if isinstance(loss, Distilled):
            pooled = 1 if pool is None else pool.micro_batches
            terms["distill"] = loss(image_features, text_features, logits[0], batch, pooled)
        return {**terms, "train": in_batch_diagnostics(image_features, text_features, logits)}

    sample_fields = ("caption", "image")
    eval_tasks = ("zeroshot_classification", "zeroshot_retrieval")
    eval_sample_fields = ("caption", "image")

    def evaluate_set(
        self, model: nn.Module, cfg: Config, run_dir: Path, eval_set, language: str, final: bool
    ) -> dict[str, Any]:
        e = eval_set
        return self.zeroshot(model, cfg, run_dir, e.dataset, language, e.task, e.foreign_class_names, e.sample_fields())

    caption_normalization = None  # applied to retrieval captions, as the method's official evaluation does
    uses_attention_mask = True  # False: training batches carry no attention mask (the model does not read it)

    def zeroshot(
        self,
        model: nn.Module,
        cfg: Config,
        run_dir: Path,
        dataset: str,
        language: str,
        task: str = "zeroshot_classification",
        foreign_class_names: bool = False,
        fields: SampleFields | None = None,
        predictions: Path | None = None,
    ) -> dict[str, Any]:
        """One zero-shot run (classification, or retrieval over a jsonl) as a CLIP_benchmark-style record
        (not saved: the caller decides where). `foreign_class_names`: accept class names not written in
        `language`; `fields`: where a set read from shards keeps its images and captions; `predictions`: where
        retrieval writes each caption's best images (`mmpt.eval.retrieval.write_top_images`)."""
        device = next(model.parameters()).device
        batch_size = self.settings(cfg).eval_batch_size
        tokenizer, transform = self.tokenizer(cfg, run_dir), self.image_transform(cfg, train=False)
        if task == "zeroshot_retrieval":
            metrics = zeroshot_retrieval(
                model,
                tokenizer,
                transform,
                dataset,
                normalize_text=self.caption_normalization,
                fields=fields,
                batch_size=batch_size,
                device=device,
                predictions=predictions,
            )
            keys = shard_caption_keys(dataset, fields)
            return eval_record(run_dir, dataset, task, language, metrics, **({"caption_key": keys} if keys else {}))
        if task == "zeroshot_classification":
            data = load_classification_set(
                resolve_dataset(dataset, cfg.data.root), language, foreign_class_names, fields
            )
            metrics = zeroshot_classification(model, tokenizer, transform, data, batch_size=batch_size, device=device)
            return eval_record(run_dir, dataset, task, language, metrics, templates=data.templates_from)
        raise ValueError(f"unknown zero-shot task {task!r}")
