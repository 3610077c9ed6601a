"""The bilingual digits corpus: scikit-learn's 1,797 real 8x8 handwritten digit scans as image-text shards.

Training shards hold one caption per sample, English (`train/en-*.tar`) and Chinese (`train/zh-*.tar`)
as two sources to mix. A stratified held-out split is written in the CLIP_benchmark webdataset layout
(`zeroshot/test/{0..N-1}.tar` with `png` + `cls`, `nshards.txt`, `classnames.txt`,
`zeroshot_classification_templates.txt`,
and `_zh` variants of both) for zero-shot classification, and as image files with
`zeroshot/retrieval_{en,zh}.jsonl` (`{"image", "caption": [...]}` lines) for retrieval.
`zeroshot_unseen/` is the same held-out scans drawn smaller or larger and shifted (renderings the
training data never holds) with prompt wordings no caption or `zeroshot/` template uses: how well a model generalises.
A WordPiece tokenizer trained on the text (the evaluation prompts' words included, so they are not
unknown tokens; no caption ever uses them) is saved as `tokenizer.json`. Nothing is downloaded: the scans
ship inside scikit-learn.
"""

from __future__ import annotations

import io
import json
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from mmpt.data.shards import ShardSetWriter
from mmpt.data.tokenizer import train_wordpiece
from mmpt.demo import register
from mmpt.demo.corpus import fresh_staging, is_built, mark_complete, publish

NAMES = {
    "en": ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"],
    "zh": ["零", "一", "二", "三", "四", "五", "六", "七", "八", "九"],
}
# {w}: the digit as a word, {n}: as a numeral.
TRAIN_TEMPLATES = {
    "en": [
        "a handwritten digit {w}",
        "a handwritten {n}",
        "the number {w}, written by hand",
        "a scan of a handwritten {w}",
        "a small picture of the digit {n}",
        "handwriting of the number {w}",
        "a {w} written with a pen",
        "an image of the numeral {n}",
        "a blurry handwritten {w}",
    ],
    "zh": [
        "手写的数字{w}",
        "手写的{n}",
        "一个手写的数字{w}",
        "数字{n}的手写扫描图",
        "手写体的{w}",
        "一张数字{w}的小图片",
        "用笔写的{w}",
        "数字{n}的图片",
        "模糊的手写{w}",
    ],
}
# Held-out prompts for zero-shot classification ({c}: class name), CLIP_benchmark style.
EVAL_TEMPLATES = {
    "en": [
        "a photo of the digit {c}.",
        "a handwritten {c}.",
        "an image of the number {c}.",
        "the digit {c}, written by hand.",
    ],
    "zh": ["一张数字{c}的照片。", "手写的{c}。", "数字{c}的图片。", "手写的数字{c}。"],
}
# Wordings used nowhere else, for `zeroshot_unseen/`.
UNSEEN_TEMPLATES = {
    "en": ["a drawing of the number {c}.", "this is a {c}.", "the numeral {c} drawn by someone.", "a sketch of a {c}."],
    "zh": ["这是{c}。", "画出来的数字{c}。", "一个{c}的草图。", "有人写的{c}。"],
}
# `zeroshot_unseen/` rendering: the digit drawn at a size in SCALE times the frame, its centre moved by up to
# SHIFT pixels each way (at 32 px); training scans always fill the frame, centred.
UNSEEN_SCALE, UNSEEN_SHIFT = (0.65, 1.35), 4
LANGUAGES = ("en", "zh")
VERSION = 2  # 2: adds zeroshot_unseen/


def drawn_digit(scan: np.ndarray, size: int) -> Image.Image:
    """The 8x8 scan (values 0-16) as a `size` x `size` grey image."""
    pixels = (scan * (255.0 / 16.0)).clip(0, 255).astype(np.uint8)
    return Image.fromarray(pixels, mode="L").resize((size, size), Image.Resampling.BICUBIC)


