"""Zero-shot image classification, CLIP_benchmark style.

Datasets: the CLIP_benchmark webdataset layout (a folder with `classnames.txt`,
`zeroshot_classification_templates.txt` and `test/*.tar` of images + `cls`), or an ImageFolder
(one sub-folder per class). A language's class names and templates are read from CLIP_benchmark's
per-language folders (`zh/classnames.txt`) or suffixed files (`classnames_zh.txt`); a dataset without
templates is evaluated with mmpt's defaults for the language, with a warning and a note in the result.
"""

from __future__ import annotations

import glob
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from mmpt.data.image_text import IMAGE_FIELDS, decode_image, decode_text, pick_field
from mmpt.data.shards import DataError
from mmpt.data.stream import read_shard
from mmpt.eval.templates import DEFAULT_TEMPLATES

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".bmp"}


@dataclass
class ClassificationSet:
    name: str
    classnames: list[str]
    templates: list[str]
    samples: Callable[[], Iterator[tuple[bytes, int, str]]]  # (image bytes, label, sample id)
    templates_from: str = ""  # the file the prompts came from, or which defaults stood in for it


def _lines(path: Path) -> list[str]:
    return [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def language_files(folder: Path, stem: str, language: str) -> list[Path]:
    """Where a language's file may be, in order: CLIP_benchmark's per-language folder (`zh/classnames.txt`),
    for English the plain file (`classnames.txt`), then the suffixed file (`classnames_zh.txt`)."""
    return [folder / language / f"{stem}.txt", *([folder / f"{stem}.txt"] if language == "en" else []),
            folder / f"{stem}_{language}.txt"]


def first_existing(paths: list[Path]) -> Path | None:
    return next((path for path in paths if path.exists()), None)


def load_templates(folder: Path, language: str, defaults: dict[str, list[str]] = DEFAULT_TEMPLATES,
                   ) -> tuple[list[str], str]:
    """(prompt templates, where they came from); mmpt's defaults for the language, with a warning, when
    the dataset has none."""
    looked = language_files(folder, "zeroshot_classification_templates", language)
    found = first_existing(looked)
    if found is None:
        templates = defaults.get(language)
        if not templates:
            raise DataError(f"{folder}: no '{language}' prompt templates (looked for {', '.join(map(str, looked))}) "
                            f"and mmpt has no default '{language}' templates")
        source = f"mmpt default '{language}' templates ({len(templates)} prompts; the dataset has none)"
        log.warning("%s: no '%s' prompt templates (looked for %s); using %s", folder, language,
                    ", ".join(str(p.relative_to(folder)) for p in looked), source)
        return templates, source
    templates = _lines(found)
    if any("{c}" not in t for t in templates):
        raise DataError(f"{found}: every template needs a '{{c}}' placeholder")
    return templates, str(found)


def load_classification_set(path: str | os.PathLike, language: str = "en") -> ClassificationSet:
    folder = Path(path)
    if not folder.is_dir():
        raise DataError(f"zero-shot dataset {str(path)!r} is not a directory (expected a CLIP_benchmark folder or an ImageFolder)")
    names_candidates = language_files(folder, "classnames", language)
    names_file = first_existing(names_candidates)
    templates, templates_from = load_templates(folder, language)

    shards = sorted(glob.glob(str(folder / "test" / "*.tar")))
    if shards:
        if names_file is None:
            raise DataError(f"{folder}: no '{language}' class names (looked for "
                            f"{', '.join(map(str, names_candidates))}); the webdataset layout needs them")

        def wds_samples() -> Iterator[tuple[bytes, int, str]]:
            for shard in shards:
                for _, sample in read_shard(shard):
                    sample["__shard__"] = shard
                    label = int(decode_text(pick_field(sample, ("cls",), "class label")))
                    yield pick_field(sample, IMAGE_FIELDS, "image"), label, f"{shard}:{sample['__key__']}"

        return ClassificationSet(folder.name, _lines(names_file), templates, wds_samples, templates_from)

    return class_folder_set(folder, names_file, templates, templates_from, IMAGE_SUFFIXES,
                            "neither test/*.tar shards nor class sub-folders found")


def class_folder_set(folder: Path, names_file: Path | None, templates: list[str], templates_from: str,
                     suffixes: set[str] | tuple[str, ...], none_found: str) -> ClassificationSet:
    """One sub-folder per class (files with `suffixes`), named by `names_file` or by the folders' names."""
    # sub-folders are classes, except per-language folders of class names and templates
    class_dirs = sorted(d for d in folder.iterdir() if d.is_dir() and not (d / "classnames.txt").exists())
    if not class_dirs:
        raise DataError(f"{folder}: {none_found}")
    classnames = _lines(names_file) if names_file is not None else [d.name.replace("_", " ") for d in class_dirs]
    if len(classnames) != len(class_dirs):
        raise DataError(f"{names_file} lists {len(classnames)} classes but {folder} has {len(class_dirs)} class folders")

    def folder_samples() -> Iterator[tuple[bytes, int, str]]:
        for label, class_dir in enumerate(class_dirs):
            for file in sorted(class_dir.iterdir()):
                if file.suffix.lower() in suffixes:
                    yield file.read_bytes(), label, str(file)

    return ClassificationSet(folder.name, classnames, templates, folder_samples, templates_from)


@torch.no_grad()
def build_classifier(model, tokenize, classnames: list[str], templates: list[str], device) -> torch.Tensor:
    """[embed_dim, classes]: per class, the renormalised mean of its prompts' text embeddings."""
    weights = []
    for name in classnames:
        tokens = tokenize([t.replace("{c}", name) for t in templates])
        features = model.encode_text(tokens["input_ids"].to(device), tokens["attention_mask"].to(device))
        weights.append(F.normalize(F.normalize(features, dim=-1).mean(0), dim=0))
    return torch.stack(weights, dim=1)


@torch.no_grad()
def classify(encode: Callable[[torch.Tensor], torch.Tensor], prepare: Callable[[bytes], torch.Tensor],
             classifier: torch.Tensor, dataset: ClassificationSet, batch_size: int, what: str = "image") -> dict[str, float]:
    """acc1, acc5 and mean per-class recall: `prepare` turns each sample's bytes into a model input,
    `encode` a stacked batch of them into features (an undecodable sample is an error here: an
    evaluation set is fixed, skipping would change it)."""
    predictions, labels = [], []

    def flush(inputs: list[torch.Tensor]) -> None:
        logits = F.normalize(encode(torch.stack(inputs)), dim=-1).float() @ classifier.float()
        predictions.append(logits.topk(min(5, logits.shape[1]), dim=1).indices.cpu())

    inputs: list[torch.Tensor] = []
    for data, label, sample_id in dataset.samples():
        try:
            inputs.append(prepare(data))
        except Exception as exc:
            raise DataError(f"zero-shot {what} {sample_id} cannot be decoded: {exc}") from None
        if not 0 <= label < len(dataset.classnames):
            raise DataError(f"zero-shot {what} {sample_id} has label {label}, but there are {len(dataset.classnames)} class names")
        labels.append(label)
        if len(inputs) == batch_size:
            flush(inputs)
            inputs = []
    if inputs:
        flush(inputs)
    if not labels:
        raise DataError(f"zero-shot dataset {dataset.name!r} has no {what}s")
    return classification_metrics(torch.cat(predictions), torch.tensor(labels))


def classification_metrics(top: torch.Tensor, target: torch.Tensor) -> dict[str, float]:
    """From each sample's top-5 predicted classes [n, <=5] and its label [n]."""
    correct = top == target[:, None]
    recalls = [correct[target == c, 0].float().mean().item() for c in target.unique()]
    return {
        "acc1": correct[:, 0].float().mean().item(),
        "acc5": correct.any(dim=1).float().mean().item(),
        "mean_per_class_recall": sum(recalls) / len(recalls),
    }


@torch.no_grad()
def zeroshot_classification(
    model, tokenize, transform, dataset: ClassificationSet, batch_size: int = 256, device: str | torch.device = "cpu"
) -> dict[str, float]:
    """acc1, acc5 and mean per-class recall of an image-text `model` on `dataset`."""
    model.eval()
    classifier = build_classifier(model, tokenize, dataset.classnames, dataset.templates, device)
    dtype = next(model.parameters()).dtype
    return classify(lambda images: model.encode_image(images.to(device=device, dtype=dtype)),
                    lambda data: transform(decode_image(data)), classifier, dataset, batch_size)
