"""Image-text loading throughput: mmpt's resumable reader vs a plain webdataset + torchvision pipeline.

Both read the same shards (the digits corpus's English training shards, rebuilt at `--image-size`
as PNG), shuffle in a 1000-sample buffer, decode the image with PIL, apply the same open_clip
training transform (RandomResizedCrop to 64 px, normalise) and the same open_clip tokenizer, and
batch 64 samples inside DataLoader workers:

- mmpt:  `BatchStream` + `StatefulLoader` (per-sample seeds, skip-and-count, position tracking);
- plain: `wds.WebDataset(resampled) .shuffle .decode("pil") .to_tuple .map_tuple .batched` in a `wds.WebLoader`.

Each (pipeline, workers) runs `--repeats` times, alternating; a run times `--batches` batches after
`--warmup` batches. Results: benchmarks/results/data_loader.{json,md}; the ratio mmpt/plain is
printed last.

    python benchmarks/data_loader.py        # ~2 minutes on 2 cores
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


def transforms():
    from open_clip import image_transform

    from mmpt.models.open_clip_model import OpenClipTokenizer

    return image_transform(64, is_train=True), OpenClipTokenizer(MODEL)


def mmpt_loader(pattern: str, workers: int):
    from mmpt.data import BatchStream, Source, StatefulLoader, StreamSpec
    from mmpt.data.image_text import ImageTextDecoder

    image, tokenizer = transforms()
    spec = StreamSpec([Source.from_pattern(pattern)], batch_size=BATCH, mode="resampled", shuffle_buffer=1000,
                      num_workers=workers, seed=0)
    # as the open_clip method trains: no attention mask (the plain pipeline has none either)
    return iter(StatefulLoader(BatchStream(spec, ImageTextDecoder(image, tokenizer, attention_mask=False))))


class TokenizeOne:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, text: str) -> torch.Tensor:
        return self.tokenizer([text])["input_ids"][0]


def plain_loader(pattern: str, workers: int):
    import webdataset as wds

    from mmpt.data import expand_shards

    image, tokenizer = transforms()
    dataset = (wds.WebDataset(expand_shards(pattern), resampled=True, shardshuffle=False)
               .shuffle(1000).decode("pil").to_tuple("png", "txt").map_tuple(image, TokenizeOne(tokenizer))
               .batched(BATCH))
    return iter(wds.WebLoader(dataset, batch_size=None, num_workers=workers, prefetch_factor=4 if workers else None))


def time_loader(batches, warmup: int, count: int) -> float:
    for _ in range(warmup):
        next(batches)
    started = time.perf_counter()
    for _ in range(count):
        next(batches)
    return count * BATCH / (time.perf_counter() - started)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--workers", type=int, nargs="*", default=[1, 2])
    parser.add_argument("--image-size", type=int, default=96, help="stored image size (decode cost)")
    args = parser.parse_args()

    from mmpt.data.demo_digits import build_digits

    torch.set_num_threads(1)  # the work is in the workers; the main process only receives batches
    data = build_digits(Path(tempfile.mkdtemp(prefix="mmpt-loader-")) / "digits", image_size=args.image_size)
    pattern = str(data / "train/en-*.tar")
    results: dict[str, list[float]] = {}
    for repeat in range(args.repeats):
        for workers in args.workers:
            for name, make in (("mmpt", mmpt_loader), ("plain", plain_loader)):
                rate = time_loader(make(pattern, workers), args.warmup, args.batches)
                results.setdefault(f"{name} w{workers}", []).append(rate)
                print(f"repeat {repeat}: {name} with {workers} worker(s): {rate:.0f} samples/s", flush=True)

    import webdataset

    record = {
        "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "webdataset": getattr(webdataset, "__version__", "?")},
        "setup": {"batch": BATCH, "stored_image_size": args.image_size, "crop": 64, "batches": args.batches,
                  "warmup": args.warmup, "repeats": args.repeats},
        "samples_per_s": {k: {"min": min(v), "median": statistics.median(v), "max": max(v), "runs": v}
                          for k, v in results.items()},
        "ratios": {f"w{w}": statistics.median(results[f"mmpt w{w}"]) / statistics.median(results[f"plain w{w}"])
                   for w in args.workers},
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "data_loader.json").write_text(json.dumps(record, indent=2) + "\n")
    lines = ["# Image-text loading: mmpt reader vs plain webdataset + torchvision\n",
             f"{record['date']}, {record['machine']}; " + ", ".join(f"{k} {v}" for k, v in record["versions"].items())
             + f". Batch {BATCH}, {args.image_size} px PNG, RandomResizedCrop 64, open_clip tokenizer; "
             f"{args.batches} batches timed after {args.warmup}, {args.repeats} runs each (alternating). "
             "Produced by `benchmarks/data_loader.py`.\n",
             "| pipeline, workers | samples/s min | median | max |", "|---|---|---|---|"]
    for key, s in record["samples_per_s"].items():
        lines.append(f"| {key} | {s['min']:.0f} | {s['median']:.0f} | {s['max']:.0f} |")
    lines.append("")
    lines += [f"mmpt / plain, {k}: **{v:.3f}x**" for k, v in record["ratios"].items()]
    (RESULTS / "data_loader.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
