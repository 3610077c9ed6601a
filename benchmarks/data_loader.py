"""Image-text loading throughput: mmpt's resumable reader vs a plain webdataset + torchvision pipeline,
each with float32 images (normalised in the workers, as before) and with uint8 pixels (normalised on
the device, as training now runs).

Both pipelines read the same shards (the digits corpus's English training shards, rebuilt at
`--image-size` as PNG), shuffle in a 1000-sample buffer, decode the image with PIL, apply the same
open_clip training transform (RandomResizedCrop to 64 px) and the same open_clip tokenizer, and batch
64 samples inside DataLoader workers:

- mmpt:  `BatchStream` + `StatefulLoader` (per-sample seeds, skip-and-count, position tracking);
- plain: `wds.WebDataset(resampled) .shuffle .decode("pil") .to_tuple .map_tuple .batched` in a `wds.WebLoader`.

Pixel formats (`--pixels`): `float32` ends the transform with ToTensor + Normalize (open_clip's
transform as it is); `uint8` ends it with PILToTensor (`mmpt.data.image_text.uint8_transform`) and
leaves normalisation to the training step. For each, the bytes per sample that cross worker IPC (the
batch's tensor bytes / batch size) are reported, and, for uint8, what normalising a batch costs this
CPU in the main process (on a GPU rank it runs on the device instead).

Each (pixels, pipeline, workers) runs `--repeats` times, alternating; a run times `--batches` batches
after `--warmup` batches. Results: `--out`/data_loader.{json,md} (default benchmarks/results); the
ratios are printed last.

    python benchmarks/data_loader.py        # both pixel formats; about 3 minutes on 2 idle cores
    python benchmarks/data_loader.py --pixels uint8 --out /tmp/loader   # one format, elsewhere
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
MODEL = str(REPO / "benchmarks" / "configs" / "bench-vit-tiny.json")
BATCH = 64
CROP = 64
PIXELS = ("float32", "uint8")


def transforms(pixels: str):
    """(image transform, tokenizer): open_clip's training transform, finished as `pixels` says."""
    from open_clip import image_transform

    from mmpt.data.image_text import uint8_transform
    from mmpt.models.open_clip_model import OpenClipTokenizer

    image = image_transform(CROP, is_train=True)
    return (uint8_transform(image) if pixels == "uint8" else image), OpenClipTokenizer(MODEL)


def mmpt_loader(pattern: str, workers: int, pixels: str):
    from mmpt.data import BatchStream, Source, StatefulLoader, StreamSpec
    from mmpt.data.image_text import ImageTextDecoder

    image, tokenizer = transforms(pixels)
    spec = StreamSpec(
        [Source.from_pattern(pattern)],
        batch_size=BATCH,
        mode="resampled",
        shuffle_buffer=1000,
        num_workers=workers,
        seed=0,
    )
    # as the open_clip method trains: no attention mask (the plain pipeline has none either)
    return iter(StatefulLoader(BatchStream(spec, ImageTextDecoder(image, tokenizer, attention_mask=False))))


class TokenizeOne:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, text: str) -> torch.Tensor:
        return self.tokenizer([text])["input_ids"][0]


def plain_loader(pattern: str, workers: int, pixels: str):
    import webdataset as wds

    from mmpt.data import expand_shards

    image, tokenizer = transforms(pixels)
    dataset = (
        wds.WebDataset(expand_shards(pattern), resampled=True, shardshuffle=False)
        .shuffle(1000)
        .decode("pil")
        .to_tuple("png", "txt")
        .map_tuple(image, TokenizeOne(tokenizer))
        .batched(BATCH)
    )
    return iter(wds.WebLoader(dataset, batch_size=None, num_workers=workers, prefetch_factor=4 if workers else None))


def tensor_bytes(batch) -> int:
    """Bytes of every tensor in a (nested) batch: what the workers put in shared memory for it."""
    if isinstance(batch, torch.Tensor):
        return batch.nbytes
    if isinstance(batch, dict):
        return sum(tensor_bytes(v) for v in batch.values())
    if isinstance(batch, (list, tuple)):
        return sum(tensor_bytes(v) for v in batch)
    return 0


def time_loader(batches, warmup: int, count: int) -> tuple[float, float]:
    """(samples/s over `count` batches after `warmup`, tensor bytes per sample of the last batch)."""
    for _ in range(warmup):
        next(batches)
    started = time.perf_counter()
    for _ in range(count):
        batch = next(batches)
    return count * BATCH / (time.perf_counter() - started), tensor_bytes(batch) / BATCH


