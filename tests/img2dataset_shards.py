"""Shards as img2dataset writes them, with a second-language caption column: for tests of real-data journeys.

`<shard>.tar` holds `<key>.jpg`, `<key>.txt` (the caption column) and `<key>.json` (every saved column:
url, key, status, caption, caption_zh, sizes), with `<shard>_stats.json` beside it, as
`img2dataset --save_additional_columns '["caption_zh"]'` leaves them.
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

from PIL import Image

DIGIT_NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
DIGIT_NAMES_ZH = ["零", "一", "二", "三", "四", "五", "六", "七", "八", "九"]


def jpeg(index: int, size: int = 48) -> bytes:
    """A small photo-like JPEG whose colours follow `index` (class = index % 10)."""
    image = Image.new("RGB", (size, size), color=((index * 25) % 256, (index % 10) * 25, 255 - (index % 10) * 25))
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def captions(index: int) -> tuple[str, str]:
    """(English, Chinese) caption of sample `index`."""
    digit = index % 10
    return f"a photo of the digit {DIGIT_NAMES[digit]}", f"数字{DIGIT_NAMES_ZH[digit]}的照片"


def write_shard(
    folder: Path,
    shard: int,
    count: int,
    failed: int = 0,
    start: int = 0,
    text_encoding: str = "utf-8",
    image: bytes | None = None,
) -> Path:
    """One img2dataset shard of `count` samples from index `start`; `failed` downloads only counted in stats.

    `text_encoding` encodes the txt member (json stays ASCII-escaped, as Python's json writes it);
    `image` replaces every image's bytes (e.g. garbage).
    """
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{shard:05d}.tar"
    with tarfile.open(path, "w") as archive:
        for i in range(start, start + count):
            key = f"{shard:05d}{i:04d}"
            english, chinese = captions(i)
            meta = {
                "url": f"http://example.com/{key}.jpg",
                "key": key,
                "status": "success",
                "error_message": None,
                "width": 48,
                "height": 48,
                "original_width": 640,
                "original_height": 480,
                "caption": english,
                "caption_zh": chinese,
            }
            txt = chinese.encode(text_encoding) if text_encoding != "utf-8" else english.encode()
            for suffix, data in (
                ("jpg", image if image is not None else jpeg(i)),
                ("txt", txt),
                ("json", json.dumps(meta).encode()),
            ):
                info = tarfile.TarInfo(f"{key}.{suffix}")
                info.size = len(data)
                archive.addfile(info, io.BytesIO(data))
    (folder / f"{shard:05d}_stats.json").write_text(
        json.dumps({"count": count + failed, "successes": count, "failed_to_download": failed, "failed_to_resize": 0})
    )
    return path


def write_set(folder: Path, shards: int, per_shard: int, **options) -> str:
    """`shards` shards into `folder`; returns their brace pattern."""
    for shard in range(shards):
        write_shard(folder, shard, per_shard, start=shard * per_shard, **options)
    return str(folder / f"{{00000..{shards - 1:05d}}}.tar")
