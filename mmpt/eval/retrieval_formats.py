"""The image-text retrieval layouts results are reported on, read into one shape.

| layout | what is given | reported on |
|---|---|---|
| mmpt / official M²-Encoder jsonl | `{"image": path, "caption": [...]}` per line | M²-Encoder's retrieval evaluation |
| ALBEF/BLIP json | a list of `{"image": path, "caption": [...]}` (`flickr30k_test.json`, `coco_karpathy_test.json`) | Flickr30K 1k, COCO 5k |
| Karpathy split | `dataset_flickr30k.json`, `dataset_coco.json`: `{"images": [{"filepath"?, "filename", "split", "sentences": [{"raw"}]}]}`; the `test` split | Flickr30K 1k, COCO 5k |
| Chinese-CLIP | `<split>_texts.jsonl` (`{"text_id", "text", "image_ids"}`) and `<split>_imgs.tsv` (`image_id<TAB>base64`) beside it | Flickr30K-CN, COCO-CN, MUGE |
| CLIP_benchmark webdataset | a folder with `dataset_type.txt` = retrieval and `test/*.tar` of an image and a `txt` of one caption per line | CLIP_benchmark |

Image paths are relative to the annotation file's folder unless absolute (for the Karpathy files:
`<folder>/<filepath>/<filename>`, so the file sits in the COCO root or in Flickr30K's image folder).
A text may match several images (MUGE's queries do): matches are a boolean [images, texts] matrix.
"""

from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mmpt.data.fields import SampleFields
from mmpt.data.image_text import decode_text, pick_field
from mmpt.data.pairs import chinese_clip_image
from mmpt.data.shards import DataError, MissingDataError, expand_shards
from mmpt.data.stream import read_shard
from mmpt.errors import first_line


@dataclass(frozen=True)
class ImageBytes:
    """An image held in memory (from a shard or a tsv), with what `Path` offers the evaluation."""

    data: bytes
    name: str

    def read_bytes(self) -> bytes:
        return self.data

    def __str__(self) -> str:
        return self.name


@dataclass
class RetrievalSet:
    images: list[Any]  # Path or ImageBytes: anything with read_bytes()
    texts: list[str]
    matches: torch.Tensor  # bool [images, texts]: text j describes image i
    image_ids: list[int] | None = None  # the layout's own ids (Chinese-CLIP's); None: positions
    text_ids: list[int] | None = None

    @classmethod
    def from_captions(cls, images: list[Any], captions: list[list[str]]) -> RetrievalSet:
        texts = [t for group in captions for t in group]
        owner = torch.tensor([i for i, group in enumerate(captions) for _ in group])
        return cls(images, texts, owner[None, :] == torch.arange(len(images))[:, None])


def read_retrieval_set(path: str | os.PathLike, fields: SampleFields | None = None) -> RetrievalSet:
    """Any layout of the module docstring, told apart by its name and shape. `fields` says where shard
    samples keep their image and captions (`mmpt.data.fields`; default: the image members and `txt`)."""
    if is_shard_pattern(str(path)):
        return RetrievalSet.from_captions(*load_shard_retrieval(str(path), fields or SampleFields()))
    path = Path(path)
    if path.is_dir():
        return RetrievalSet.from_captions(*load_wds_retrieval(path, fields=fields))
    if not path.is_file():
        raise MissingDataError(f"retrieval dataset {path} does not exist")
    if path.name.endswith("_texts.jsonl"):
        return load_chinese_clip(path)
    return RetrievalSet.from_captions(*read_listing(path))


def shard_caption_keys(path: str | os.PathLike, fields: SampleFields | None = None) -> str | None:
    """The sample keys the captions of a shard layout are read from (its results record them: the language they
    are filed under is the caller's word); None for a listing file, whose captions are its own."""
    if not (is_shard_pattern(str(path)) or Path(path).is_dir()):
        return None
    return ",".join(fields.caption) if fields is not None and fields.caption else "txt"


