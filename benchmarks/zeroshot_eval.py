"""Zero-shot evaluation throughput: images/s of classification and of retrieval, end to end.

Model: the benchmark's open_clip config (`mmpt/models/bench-vit-tiny.json`, random weights;
accuracy is not the point), evaluated with mmpt's evaluation functions on the digits corpus's
held-out split (images stored at `--image-size` px): classification over the CLIP_benchmark
webdataset layout (10 classes x the corpus's templates), retrieval over the jsonl of image files
and captions. Timed: everything from reading the data to the metrics (text encoding included).
Each task runs `--repeats` times. Results: benchmarks/results/zeroshot_eval.{json,md}.

    python benchmarks/zeroshot_eval.py      # ~1 minute on 2 cores
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import REPO, cells, save_results, summary

MODEL = str(REPO / "mmpt" / "models" / "bench-vit-tiny.json")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--image-size", type=int, default=96)
    args = parser.parse_args()

    from open_clip import image_transform

    from mmpt.demo.digits import build_digits
    from mmpt.eval.retrieval import zeroshot_retrieval
    from mmpt.eval.zeroshot import load_classification_set, zeroshot_classification
    from mmpt.models.open_clip_model import OpenClipModel, OpenClipTokenizer

    root = build_digits(Path(tempfile.mkdtemp(prefix="mmpt-zs-")) / "digits", image_size=args.image_size)
    torch.manual_seed(0)
    model, tokenizer, transform = OpenClipModel(MODEL).eval(), OpenClipTokenizer(MODEL), image_transform(64, False)
    classification = load_classification_set(root / "zeroshot", "en")
    count = sum(1 for _ in classification.samples())
    retrieval = root / "zeroshot" / "retrieval_en.jsonl"
    images_in_retrieval = sum(1 for _ in retrieval.open())
    tasks = {
        "classification": (
            count,
            lambda: zeroshot_classification(model, tokenizer, transform, classification, batch_size=args.batch_size),
        ),
        "retrieval": (
            images_in_retrieval,
            lambda: zeroshot_retrieval(model, tokenizer, transform, retrieval, batch_size=args.batch_size),
        ),
    }
    rates: dict[str, list[float]] = {}
    for repeat in range(args.repeats):
        for name, (images, evaluate) in tasks.items():
            started = time.perf_counter()
            evaluate()
            rate = images / (time.perf_counter() - started)
            rates.setdefault(name, []).append(rate)
            print(f"repeat {repeat}: {name}: {images} images, {rate:.0f} images/s", flush=True)

    record = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, CPU only",
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
        "setup": {
            "model": Path(MODEL).name,
            "batch_size": args.batch_size,
            "stored_image_size": args.image_size,
            "classification_images": count,
            "retrieval_images": images_in_retrieval,
            "repeats": args.repeats,
        },
        "images_per_s": {k: {**summary(v), "runs": v} for k, v in rates.items()},
    }
    lines = [
        "# Zero-shot evaluation throughput\n",
        f"{record['date']}, {record['machine']}; "
        + ", ".join(f"{k} {v}" for k, v in record["versions"].items())
        + f". Model `{record['setup']['model']}` (64 px), batch {args.batch_size}, {args.repeats} runs. "
        "Produced by `benchmarks/zeroshot_eval.py`.\n",
        "| task | images | images/s min | median | max |",
        "|---|---|---|---|---|",
    ]
    for name, s in record["images_per_s"].items():
        lines.append(f"| {name} | {tasks[name][0]} | {cells(s)} |")
    save_results("zeroshot_eval", record, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