def normalize_seconds(calls: int = 200) -> float:
    """Seconds to normalise one uint8 batch on this CPU, as the training step does on the device."""
    from open_clip import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD

    from mmpt.data.image_text import normalize_pixels

    pixels = torch.randint(0, 256, (BATCH, 3, CROP, CROP), dtype=torch.uint8)
    normalize_pixels(pixels, OPENAI_DATASET_MEAN, OPENAI_DATASET_STD, torch.float32)
    started = time.perf_counter()
    for _ in range(calls):
        normalize_pixels(pixels, OPENAI_DATASET_MEAN, OPENAI_DATASET_STD, torch.float32)
    return (time.perf_counter() - started) / calls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workers", type=int, nargs="*", default=[1, 2])
    parser.add_argument(
        "--pixels",
        nargs="*",
        choices=PIXELS,
        default=list(PIXELS),
        help="image formats through worker IPC: float32 (normalised in the workers), uint8, or both",
    )
    parser.add_argument("--image-size", type=int, default=96, help="stored image size (decode cost)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for data_loader.{json,md}")
    args = parser.parse_args()

    from mmpt.demo.digits import build_digits

    torch.set_num_threads(1)  # the work is in the workers; the main process only receives batches
    data = build_digits(Path(tempfile.mkdtemp(prefix="mmpt-loader-")) / "digits", image_size=args.image_size)
    pattern = str(data / "train/en-*.tar")
    results: dict[str, list[float]] = {}
    ipc_bytes: dict[str, float] = {}
    for repeat in range(args.repeats):
        for workers in args.workers:
            for pixels in args.pixels:
                for name, make in (("mmpt", mmpt_loader), ("plain", plain_loader)):
                    key = f"{name} {pixels} w{workers}"
                    rate, per_sample = time_loader(make(pattern, workers, pixels), args.warmup, args.batches)
                    results.setdefault(key, []).append(rate)
                    ipc_bytes[f"{name} {pixels}"] = per_sample
                    print(
                        f"repeat {repeat}: {key}: {rate:.0f} samples/s, {per_sample:.0f} tensor bytes/sample",
                        flush=True,
                    )
    normalize_ms = normalize_seconds() * 1000 if "uint8" in args.pixels else None

    import webdataset

    median = {k: statistics.median(v) for k, v in results.items()}
    ratios = {
        f"mmpt / plain, {p} w{w}": median[f"mmpt {p} w{w}"] / median[f"plain {p} w{w}"]
        for p in args.pixels
        for w in args.workers
    }
    if set(PIXELS) <= set(args.pixels):
        ratios.update(
            {
                f"mmpt uint8 / float32, w{w}": median[f"mmpt uint8 w{w}"] / median[f"mmpt float32 w{w}"]
                for w in args.workers
            }
        )
    record = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "webdataset": getattr(webdataset, "__version__", "?"),
        },
        "setup": {
            "batch": BATCH,
            "stored_image_size": args.image_size,
            "crop": CROP,
            "batches": args.batches,
            "warmup": args.warmup,
            "repeats": args.repeats,
            "pixels": args.pixels,
        },
        "ipc_bytes_per_sample": ipc_bytes,
        "normalize_uint8_batch_ms_cpu": normalize_ms,
        "samples_per_s": {
            k: {"min": min(v), "median": median[k], "max": max(v), "runs": v} for k, v in results.items()
        },
        "ratios": ratios,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "data_loader.json").write_text(json.dumps(record, indent=2) + "\n")
    lines = [
        "# Image-text loading: mmpt reader vs plain webdataset + torchvision, float32 vs uint8 images\n",
        f"{record['date']}, {record['machine']}; "
        + ", ".join(f"{k} {v}" for k, v in record["versions"].items())
        + f". Batch {BATCH}, {args.image_size} px PNG, RandomResizedCrop {CROP}, open_clip tokenizer; "
        f"{args.batches} batches timed after {args.warmup}, {args.repeats} runs each (alternating). "
        "float32: ToTensor + Normalize in the workers; uint8: pixels, normalised by the training step. "
        "Produced by `benchmarks/data_loader.py`.\n",
        "| pipeline, images, workers | IPC bytes/sample | samples/s min | median | max |",
        "|---|---|---|---|---|",
    ]
    for key, s in record["samples_per_s"].items():
        lines.append(
            f"| {key} | {ipc_bytes[key.rsplit(' ', 1)[0]]:.0f} | {s['min']:.0f} | {s['median']:.0f} | {s['max']:.0f} |"
        )
    lines.append("")
    if normalize_ms is not None:
        lines.append(
            f"Normalising one uint8 batch ({BATCH}x3x{CROP}x{CROP}) to float32 in the main process on this "
            f"CPU: {normalize_ms:.2f} ms (not in the figures above; on a GPU rank it runs on the device).\n"
        )
    lines += [f"{k}: **{v:.3f}x**" for k, v in ratios.items()]
    (args.out / "data_loader.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
