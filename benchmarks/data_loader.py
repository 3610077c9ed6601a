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

`--corpus web`: samples/s per CPU core at 224 px on web-like JPEGs (`benchmarks/web_images.py`: 256-1500 px,
q90, photographic texture, bilingual captions, img2dataset's shard layout), each pipeline in its own process
pinned to one core (`os.sched_setaffinity`, one torch thread), reading the shards in that process:

- mmpt: the image-text methods' training data (`BatchStream` + `StatefulLoader`, `ImageTextDecoder` with
  `training_image_decode(uint8_transform(open_clip.image_transform(224, is_train=True)))`): JPEGs decoded at
  reduced size, uint8 pixels out;
- mmpt-full-decode: the same without the reduced decode (what it buys on its own);
- open_clip: open_clip_train's training pipeline as `open_clip_train.data.get_wds_dataset` builds it, from its
  own pieces (resampled shards, 5000-sample shuffle, `decode("pilrgb")`, `image_transform(224, is_train=True)`,
  the tokenizer, batching; the tar reader is webdataset's, as open_clip_train's own needs webdataset <= 0.2.86);
  float normalised pixels out, as it trains;
- plain: a full PIL decode + bicubic resize to 224 x 224 + `PILToTensor` of each image, nothing else (the floor
  a full decode sets).

Each pipeline runs `--repeats` times, alternating, timing `--batches` batches of 64 after `--warmup`; min /
median / max samples/s per core. From the median, the samples/s per GPU an 8-GPU node with N cores per GPU
sustains (`--cores-per-gpu`), taking one core per GPU for the training process, against `--gpu-rate` (what
one H100 trains). Results: `--out`/data_loader_web.{json,md}. The timed run (about 10 minutes on an idle
machine, corpus generation included; `--web-data` keeps the corpus for later runs):

    python benchmarks/data_loader.py --corpus web --web-data /tmp/mmpt-web --repeats 5 --batches 16 --warmup 2
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import multiprocessing
import os
import platform
import queue
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import torch
from common import REPO, RESULTS, cells, save_results, summary
from PIL import Image

MODEL = str(REPO / "mmpt" / "models" / "bench-vit-tiny.json")
BATCH = 64
CROP = 64
PIXELS = ("float32", "uint8")


def transforms(pixels: str):
    """(image transform, tokenizer): open_clip's training transform, finished as `pixels` says."""
    from open_clip import image_transform
    from torchvision import transforms as T

    from mmpt.data.image_text import uint8_transform
    from mmpt.models.open_clip_model import OpenClipTokenizer

    image = cast(T.Compose, image_transform(CROP, is_train=True))
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
    from webdataset.compat import WebDataset, WebLoader

    from mmpt.data import expand_shards

    image, tokenizer = transforms(pixels)
    dataset = (
        WebDataset(expand_shards(pattern), resampled=True, shardshuffle=False)
        .shuffle(1000)
        .decode("pil")
        .to_tuple("png", "txt")
        .map_tuple(image, TokenizeOne(tokenizer))
        .batched(BATCH)
    )
    return iter(WebLoader(dataset, batch_size=None, num_workers=workers, prefetch_factor=4 if workers else None))


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
    started, batch = time.perf_counter(), None
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


# --corpus web: per-core samples/s on web-like JPEGs at 224 px.

WEB_CROP = 224
WEB_PIPELINES = ("mmpt", "mmpt-full-decode", "open_clip", "plain")


def web_corpus(folder: Path | None, shards: int, per_shard: int) -> tuple[str, dict]:
    """(shard pattern, corpus summary): the corpus in `folder` if written there before, else written now."""
    from web_images import write_corpus

    folder = folder or Path(tempfile.mkdtemp(prefix="mmpt-web-"))
    summary_file = folder / "summary.json"
    if summary_file.exists():
        summary = json.loads(summary_file.read_text())
        return summary.pop("pattern"), summary
    pattern, summary = write_corpus(folder, shards, per_shard)
    summary_file.write_text(json.dumps({**summary, "pattern": pattern}, indent=2))
    return pattern, summary


class FullDecodeResize:
    """The floor: a full PIL decode, a bicubic resize of the whole image to the crop size, uint8 pixels."""

    def __call__(self, data: bytes) -> torch.Tensor:
        from torchvision.transforms.functional import pil_to_tensor

        from mmpt.data.image_text import decode_image

        return pil_to_tensor(decode_image(data).resize((WEB_CROP, WEB_CROP), Image.Resampling.BICUBIC))


def train_transform():
    """open_clip's training transform at the web crop size (a Compose: no timm augmentation asked for)."""
    from open_clip import image_transform
    from torchvision import transforms as T

    return cast(T.Compose, image_transform(WEB_CROP, is_train=True))


