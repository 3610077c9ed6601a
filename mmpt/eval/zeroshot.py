"""Zero-shot image classification, CLIP_benchmark style.

Datasets: the CLIP_benchmark webdataset layout (a folder with `classnames.txt`,
`zeroshot_classification_templates.txt` and `test/*.tar` of images + `cls`), or an ImageFolder
(one sub-folder per class). A language's class names and templates are read from CLIP_benchmark's
per-language folders (`zh/classnames.txt`), suffixed files (`classnames_zh.txt`), or the plain file
(`classnames.txt`) of a dataset root made for that language, as CLIP_benchmark's `--language` reads it;
a dataset without templates is evaluated with mmpt's defaults for the language, with a warning and a
note in the result.

Class names are checked by what they are, not only by where they are: names in a script other than the
language's (English names in Chinese prompts) and folder names that are ids (ImageNet's `n01440764`,
numbers) are refused unless allowed, since they give a number that measures nothing.
"""

from __future__ import annotations

import functools
import glob
import logging
import os
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from mmpt.config import ConfigError
from mmpt.data.fields import SampleFields
from mmpt.data.image_text import decode_image, decode_text, pick_field
from mmpt.data.shards import DataError, MissingDataError
from mmpt.data.stream import read_shard
from mmpt.eval.templates import DEFAULT_TEMPLATES

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".bmp"}
ID_LIKE = re.compile(r"^(n\d{8}|\d+)$")  # ImageNet synsets, class numbers
# Languages whose script tells their text apart from English; others (Latin script) are not checked.
SCRIPTS = {
    "zh": re.compile(r"[\u3400-\u9fff]"),
    "ja": re.compile(r"[\u3040-\u30ff\u3400-\u9fff]"),
    "ko": re.compile(r"[\uac00-\ud7af]"),
}
FOREIGN_HINT = "or allow names in another language (foreign_class_names of the data.eval set, --foreign-class-names)"


class ClassNamesError(ConfigError):
    """Class names that would make a zero-shot number meaningless: ids, or names in another language."""


