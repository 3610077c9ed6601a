"""Zero-shot video classification over a folder of class-named clips (the Kinetics layout).

`<folder>/<class name>/<clip>.{mp4,webm,avi}`; class names are the folder names (`_` read as a
space) unless the language's `classnames.txt` lists them (CLIP_benchmark's per-language folders
or suffixed files, as for images). Prompts: the folder's templates, else mmpt's video prompts
(`mmpt.eval.templates.VIDEO_TEMPLATES`), with a warning. Reports acc1, acc5, mean per-class recall.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch

from mmpt.data.shards import MissingDataError
from mmpt.eval.templates import VIDEO_TEMPLATES
from mmpt.eval.video_retrieval import VIDEO_SUFFIXES, video_encoder
from mmpt.eval.zeroshot import (
    ClassificationSet,
    build_classifier,
    class_folder_set,
    classify,
    language_lines,
    load_templates,
)


def load_video_classification_set(
    path: str | os.PathLike, language: str = "en", foreign_class_names: bool = False
) -> ClassificationSet:
    folder = Path(path)
    if not folder.is_dir():
        raise MissingDataError(f"video classification dataset {folder} is not a directory of class folders")
    _, names_file, looked = language_lines(folder, "classnames", language, foreign_class_names)
    templates, templates_from = load_templates(folder, language, VIDEO_TEMPLATES)
    return class_folder_set(
        folder,
        names_file,
        templates,
        templates_from,
        VIDEO_SUFFIXES,
        "no class folders (expected <class name>/<clip>.mp4)",
        language,
        foreign_class_names,
        looked,
    )


@torch.no_grad()
def video_classification(
    model,
    tokenize,
    decode_video: Callable[[bytes], torch.Tensor],
    dataset: ClassificationSet,
    batch_size: int = 32,
    device: str | torch.device = "cpu",
) -> dict[str, float]:
    """acc1, acc5 and mean per-class recall of a video-text `model` (`encode_video`, `encode_text`)."""
    model.eval()
    classifier = build_classifier(model, tokenize, dataset.classnames, dataset.templates, device)
    return classify(video_encoder(model, device), decode_video, classifier, dataset, batch_size, what="video")
