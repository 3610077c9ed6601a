"""A generated web-like image-text corpus for loader benchmarks: photo-sized JPEGs with bilingual captions.

Decoding cost depends on pixel count and on how much detail the JPEG holds, so flat synthetic images
(digits, solid colours) time a loader far too kindly. These images are built to cost what web photos
cost:

- size: long side log-uniform in 256-1500 px, aspect drawn from 1:1, 4:3, 3:2, 16:9, landscape or portrait
  (about 0.46 MP on average);
- texture: 1/f noise summed over octaves (smooth shading down to fine grain), a few soft-edged shapes with
  their own gradients and texture (object boundaries), a sky-like gradient behind, and sensor grain;
- JPEG at quality 90 with 4:2:0 chroma, as cameras and img2dataset (PIL's default) write it; `bytes_per_pixel`
  in the summary says whether the result is photo-like (photographs at q90 take roughly 0.2-0.5 bytes a
  pixel, more when small and detailed; this corpus about 0.3).

Shards follow img2dataset's output: `{00000..}.tar` of `<key>.jpg`, `<key>.txt` (the English caption) and
`<key>.json` (url, key, status, sizes, caption, caption_zh), with `<shard>_stats.json` beside each shard.

    python benchmarks/web_images.py /tmp/web --shards 4 --per-shard 256   # writes the corpus, prints a summary
"""

from __future__ import annotations

import argparse
import io
import json
import math
import sys
import tarfile
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

ASPECTS = (1.0, 4 / 3, 3 / 2, 16 / 9)
QUALITY = 90
FALLOFF = 0.85  # amplitude kept per octave: natural images lose detail more slowly than 1/2 (pure 1/f) at fine scales
SUBJECTS = (
    ("dog", "狗"),
    ("cat", "猫"),
    ("bicycle", "自行车"),
    ("bowl of noodles", "一碗面条"),
    ("mountain", "山"),
    ("old house", "老房子"),
    ("red car", "红色汽车"),
    ("bird", "鸟"),
    ("teapot", "茶壶"),
    ("street market", "街市"),
)
PLACES = (
    ("in the park", "公园里"),
    ("on a table", "桌子上"),
    ("by the river", "河边"),
    ("in the snow", "雪地里"),
    ("at night", "夜晚"),
    ("under a blue sky", "蓝天下"),
)
STYLES = (("a photo of", "一张{}的照片"), ("a close-up of", "{}的特写"), ("a picture showing", "图中是{}"))


def image_size(rng: np.random.Generator) -> tuple[int, int]:
    """(width, height): long side log-uniform in 256-1500 px, a common aspect, landscape or portrait."""
    long_side = round(math.exp(rng.uniform(math.log(256), math.log(1500))))
    short_side = max(16, round(long_side / ASPECTS[rng.integers(len(ASPECTS))]))
    return (long_side, short_side) if rng.random() < 0.7 else (short_side, long_side)


def octave_noise(rng: np.random.Generator, width: int, height: int, channels: int = 3) -> np.ndarray:
    """[H, W, C] float noise with a 1/f spectrum: octaves of smooth noise, each half the size and amplitude."""
    out = np.zeros((height, width, channels), np.float32)
    cell, amplitude = max(width, height) / 2, 1.0
    while cell >= 1:
        grid = (max(2, math.ceil(width / cell) + 1), max(2, math.ceil(height / cell) + 1))
        for c in range(channels):
            small = Image.fromarray(rng.standard_normal(grid[::-1]).astype(np.float32), mode="F")
            out[..., c] += amplitude * np.asarray(small.resize((width, height), Image.Resampling.BICUBIC))
        cell, amplitude = cell / 2, amplitude * FALLOFF
    return out


def shapes_layer(rng: np.random.Generator, width: int, height: int) -> tuple[np.ndarray, np.ndarray]:
    """(colour [H, W, 3], coverage [H, W] in 0-1): a few ellipses and polygons, softly edged, each its own colour."""
    mask = Image.new("L", (width, height), 0)
    colour = Image.new("RGB", (width, height), 0)
    for _ in range(rng.integers(4, 16)):
        layer = Image.new("L", (width, height), 0)
        draw = ImageDraw.Draw(layer)
        cx, cy = rng.uniform(0, width), rng.uniform(0, height)
        r = rng.uniform(0.04, 0.35) * min(width, height)
        if rng.random() < 0.5:
            draw.ellipse((cx - r, cy - r * rng.uniform(0.5, 1.5), cx + r, cy + r), fill=255)
        else:
            angles = np.sort(rng.uniform(0, 2 * math.pi, rng.integers(3, 8)))
            draw.polygon([(cx + r * math.cos(a), cy + r * math.sin(a)) for a in angles], fill=255)
        layer = layer.filter(ImageFilter.GaussianBlur(rng.uniform(0.5, 2.5)))  # focus: some edges crisp, some soft
        colour.paste(tuple(int(v) for v in rng.integers(0, 256, 3)), mask=layer.point(lambda v: 255 if v else 0))
        mask = Image.fromarray(np.maximum(np.asarray(mask), np.asarray(layer)))
    return np.asarray(colour, np.float32), np.asarray(mask, np.float32) / 255


