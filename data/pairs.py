"""Image-caption pairs from where people keep them, for `mmpt-make-image-text-shards`: a folder of images with
sidecar captions, a table of image paths and caption columns (csv, tsv, jsonl, parquet), and Chinese-CLIP's
layout (`<split>_imgs.tsv` of base64 images + `<split>_texts.jsonl`).

A pair names where its image is (a file, or a line of a tsv by byte offset) without reading it, so a list of
millions of pairs is small and can be cut into shards handed to worker processes.
"""

from __future__ import annotations

import base64
import csv
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from mmpt.data.shards import MissingDataError

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp")
PROBED = 100  # a table none of whose first images exists names a wrong folder, not missing images


@dataclass(frozen=True)
class Pair:
    """One sample: its image (`path`, or the tsv line at `offset` of `path`) and its captions by column name ("" where
    a row leaves a column empty)."""

    source: str  # what the image is called where it came from (a path, or a Chinese-CLIP image id)
    path: str
    captions: dict[str, str] = field(default_factory=dict)
    offset: int | None = None

    def image_bytes(self) -> bytes:
        if self.offset is None:
            return Path(self.path).read_bytes()
        with open(self.path, "rb") as tsv:
            tsv.seek(self.offset)
            return chinese_clip_image(tsv.readline().split(b"\t", 1)[1])


def chinese_clip_image(encoded: str | bytes) -> bytes:
    """The image of a Chinese-CLIP `*_imgs.tsv` line from its base64: Chinese-CLIP writes the URL-safe alphabet,
    other tools the standard one; either is read. Anything else raises ValueError."""
    return base64.b64decode(encoded.strip(), altchars=b"-_", validate=True)


def folder_pairs(folder: Path) -> list[Pair]:
    """Every image under `folder` (recursively, sorted) with the text of its sidecar `<stem>.txt` as "caption"
    (no sidecar: no caption, counted as skipped)."""
    if not folder.is_dir():
        raise MissingDataError(f"--images {folder}: no such folder")
    pairs = []
    for path in sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES):
        sidecar = path.with_suffix(".txt")
        captions = {"caption": sidecar.read_text(encoding="utf-8").strip()} if sidecar.is_file() else {}
        pairs.append(Pair(str(path.relative_to(folder)), str(path), captions))
    return pairs


def table_rows(path: Path, encoding: str) -> Iterator[dict]:
    """The rows of a csv, tsv, jsonl or parquet table as dicts."""
    if not path.is_file():
        raise MissingDataError(f"--table {path}: no such file")
    suffix = path.suffix.lower()
    if suffix in (".csv", ".tsv"):
        with open(path, encoding=encoding, newline="") as handle:
            yield from csv.DictReader(handle, delimiter="\t" if suffix == ".tsv" else ",")
    elif suffix in (".jsonl", ".json"):
        with open(path, encoding=encoding) as handle:
            yield from json_lines(handle, f"--table {path}")
    elif suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise MissingDataError(
                f"--table {path}: reading parquet needs pyarrow (pip install 'mmpt[parquet]')"
            ) from None
        yield from pq.read_table(path).to_pylist()
    else:
        raise MissingDataError(f"--table {path}: not a .csv, .tsv, .jsonl or .parquet file")


def table_pairs(
    path: Path, image_column: str, caption_columns: list[str], images_root: Path | None, encoding: str = "utf-8"
) -> list[Pair]:
    """A pair per row: the image at the path in `image_column` (relative to `images_root`, else to the table's
    folder), each of `caption_columns` a caption (empty or absent ones as "", left out of the shard: a row with
    none is skipped as uncaptioned; a caption column that no row has is a typo, and an error). A root under which
    none of the first PROBED images exists is an error before any shard is written (a rerun would keep empty
    shards)."""
    if images_root is not None and not images_root.is_dir():
        raise MissingDataError(f"--images-root {images_root}: no such folder")
    root = images_root or path.parent
    pairs, columns = [], set()
    try:
        for number, row in enumerate(table_rows(path, encoding), start=1):
            if image_column not in row:
                raise MissingDataError(
                    f"--table {path}: row {number} has no column {image_column!r} (it has {sorted(row)})"
                )
            columns.update(row)
            captions = {c: "" if row.get(c) is None else str(row[c]).strip() for c in caption_columns}
            image = str(row[image_column])
            pairs.append(Pair(image, str(root / image), captions))
    except UnicodeDecodeError as exc:
        raise MissingDataError(f"--table {path} is not {encoding} text ({exc.reason}); set --encoding") from None
    absent = [c for c in caption_columns if c not in columns]
    if pairs and absent:  # a row without a caption is skipped as uncaptioned; a column no row has is a typo
        raise MissingDataError(f"--table {path}: no row has column {absent[0]!r} (the rows have {sorted(columns)})")
    probed = pairs[:PROBED]
    if probed and not any(Path(pair.path).is_file() for pair in probed):
        relative_to = "--images-root" if images_root is not None else "the table's folder; set --images-root"
        raise MissingDataError(
            f"--table {path}: none of the first {len(probed)} images exists (the first, {probed[0].source!r}, is not "
            f"at {probed[0].path}): the paths are read relative to {relative_to}"
        )
    return pairs


def json_lines(lines: Iterator[str], where: str) -> Iterator[dict]:
    """The JSON object on each non-blank line; one line naming the line number where one is not."""
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise MissingDataError(f"{where}: line {number} is not JSON ({exc.msg}): one object a line") from None
        if not isinstance(record, dict):
            raise MissingDataError(f"{where}: line {number} is a JSON {type(record).__name__}, not an object")
        yield record


def cn_clip_pairs(images_tsv: Path, texts_jsonl: Path) -> list[Pair]:
    """Chinese-CLIP's training layout: a pair per (text, image id) of `texts_jsonl` ({"text_id", "text",
    "image_ids"} per line), its image the base64 line `<image_id>\\t<base64>` of `images_tsv`."""
    for given in (images_tsv, texts_jsonl):
        if not given.is_file():
            raise MissingDataError(f"{given}: no such file")
    offsets: dict[str, int] = {}
    with open(images_tsv, "rb") as tsv:
        position = 0
        for line in tsv:
            offsets[line.split(b"\t", 1)[0].decode()] = position
            position += len(line)
    pairs = []
    with open(texts_jsonl, encoding="utf-8") as handle:
        for record in json_lines(handle, str(texts_jsonl)):
            for image_id in record["image_ids"]:
                offset = offsets.get(str(image_id))
                source = f"image {image_id} (text {record['text_id']})"
                pairs.append(
                    Pair(source, str(images_tsv), {"caption": record["text"]}, offset if offset is not None else -1)
                )
    return pairs