def _encoded(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _png(scan: np.ndarray, size: int) -> bytes:
    return _encoded(drawn_digit(scan, size))


def _shifted_png(scan: np.ndarray, size: int, scale: float, dx: int, dy: int) -> bytes:
    """The scan drawn at `scale` times `size` on a black `size` canvas, its centre moved by (dx, dy); edges
    that leave the canvas are cut, as a larger digit in a fixed frame would be."""
    drawn = round(size * scale)
    canvas = Image.new("L", (size, size))
    corner = (size - drawn) // 2
    canvas.paste(drawn_digit(scan, drawn), (corner + dx, corner + dy))
    return _encoded(canvas)


def _split(labels: np.ndarray, test_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Stratified split: the same fraction of every class is held out."""
    rng = np.random.default_rng(seed)
    train, test = [], []
    for label in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == label)).tolist()
        cut = round(len(members) * test_fraction)
        test += members[:cut]
        train += members[cut:]
    return sorted(train), sorted(test)


def caption(language: str, label: int, template: str) -> str:
    return template.format(w=NAMES[language][label], n=str(label))


def write_classification_set(
    folder: Path, pngs: dict[int, bytes], labels: np.ndarray, templates: dict[str, list[str]], shard_size: int
) -> None:
    """`pngs` (scan index -> image) as a CLIP_benchmark webdataset set with per-language class names and prompts."""
    with ShardSetWriter(folder / "test" / "test", max_samples=shard_size) as writer:
        for index, png in pngs.items():
            writer.write({"__key__": f"{index:04d}", "png": png, "cls": str(int(labels[index]))})
    name_shards_as_clip_benchmark(folder / "test", writer.sizes)
    for language in LANGUAGES:
        suffix = "" if language == "en" else f"_{language}"
        (folder / f"classnames{suffix}.txt").write_text("\n".join(NAMES[language]) + "\n")
        (folder / f"zeroshot_classification_templates{suffix}.txt").write_text("\n".join(templates[language]) + "\n")


def name_shards_as_clip_benchmark(folder: Path, sizes: dict[str, int]) -> None:
    """CLIP_benchmark reads `<split>/0.tar ... <N-1>.tar` and `nshards.txt`: rename the written shards so."""
    renamed = {}
    for number, name in enumerate(sorted(sizes)):
        (folder / name).rename(folder / f"{number}.tar")
        renamed[f"{number}.tar"] = sizes[name]
    (folder / "sizes.json").write_text(json.dumps(renamed, indent=1, sort_keys=True))
    (folder / "nshards.txt").write_text(str(len(renamed)))


@register("digits")
def build_digits(
    root: str | os.PathLike,
    *,
    image_size: int = 32,
    test_fraction: float = 0.2,
    captions_per_image: int = 4,
    shard_size: int = 500,
    seed: int = 0,
) -> Path:
    """Build the corpus at `root` unless already complete; safe when several ranks race to build it."""
    from sklearn.datasets import load_digits

    root = Path(root)
    if is_built(root, VERSION):
        return root
    staging = fresh_staging(root)
    digits: Any = load_digits()  # a Bunch: images [n, 8, 8], target [n]
    images, labels = digits.images, digits.target
    train_ids, test_ids = _split(labels, test_fraction, seed)
    rng = random.Random(seed)
    texts: list[str] = []

    for language in LANGUAGES:
        with ShardSetWriter(staging / "train" / language, max_samples=shard_size) as writer:
            for index in train_ids:
                label = int(labels[index])
                png = _png(images[index], image_size)
                for copy, template in enumerate(rng.sample(TRAIN_TEMPLATES[language], captions_per_image)):
                    text = caption(language, label, template)
                    texts.append(text)
                    writer.write({"__key__": f"{index:04d}_{copy}", "png": png, "txt": text, "cls": str(label)})

    zeroshot = staging / "zeroshot"
    (zeroshot / "images").mkdir(parents=True)
    pngs = {index: _png(images[index], image_size) for index in test_ids}
    retrieval = {language: [] for language in LANGUAGES}
    for index, png in pngs.items():
        (zeroshot / "images" / f"{index:04d}.png").write_bytes(png)
        for language in LANGUAGES:
            captions = [t.format(c=NAMES[language][int(labels[index])]) for t in EVAL_TEMPLATES[language][:2]]
            retrieval[language].append(
                json.dumps({"image": f"images/{index:04d}.png", "caption": captions}, ensure_ascii=False)
            )
    for language, lines in retrieval.items():  # the official M2-Encoder retrieval layout
        (zeroshot / f"retrieval_{language}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    write_classification_set(zeroshot, pngs, labels, EVAL_TEMPLATES, shard_size)

    draw = np.random.default_rng(seed + 1)
    shifted = {
        index: _shifted_png(
            images[index],
            image_size,
            float(draw.uniform(*UNSEEN_SCALE)),
            *(int(v) for v in draw.integers(-UNSEEN_SHIFT, UNSEEN_SHIFT + 1, size=2)),
        )
        for index in test_ids
    }
    write_classification_set(staging / "zeroshot_unseen", shifted, labels, UNSEEN_TEMPLATES, shard_size)

    for prompts in (EVAL_TEMPLATES, UNSEEN_TEMPLATES):
        texts += [t.format(c=name) for language in LANGUAGES for t in prompts[language] for name in NAMES[language]]
    train_wordpiece(texts, staging / "tokenizer.json", vocab_size=1000)
    mark_complete(staging, f"train images: {len(train_ids)}, held-out images: {len(test_ids)}", VERSION)
    return publish(staging, root, VERSION)