def photo(rng: np.random.Generator, width: int, height: int) -> Image.Image:
    """A photo-like RGB image: a gradient backdrop, shapes, 1/f texture over both, and sensor grain."""
    y = np.linspace(0, 1, height, dtype=np.float32)[:, None, None]
    top, bottom = rng.uniform(40, 230, 3), rng.uniform(20, 200, 3)
    backdrop = top + (bottom - top) * y
    colour, coverage = shapes_layer(rng, width, height)
    base = backdrop * (1 - coverage[..., None]) + colour * coverage[..., None]
    texture = octave_noise(rng, width, height)
    luminance = texture.mean(axis=2, keepdims=True)  # photo texture is mostly in brightness, less in colour
    pixels = base + 30 * luminance + 8 * (texture - luminance) + rng.normal(0, 4, (height, width, 1))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")


def captions(rng: np.random.Generator) -> tuple[str, str]:
    """(English, Chinese) caption of one image."""
    (subject, subject_zh), (place, place_zh) = (
        SUBJECTS[rng.integers(len(SUBJECTS))],
        PLACES[rng.integers(len(PLACES))],
    )
    style, style_zh = STYLES[rng.integers(len(STYLES))]
    article = "an" if subject[0] in "aeiou" else "a"
    return f"{style} {article} {subject} {place}", style_zh.format(place_zh + "的" + subject_zh)


def jpeg_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=QUALITY)
    return buffer.getvalue()


def write_shard(folder: Path, shard: int, count: int, seed: int) -> dict[str, float]:
    """One img2dataset-style shard of `count` samples; returns its pixel and byte totals."""
    rng = np.random.default_rng([seed, shard])
    pixels = stored = 0
    with tarfile.open(folder / f"{shard:05d}.tar", "w") as archive:
        for i in range(count):
            key = f"{shard:05d}{i:04d}"
            width, height = image_size(rng)
            data = jpeg_bytes(photo(rng, width, height))
            english, chinese = captions(rng)
            meta = {
                "url": f"https://example.com/images/{key}.jpg",
                "key": key,
                "status": "success",
                "error_message": None,
                "width": width,
                "height": height,
                "original_width": width,
                "original_height": height,
                "caption": english,
                "caption_zh": chinese,
            }
            members = (("jpg", data), ("txt", english.encode()), ("json", json.dumps(meta).encode()))
            for suffix, payload in members:
                info = tarfile.TarInfo(f"{key}.{suffix}")
                info.size = len(payload)
                archive.addfile(info, io.BytesIO(payload))
            pixels, stored = pixels + width * height, stored + len(data)
    stats = {"count": count, "successes": count, "failed_to_download": 0, "failed_to_resize": 0}
    (folder / f"{shard:05d}_stats.json").write_text(json.dumps(stats))
    return {"pixels": pixels, "bytes": stored}


def write_corpus(folder: Path, shards: int, per_shard: int, seed: int = 0) -> tuple[str, dict[str, float]]:
    """The corpus under `folder`: (brace pattern of its shards, summary of sizes and bytes per pixel)."""
    folder.mkdir(parents=True, exist_ok=True)
    totals = [write_shard(folder, shard, per_shard, seed) for shard in range(shards)]
    pixels, stored = sum(t["pixels"] for t in totals), sum(t["bytes"] for t in totals)
    images = shards * per_shard
    summary = {
        "images": images,
        "mean_megapixels": pixels / images / 1e6,
        "mean_kib": stored / images / 1024,
        "bytes_per_pixel": stored / pixels,
        "jpeg_quality": QUALITY,
    }
    return str(folder / f"{{00000..{shards - 1:05d}}}.tar"), summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--per-shard", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    pattern, summary = write_corpus(args.folder, args.shards, args.per_shard, args.seed)
    print(pattern)
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