def mmpt_web(pattern: str, reduced: bool) -> Iterator:
    """The image-text methods' training batches, with or without the reduced JPEG decode."""
    from mmpt.data import BatchStream, Source, StatefulLoader, StreamSpec
    from mmpt.data.image_text import ImageTextDecoder, training_image_decode, uint8_transform
    from mmpt.models.open_clip_model import OpenClipTokenizer

    image = uint8_transform(train_transform())  # as ImageTextMethod.train_data
    decoder = ImageTextDecoder(
        training_image_decode(image) if reduced else image, OpenClipTokenizer(MODEL), attention_mask=False
    )
    spec = StreamSpec([Source.from_pattern(pattern)], batch_size=BATCH, mode="resampled", num_workers=0, seed=0)
    return iter(StatefulLoader(BatchStream(spec, decoder)))


def open_clip_web(pattern: str) -> Iterator:
    """open_clip_train's training pipeline (`get_wds_dataset`, resampled), built from its own pieces."""
    from open_clip_train import data as oc
    from webdataset.filters import batched, decode, map_dict, rename, select, shuffle, to_tuple
    from webdataset.pipeline import DataPipeline
    from webdataset.tariterators import tarfile_to_samples

    from mmpt.models.open_clip_model import OpenClipTokenizer

    pipeline = DataPipeline(
        oc.ResampledShards2(pattern, deterministic=True),  # it expands the braces itself
        # its tarfile_to_samples_nothrow needs webdataset <= 0.2.86; webdataset's own reader does the same
        tarfile_to_samples(handler=oc.log_and_continue),
        shuffle(bufsize=oc._SAMPLE_SHUFFLE_SIZE, initial=oc._SAMPLE_SHUFFLE_INITIAL),
        select(oc.filter_no_caption_or_no_image),
        decode("pilrgb", handler=oc.log_and_continue),
        rename(image="jpg;png;jpeg;webp", text="txt"),
        map_dict(image=train_transform(), text=TokenizeOne(OpenClipTokenizer(MODEL))),
        to_tuple("image", "text"),
        batched(BATCH, partial=False),
    )
    return iter(pipeline)


def plain_web(pattern: str) -> Iterator:
    """The floor: shards read, each image fully decoded and resized, batched; nothing else."""
    from webdataset.filters import batched, map_tuple, to_tuple
    from webdataset.pipeline import DataPipeline
    from webdataset.shardlists import ResampledShards
    from webdataset.tariterators import tarfile_to_samples

    from mmpt.data import expand_shards

    stages = [ResampledShards(expand_shards(pattern)), tarfile_to_samples(), to_tuple("jpg")]
    return iter(DataPipeline(*stages, map_tuple(FullDecodeResize()), batched(BATCH)))


def web_batches(name: str, pattern: str) -> Iterator:
    """Batches of `name`'s pipeline over the shards, read and decoded in this process."""
    if name in ("mmpt", "mmpt-full-decode"):
        return mmpt_web(pattern, reduced=name == "mmpt")
    return open_clip_web(pattern) if name == "open_clip" else plain_web(pattern)


def rate_on_core(name: str, pattern: str, core: int, warmup: int, count: int, results) -> None:
    """In a child process: pin to `core`, one torch thread, and put `name`'s samples/s on `results`."""
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    results.put(time_loader(web_batches(name, pattern), warmup, count)[0])


def per_core(name: str, pattern: str, core: int, warmup: int, count: int) -> float:
    """Samples/s of one pipeline in a fresh process pinned to `core` (nothing shared with earlier runs)."""
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    process = context.Process(target=rate_on_core, args=(name, pattern, core, warmup, count, results))
    process.start()
    while True:
        try:
            rate = results.get(timeout=5)
        except queue.Empty:
            if not process.is_alive():  # its traceback is on stderr
                raise RuntimeError(f"{name} failed on core {core} (exit code {process.exitcode})") from None
            continue
        process.join()
        return rate


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def web_main(args: argparse.Namespace) -> int:
    import PIL
    import webdataset
    from PIL import features

    sys.path.insert(0, str(Path(__file__).resolve().parent))  # web_images beside this script
    pattern, corpus = web_corpus(args.web_data, args.web_shards, args.web_per_shard)
    core = args.core if args.core is not None else max(os.sched_getaffinity(0))
    print(f"corpus {pattern}: {json.dumps(corpus)}; pinned to core {core}", flush=True)
    results: dict[str, list[float]] = {}
    for repeat in range(args.repeats):
        for name in args.pipelines:
            rate = per_core(name, pattern, core, args.warmup, args.batches)
            results.setdefault(name, []).append(rate)
            print(f"repeat {repeat}: {name}: {rate:.1f} samples/s on one core", flush=True)
    median = {k: statistics.median(v) for k, v in results.items()}
    ratios = {
        f"{a} / {b}": median[a] / median[b]
        for a, b in (("mmpt", "open_clip"), ("mmpt", "plain"), ("mmpt", "mmpt-full-decode"), ("open_clip", "plain"))
        if a in median and b in median
    }
    per_gpu = {
        name: {str(n): rate * (n - 1) for n in args.cores_per_gpu} for name, rate in median.items()
    }  # one core per GPU runs the rank's own process
    record = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{cpu_model()}, {os.cpu_count()} cores",
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "pillow": PIL.__version__,
            "libjpeg_turbo": bool(features.check_feature("libjpeg_turbo")),
            "simplejpeg": importlib.metadata.version("simplejpeg"),  # mmpt's reduced JPEG decode
            "webdataset": getattr(webdataset, "__version__", "?"),
        },
        "corpus": corpus,
        "setup": {"batch": BATCH, "crop": WEB_CROP, "batches": args.batches, "warmup": args.warmup},
        "samples_per_s_per_core": {k: {**summary(v), "runs": v} for k, v in results.items()},
        "ratios": ratios,
        "gpu_rate": args.gpu_rate,
        "per_gpu_8_gpu_node": per_gpu,
    }
    save_results("data_loader_web", record, web_report(record, args.cores_per_gpu), args.out)
    return 0