def written_in(texts: list[str], language: str) -> bool:
    """Whether most of `texts` are written in `language`'s script (always, for languages not told apart)."""
    script = SCRIPTS.get(language)
    return script is None or 2 * sum(bool(script.search(text)) for text in texts) > len(texts)


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
    for English the plain file (`classnames.txt`), then the suffixed file (`classnames_zh.txt`), then for
    other languages the plain file (a dataset root made for that language; see `language_lines`)."""
    plain = [folder / f"{stem}.txt"]
    return [
        folder / language / f"{stem}.txt",
        *(plain if language == "en" else []),
        folder / f"{stem}_{language}.txt",
        *(plain if language != "en" else []),
    ]


def language_lines(
    folder: Path, stem: str, language: str, foreign_ok: bool = False
) -> tuple[list[str] | None, Path | None, list[Path]]:
    """(lines, file, files looked at) of the first of `language_files` written in `language` (any, with
    `foreign_ok`); lines and file are None when there is none. A file in another language's script is passed
    over: the plain file of a multilingual root is English."""
    looked = language_files(folder, stem, language)
    for path in looked:
        if path.exists():
            lines = _lines(path)
            if foreign_ok or written_in(lines, language):
                return lines, path, looked
            log.info("%s is not written in '%s'; looking further", path, language)
    return None, None, looked


def foreign_files(looked: Sequence[Path]) -> str:
    found = [str(path) for path in looked if path.exists()]
    return f"; {', '.join(found)} {'is' if len(found) == 1 else 'are'} not written in it" if found else ""


@functools.cache
def warn_once(message: str) -> None:
    """Log `message` the first time this process says it: a set is checked before training and evaluated every
    `train.eval_every` steps, and its missing templates are news once."""
    log.warning(message)


def load_templates(
    folder: Path, language: str, defaults: dict[str, list[str]] = DEFAULT_TEMPLATES
) -> tuple[list[str], str]:
    """(prompt templates, where they came from); mmpt's defaults for the language, with a warning, when
    the dataset has none."""
    _, found, looked = language_lines(folder, "zeroshot_classification_templates", language)
    if found is None:
        templates = defaults.get(language)
        if not templates:  # a file to add, or a language to ask for: a path to correct (exit 2)
            raise MissingDataError(
                f"{folder}: no '{language}' prompt templates (looked for {', '.join(map(str, looked))}) "
                f"and mmpt has no default '{language}' templates"
            )
        source = f"mmpt default '{language}' templates ({len(templates)} prompts; the dataset has none)"
        looked_for = ", ".join(str(p.relative_to(folder)) for p in looked)
        warn_once(f"{folder}: no '{language}' prompt templates (looked for {looked_for}); using {source}")
        return templates, source
    templates = _lines(found)
    if any("{c}" not in t for t in templates):
        raise ConfigError(f"{found}: every template needs a '{{c}}' placeholder")  # a file to correct, as class names
    return templates, str(found)


def load_classification_set(
    path: str | os.PathLike, language: str = "en", foreign_class_names: bool = False, fields: SampleFields | None = None
) -> ClassificationSet:
    """A CLIP_benchmark folder, Chinese-CLIP's zero-shot layout or an ImageFolder with `language`'s class names and
    templates.

    `foreign_class_names`: accept class names not written in `language` (e.g. English names in Chinese prompts).
    `fields`: where the shards' samples keep their image (default: the usual image members).
    """
    fields = fields or SampleFields()
    folder = Path(path)
    if not folder.is_dir():
        raise MissingDataError(
            f"zero-shot dataset {str(path)!r} is not a directory (expected a CLIP_benchmark folder or an ImageFolder)"
        )
    names, names_file, looked = language_lines(folder, "classnames", language, foreign_class_names)
    templates, templates_from = load_templates(folder, language)

    if (folder / "test").is_dir() and any((folder / name).is_file() for name in ELEVATER_LABELS.values()):
        return elevater_set(folder, language, templates, templates_from)
    shards = sorted(glob.glob(str(folder / "test" / "*.tar")))
    if shards:
        if names is None:
            raise ClassNamesError(
                f"{folder}: no '{language}' class names (looked for {', '.join(map(str, looked))}"
                f"{foreign_files(looked)}); the webdataset layout needs them, {FOREIGN_HINT}"
            )

        def wds_samples() -> Iterator[tuple[bytes, int, str]]:
            for shard in shards:
                for _, sample in read_shard(shard):
                    sample["__shard__"] = shard
                    label = int(decode_text(pick_field(sample, ("cls",), "class label")))
                    yield fields.image_bytes(sample), label, f"{shard}:{sample['__key__']}"

        return ClassificationSet(folder.name, names, templates, wds_samples, templates_from)

    return class_folder_set(
        folder,
        names_file,
        templates,
        templates_from,
        IMAGE_SUFFIXES,
        "neither test/*.tar shards nor class sub-folders found",
        language,
        foreign_class_names,
        looked,
    )


ELEVATER_LABELS = {"zh": "label_cn.txt", "en": "label.txt"}  # Chinese-CLIP's zero-shot sets (ELEVATER-CN)


def elevater_set(folder: Path, language: str, templates: list[str], templates_from: str) -> ClassificationSet:
    """Chinese-CLIP's zero-shot layout: class names in label_cn.txt (Chinese) or label.txt (English), one per
    line, and `test/NNN/` holding the images of class NNN (the line's index)."""
    names_file = folder / ELEVATER_LABELS.get(language, "label.txt")
    if not names_file.is_file():
        raise ClassNamesError(f"{folder}: no '{language}' class names ({names_file.name} is missing)")
    classnames = _lines(names_file)
    class_dirs = sorted(d for d in (folder / "test").iterdir() if d.is_dir())
    bad = [d.name for d in class_dirs if not d.name.isdigit() or int(d.name) >= len(classnames)]
    if bad:
        raise DataError(f"{folder / 'test'}: folder {bad[0]!r} is not the index of a line of {names_file.name}")

    def samples() -> Iterator[tuple[bytes, int, str]]:
        for class_dir in class_dirs:
            for file in sorted(class_dir.iterdir()):
                if file.suffix.lower() in IMAGE_SUFFIXES:
                    yield file.read_bytes(), int(class_dir.name), str(file)

    return ClassificationSet(folder.name, classnames, templates, samples, templates_from)


def class_folder_set(
    folder: Path,
    names_file: Path | None,
    templates: list[str],
    templates_from: str,
    suffixes: set[str] | tuple[str, ...],
    none_found: str,
    language: str = "en",
    foreign_class_names: bool = False,
    looked: Sequence[Path] = (),
) -> ClassificationSet:
    """One sub-folder per class (files with `suffixes`), named by `names_file` or by the folders' names;
    folder names that are ids, or not written in `language`, are refused (`ClassNamesError`)."""
    # sub-folders are classes, except per-language folders of class names and templates
    class_dirs = sorted(d for d in folder.iterdir() if d.is_dir() and not (d / "classnames.txt").exists())
    if not class_dirs:
        raise DataError(f"{folder}: {none_found}")
    if names_file is not None:
        classnames = _lines(names_file)
    else:
        classnames = [d.name.replace("_", " ") for d in class_dirs]
        ids = [d.name for d in class_dirs if ID_LIKE.match(d.name)]
        missing = (
            f"{folder}: no '{language}' class names (looked for {', '.join(map(str, looked))}{foreign_files(looked)})"
        )
        if ids and any(path.exists() for path in looked):
            raise ClassNamesError(
                f"{missing}, and the class folders are ids: give {language}/classnames.txt, {FOREIGN_HINT}"
            )
        if ids:
            raise ClassNamesError(
                f"{folder}: class folders are named by ids ({', '.join(ids[:3])}"
                f"{', ...' if len(ids) > 3 else ''}), which say nothing to a text encoder: give "
                "classnames.txt (one name per line, in the folders' sorted order)"
            )
        if not (foreign_class_names or written_in(classnames, language)):
            raise ClassNamesError(
                f"{missing}, and the class folders' names ({', '.join(classnames[:3])}, ...) are not "
                f"written in '{language}': give {language}/classnames.txt, {FOREIGN_HINT}"
            )
    if len(classnames) != len(class_dirs):
        raise ClassNamesError(
            f"{names_file} lists {len(classnames)} classes but {folder} has {len(class_dirs)} class folders"
        )

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
def classify(
    encode: Callable[[torch.Tensor], torch.Tensor],
    prepare: Callable[[bytes], torch.Tensor],
    classifier: torch.Tensor,
    dataset: ClassificationSet,
    batch_size: int,
    what: str = "image",
) -> dict[str, float]:
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
            raise DataError(
                f"zero-shot {what} {sample_id} has label {label}, but there are {len(dataset.classnames)} class names"
            )
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
    return classify(
        lambda images: model.encode_image(images.to(device=device, dtype=dtype)),
        lambda data: transform(decode_image(data)),
        classifier,
        dataset,
        batch_size,
    )