def read_listing(path: Path) -> tuple[list[Path], list[list[str]]]:
    """(image files, captions of each) of a listing file, a .jsonl of records or a Karpathy or ALBEF/BLIP .json;
    any other file is refused by name, not read as one of them."""
    if path.suffix == ".json":
        return load_json_annotations(path)
    if path.suffix == ".jsonl":
        return load_retrieval_set(path)
    raise DataError(
        f'{path}: not a retrieval layout mmpt reads (a .jsonl of {{"image": path, "caption": [...]}} lines, a '
        "Karpathy or ALBEF .json, Chinese-CLIP's <split>_texts.jsonl, WebDataset shards: docs/evaluation.md)"
    )


def _resolve(folder: Path, file: str) -> Path:
    return Path(file) if os.path.isabs(file) else folder / file


def load_retrieval_set(path: str | os.PathLike, media: str = "image") -> tuple[list[Path], list[list[str]]]:
    """(files, captions of each) from `{"<media>": path, "caption": [...]}` lines."""
    path = Path(path)
    files, captions = [], []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            file, texts = record[media], record["caption"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise DataError(f'{path}:{number}: expected {{"{media}": path, "caption": [...]}} ({exc})') from None
        texts = [texts] if isinstance(texts, str) else list(texts)
        if not texts:
            raise DataError(f"{path}:{number}: no captions")
        files.append(_resolve(path.parent, file))
        captions.append(texts)
    if not files:
        raise DataError(f"{path}: no records")
    return files, captions


def load_json_annotations(path: Path, split: str = "test") -> tuple[list[Path], list[list[str]]]:
    """A Karpathy split file (its `split` images) or an ALBEF/BLIP list of records."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}: not JSON ({exc})") from None
    files, captions = [], []
    if isinstance(data, dict) and "images" in data:
        for number, image in enumerate(data["images"]):
            if image.get("split") != split:
                continue
            try:
                texts = [s["raw"].strip() for s in image["sentences"]]
                files.append(path.parent / image.get("filepath", "") / image["filename"])
            except (KeyError, TypeError) as exc:
                raise DataError(
                    f"{path}: images[{number}] lacks {exc} (Karpathy layout: filename, sentences[].raw)"
                ) from None
            captions.append(texts)
    elif isinstance(data, list):
        for number, record in enumerate(data):
            try:
                texts = record["caption"]
                files.append(_resolve(path.parent, record["image"]))
            except (KeyError, TypeError) as exc:
                raise DataError(f'{path}: record {number} lacks {exc} (expected {{"image", "caption"}})') from None
            captions.append([texts] if isinstance(texts, str) else list(texts))
    else:
        raise DataError(f'{path}: expected a Karpathy split ({{"images": [...]}}) or a list of {{"image", "caption"}}')
    if not files:
        raise DataError(f"{path}: no '{split}' images")
    if any(not texts for texts in captions):
        raise DataError(f"{path}: an image without captions")
    return files, captions


def chinese_clip_images_file(texts_file: Path) -> Path:
    images_file = texts_file.with_name(texts_file.name.replace("_texts.jsonl", "_imgs.tsv"))
    if not images_file.is_file():
        raise DataError(f"{texts_file}: the images file {images_file.name} is not beside it (Chinese-CLIP layout)")
    return images_file


def check_chinese_clip(texts_file: Path) -> None:
    """The images file is beside `texts_file` and its first image decodes: a layout that cannot be read is found
    before a run trains, not when it evaluates (the set is read whole only then)."""
    from PIL import Image

    images_file = chinese_clip_images_file(texts_file)
    with images_file.open(encoding="utf-8") as lines:
        first = next((line for line in lines if line.strip()), "")
    try:
        Image.open(io.BytesIO(chinese_clip_image(first.partition("\t")[2]))).verify()
    except Exception as exc:  # PIL raises several kinds for bytes that are no image
        raise DataError(f"{images_file}: its first line is not image_id<TAB>base64 image ({first_line(exc)})") from None


def load_chinese_clip(texts_file: Path) -> RetrievalSet:
    """`<split>_texts.jsonl` with the `<split>_imgs.tsv` beside it; every image of the tsv is a candidate."""
    images_file = chinese_clip_images_file(texts_file)
    images, row, image_ids, text_ids = [], {}, [], []
    for number, line in enumerate(images_file.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        image_id, _, encoded = line.partition("\t")
        image_ids.append(_id(image_id, f"{images_file}:{number}"))
        try:
            images.append(ImageBytes(chinese_clip_image(encoded), f"{images_file}:{image_id}"))
        except ValueError as exc:
            raise DataError(f"{images_file}:{number}: expected image_id<TAB>base64 ({exc})") from None
        row[image_id.strip()] = len(images) - 1
    texts, pairs = [], []
    for number, line in enumerate(texts_file.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            text, rows = record["text"], [row[str(i)] for i in record["image_ids"]]
            text_ids.append(_id(record.get("text_id", len(texts)), f"{texts_file}:{number}"))
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise DataError(
                f'{texts_file}:{number}: expected {{"text_id", "text", "image_ids"}} with ids of '
                f"{images_file.name} ({type(exc).__name__}: {exc})"
            ) from None
        if not rows:
            raise DataError(f"{texts_file}:{number}: no image_ids")
        pairs += [(r, len(texts)) for r in rows]
        texts.append(text)
    if not texts:
        raise DataError(f"{texts_file}: no records")
    matches = torch.zeros(len(images), len(texts), dtype=torch.bool)
    matches[tuple(torch.tensor(pairs).T)] = True
    return RetrievalSet(images, texts, matches, image_ids, text_ids)


def _id(value: Any, where: str) -> int:
    """A Chinese-CLIP id: an integer (its evaluation scripts and MUGE's leaderboard take no other)."""
    try:
        return int(str(value).strip())
    except ValueError:
        raise DataError(f"{where}: id {value!r} is not an integer (Chinese-CLIP's ids are)") from None


def is_shard_pattern(text: str) -> bool:
    """Whether a dataset is named as tar shards (`heldout/{00000..00003}.tar`, `heldout/*.tar`), not a folder
    or an annotation file."""
    return text.endswith(".tar") or (".tar" in text and any(c in text for c in "{*,"))


def load_shard_retrieval(pattern: str, fields: SampleFields) -> tuple[list[ImageBytes], list[list[str]]]:
    """Shards such as held-out img2dataset output: each sample an image and every caption its keys hold."""
    images, captions = [], []
    for url in expand_shards(pattern):
        for _, sample in read_shard(url):
            sample["__shard__"] = url
            images.append(ImageBytes(fields.image_bytes(sample), f"{url}:{sample['__key__']}"))
            captions.append(fields.captions(sample))
    if not images:
        raise DataError(f"{pattern}: no samples")
    return images, captions


def load_wds_retrieval(
    folder: Path, split: str = "test", fields: SampleFields | None = None
) -> tuple[list[ImageBytes], list[list[str]]]:
    """A CLIP_benchmark webdataset retrieval folder (its `txt` holds a caption per line, unless `fields` names
    other caption keys)."""
    fields = fields or SampleFields()
    kind = folder / "dataset_type.txt"
    if not kind.exists() or kind.read_text().strip().lower() != "retrieval":
        raise DataError(
            f"{folder}: a retrieval folder needs dataset_type.txt saying 'retrieval' (CLIP_benchmark's layout)"
        )
    shards = sorted((folder / split).glob("*.tar"), key=lambda p: (len(p.stem), p.stem))  # 0, 1, ..., 10
    if not shards:
        raise DataError(f"{folder}: no {split}/*.tar shards")
    images, captions = [], []
    for shard in shards:
        for _, sample in read_shard(str(shard)):
            sample["__shard__"] = shard
            name = f"{shard}:{sample['__key__']}"
            if fields.caption is None:
                texts = [
                    t.strip() for t in decode_text(pick_field(sample, ("txt",), "caption")).splitlines() if t.strip()
                ]
            else:
                texts = fields.captions(sample)
            if not texts:
                raise DataError(f"retrieval sample {name}: no captions")
            images.append(ImageBytes(fields.image_bytes(sample), name))
            captions.append(texts)
    return images, captions