def web_report(record: dict, cores_per_gpu: list[int]) -> list[str]:
    """The markdown page of a `--corpus web` run."""
    corpus, setup, versions = record["corpus"], record["setup"], record["versions"]
    lines = [
        "# Image-text loading per CPU core on web-like JPEGs: mmpt vs open_clip_train vs a full decode\n",
        f"{record['date']}, {record['machine']}; " + ", ".join(f"{k} {v}" for k, v in versions.items()) + ". "
        f"{corpus['images']} generated JPEGs (`benchmarks/web_images.py`): {corpus['mean_megapixels']:.2f} MP and "
        f"{corpus['mean_kib']:.0f} KiB on average, {corpus['bytes_per_pixel']:.2f} bytes/pixel at q"
        f"{corpus['jpeg_quality']}. Each pipeline in its own process pinned to one core, reading the shards; "
        f"{setup['batches']} batches of {setup['batch']} timed after {setup['warmup']}, alternating; "
        f"{setup['crop']} px. Produced by `benchmarks/data_loader.py --corpus web`.\n",
        "| pipeline | samples/s per core min | median | max |",
        "|---|---|---|---|",
    ]
    for name, s in record["samples_per_s_per_core"].items():
        lines.append(f"| {name} | {cells(s)} |")
    lines += ["", *(f"{k}: **{v:.2f}x**" for k, v in record["ratios"].items()), ""]
    lines += [
        f"Samples/s per GPU on an 8-GPU node with N cores per GPU, one of them running the rank's process and "
        f"N - 1 loading (per-core median x (N - 1), assuming loading scales with cores); one GPU trains about "
        f"{record['gpu_rate']:.0f} samples/s:\n",
        "| pipeline | " + " | ".join(f"N = {n}" for n in cores_per_gpu) + " |",
        "|---|" + "---|" * len(cores_per_gpu),
    ]
    for name, rates in record["per_gpu_8_gpu_node"].items():
        node = (f"{rates[str(n)]:.0f}" + (" ✓" if rates[str(n)] >= record["gpu_rate"] else "") for n in cores_per_gpu)
        lines.append(f"| {name} | " + " | ".join(node) + " |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--corpus", choices=("digits", "web"), default="digits", help="digits: the PNG comparison; web: per core"
    )
    parser.add_argument("--batches", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workers", type=int, nargs="*", default=[1, 2])
    parser.add_argument("--web-data", type=Path, default=None, help="web corpus folder, written if empty")
    parser.add_argument("--web-shards", type=int, default=4)
    parser.add_argument("--web-per-shard", type=int, default=256)
    parser.add_argument("--pipelines", nargs="*", choices=WEB_PIPELINES, default=list(WEB_PIPELINES))
    parser.add_argument("--core", type=int, default=None, help="the core to pin to (default: the last one allowed)")
    parser.add_argument("--cores-per-gpu", type=int, nargs="*", default=[8, 12, 16])
    parser.add_argument("--gpu-rate", type=float, default=3200.0, help="samples/s one GPU trains, to compare with")
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
    if args.corpus == "web":
        return web_main(args)

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
        "samples_per_s": {k: {**summary(v), "runs": v} for k, v in results.items()},
        "ratios": ratios,
    }
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
        lines.append(f"| {key} | {ipc_bytes[key.rsplit(' ', 1)[0]]:.0f} | {cells(s)} |")
    lines.append("")
    if normalize_ms is not None:
        lines.append(
            f"Normalising one uint8 batch ({BATCH}x3x{CROP}x{CROP}) to float32 in the main process on this "
            f"CPU: {normalize_ms:.2f} ms (not in the figures above; on a GPU rank it runs on the device).\n"
        )
    lines += [f"{k}: **{v:.3f}x**" for k, v in ratios.items()]
    save_results("data_loader", record, lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
