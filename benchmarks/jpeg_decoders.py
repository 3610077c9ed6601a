"""JPEG decoders a user can install, per CPU core, on web-like photos: which one should feed the GPU.

Each decoder decodes every image of a generated web-like corpus (`benchmarks/web_images.py`: 0.46 MP, q90,
4:2:0 on average) to RGB pixels, in a process pinned to one core, twice:
- whole: every pixel, as a plain `Image.open(...).convert("RGB")` does;
- reduced: straight from the DCT coefficients at the largest reduction that keeps the short side at least
  `--side` px (a 224 px training crop of a photo needs no more; mmpt's loader does this with simplejpeg,
  `data/reduced_decode.py`). PIL's `draft` and simplejpeg reduce by 1/2, 1/4 and 1/8; libjpeg-turbo's
  TurboJPEG API by any of its eighths; torchvision's CPU `decode_jpeg` cannot reduce.
Not measured here: pillow-simd (no wheels: built from source, it replaces Pillow's resize, not its JPEG
decoder, which is libjpeg-turbo in both) and nvJPEG (`torchvision.io.decode_jpeg(device="cuda")`, a GPU).

    python benchmarks/jpeg_decoders.py              # writes benchmarks/results/jpeg_decoders.{json,md}
"""

from __future__ import annotations

import argparse
import io
import math
import os
import sys
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cells, machine_line, save_results, summary
from web_images import image_size, jpeg_bytes, photo

Decode = Callable[[bytes, int], np.ndarray]  # (JPEG bytes, short side wanted; 0: whole) -> HxWx3 uint8


def wanted(width: int, height: int, side: int) -> tuple[int, int]:
    """The smallest size of the image's shape whose short side is at least `side`."""
    scale = side / min(width, height)
    return math.ceil(width * scale), math.ceil(height * scale)


def pil(data: bytes, side: int) -> np.ndarray:
    image = Image.open(io.BytesIO(data))
    if side:
        image.draft("RGB", wanted(*image.size, side))
    return np.asarray(image.convert("RGB"))


def simplejpeg_decoder() -> Decode:
    import simplejpeg

    def decode(data: bytes, side: int) -> np.ndarray:
        if not side:
            return simplejpeg.decode_jpeg(data, colorspace="RGB")
        height, width, _, _ = simplejpeg.decode_jpeg_header(data)
        min_width, min_height = wanted(width, height, side)
        return simplejpeg.decode_jpeg(data, colorspace="RGB", min_width=min_width, min_height=min_height)

    return decode


def turbojpeg_decoder() -> Decode:
    from turbojpeg import TJPF_RGB, TurboJPEG

    turbo = TurboJPEG()
    factors = sorted(turbo.scaling_factors, key=lambda f: f[0] / f[1])

    def decode(data: bytes, side: int) -> np.ndarray:
        if not side:
            return turbo.decode(data, pixel_format=TJPF_RGB)
        width, height, _, _ = turbo.decode_header(data)
        short = min(width, height)
        factor = next(f for f in factors if math.ceil(short * f[0] / f[1]) >= side)
        return turbo.decode(data, pixel_format=TJPF_RGB, scaling_factor=factor)

    return decode


def torchvision_cpu(data: bytes, side: int) -> np.ndarray:
    import torch
    from torchvision.io import ImageReadMode, decode_jpeg

    pixels = decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
    return pixels.permute(1, 2, 0).numpy()


def decoders() -> dict[str, Decode | str]:
    """Every decoder by name, or why it cannot run here."""
    found: dict[str, Decode | str] = {"PIL (libjpeg-turbo)": pil, "torchvision CPU": torchvision_cpu}
    for name, make in (("simplejpeg", simplejpeg_decoder), ("PyTurboJPEG", turbojpeg_decoder)):
        try:
            found[name] = make()
        except (ImportError, OSError, RuntimeError) as exc:
            found[name] = f"not installed ({type(exc).__name__})"
    return found


def corpus(count: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [jpeg_bytes(photo(rng, *image_size(rng))) for _ in range(count)]


def images_per_second(decode: Decode, images: list[bytes], side: int, repeats: int) -> list[float]:
    decode(images[0], side)  # warm-up: imports, tables
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        for data in images:
            decode(data, side)
        rates.append(len(images) / (time.perf_counter() - start))
    return rates


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--side", type=int, default=224, help="short side the reduced decode must keep")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default: benchmarks/results)")
    args = parser.parse_args()
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core: figures are per core
    images = corpus(args.images, seed=0)
    pixels = [Image.open(io.BytesIO(data)).size for data in images]
    megapixels = sum(w * h for w, h in pixels) / len(pixels) / 1e6
    kib = sum(map(len, images)) / len(images) / 1024
    record: dict = {"images": args.images, "megapixels": megapixels, "kib": kib, "side": args.side, "decoders": {}}
    rows = []
    for name, decode in decoders().items():
        if isinstance(decode, str):
            record["decoders"][name] = decode
            rows.append(f"| {name} | {decode} | | | | | |")
            continue
        whole = summary(images_per_second(decode, images, 0, args.repeats))
        reduced = (
            None if name == "torchvision CPU" else summary(images_per_second(decode, images, args.side, args.repeats))
        )
        record["decoders"][name] = {"whole": whole, "reduced": reduced}
        rows.append(f"| {name} | {cells(whole)} | {cells(reduced) if reduced else 'cannot reduce | |'} |")
    baseline = record["decoders"]["PIL (libjpeg-turbo)"]["whole"]["median"]
    measured = {n: d for n, d in record["decoders"].items() if isinstance(d, dict)}
    best = max(measured, key=lambda n: (measured[n]["reduced"] or measured[n]["whole"])["median"])
    best_rate = (measured[best]["reduced"] or measured[best]["whole"])["median"]
    versions = {"pillow": Image.__version__}
    for package in ("simplejpeg", "PyTurboJPEG"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    lines = [
        "# JPEG decoders per CPU core on web-like photos",
        "",
        machine_line("one core", **versions)
        + f". {args.images} generated JPEGs (`benchmarks/web_images.py`): {megapixels:.2f} MP and {kib:.0f} KiB "
        f"on average; images/s over {args.repeats} passes after a warm-up. Reduced: decoded from the DCT at the "
        f"largest reduction keeping the short side >= {args.side} px. Produced by `benchmarks/jpeg_decoders.py`.",
        "",
        "| decoder | whole min | median | max | reduced min | median | max |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"Fastest: **{best}** at {best_rate:.0f} images/s per core, {best_rate / baseline:.2f}x a whole PIL decode. "
        f"On an 8-core share of a GPU host (one core for the rank, 7 loading) that is {7 * best_rate:.0f} decoded "
        "images/s per GPU, before cropping and resizing.",
        "",
        "What carries over to a GPU host: per-core rates scale with the cores given to loading (each worker is "
        "independent) and with the host's core speed, every row alike, so the ranking holds. Decoding is only "
        "part of a sample's cost: the crop, resize and tensor conversion follow "
        "(`benchmarks/results/data_loader_web.md`).",
    ]
    save_results("jpeg_decoders", record, lines, args.out or Path(__file__).resolve().parent / "results")
    return 0


if __name__ == "__main__":
    sys.exit(main())
