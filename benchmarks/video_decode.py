"""Video decoding: decord vs PyAV frames/s on the same clips, and what mmpt's video loader adds on top.

Clips: moving-digits clips rendered at `--size` px, `--frames` frames each, H.264 mp4 (the demo
corpus's renderer and encoder), packed into WebDataset shards with one caption each.

1. Raw decode: for each clip and backend, `data.video.decode_frames` of the 8 evaluation frames (the
   middle of 8 equal segments), nothing else; frames/s = 8 x clips / seconds.
2. Loader: `BatchStream` + `StatefulLoader` with `VideoTextDecoder` as the victor method uses it (read
   the tar, sample 8 frames, decode, resize and centre-crop them as uint8 (`ResizeCenterCrop`; the model
   normalises on the accelerator), tokenize the caption, batch 16) in the main process
   (`num_workers=0`, so one core does all of it, like the raw loop); video samples/s.
The loader's overhead is (loader seconds per clip) / (raw decode seconds per clip) - 1 with the same
backend. After one untimed warm-up pass, each measurement repeats `--repeats` times, alternating; min / median / max are reported.
Results: benchmarks/results/video_decode.{json,md}.

    python benchmarks/video_decode.py          # ~2 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from common import cells, machine_line, save_results, summary

SAMPLED_FRAMES = 8
BATCH = 16


def make_clips(root: Path, count: int, frames: int, size: int) -> tuple[list[bytes], str]:
    """`count` moving-digit clips at `size` px, written to shards under `root`; (mp4 bytes, shard pattern)."""
    from sklearn.datasets import load_digits

    from mmpt.data.video import write_video_shards
    from mmpt.demo.moving_digits import DIRECTIONS, _render, encode_mp4

    digits, rng = load_digits(), random.Random(0)
    clips = []
    for index in range(count):
        clip = {"kind": "move", "digits": [index % 10], "direction": list(DIRECTIONS)[index % len(DIRECTIONS)]}
        scan = digits.images[rng.choice(np.flatnonzero(digits.target == index % 10).tolist())]
        clips.append(encode_mp4(_render(clip, [scan], frames, size, rng)))
    write_video_shards(
        (
            {"__key__": f"clip-{i:05d}", "mp4": data, "txt": f"the digit {i % 10} moves."}
            for i, data in enumerate(clips)
        ),
        str(root / "clips"),
        shard_size=max(1, count // 4),
    )
    return clips, str(root / "clips-{000000..000003}.tar")


def raw_decode(clips: list[bytes], backend: str) -> float:
    from mmpt.data.video import decode_frames, frame_indices

    started = time.perf_counter()
    for data in clips:
        decode_frames(data, lambda n: frame_indices(n, SAMPLED_FRAMES, train=False), backend)
    return time.perf_counter() - started


def loader_pass(pattern: str, count: int, backend: str, image_size: int, tokenizer_path: Path) -> float:
    from mmpt.data import BatchStream, Source, StatefulLoader, StreamSpec
    from mmpt.data.tokenizer import TextTokenizer
    from mmpt.data.video import ResizeCenterCrop, VideoTextDecoder

    # as the victor method loads: uint8 frames resized and centre-cropped, normalised later on the accelerator
    decoder = VideoTextDecoder(
        SAMPLED_FRAMES,
        None,
        TextTokenizer(tokenizer_path, 16),
        backend=backend,
        train=False,
        clip_transform=ResizeCenterCrop(image_size),
    )
    spec = StreamSpec(
        [Source.from_pattern(pattern)], batch_size=BATCH, mode="epoch", shuffle_buffer=0, num_workers=0, max_epochs=1
    )
    started = time.perf_counter()
    seen = sum(batch["frames"].shape[0] for batch in StatefulLoader(BatchStream(spec, decoder)))
    elapsed = time.perf_counter() - started
    if seen != count // BATCH * BATCH:
        raise RuntimeError(f"loader produced {seen} clips, expected {count // BATCH * BATCH}")
    return elapsed * count / seen  # seconds for `count` clips at the measured rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clips", type=int, default=128)
    parser.add_argument("--frames", type=int, default=64, help="frames per clip (8 are sampled)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 224])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--image-size", type=int, default=224, help="largest frame size the loader gives (smaller clips keep theirs)"
    )
    args = parser.parse_args()
    import torch

    from mmpt.data.tokenizer import train_wordpiece
    from mmpt.data.video import BACKENDS

    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = Path(tmp) / "tokenizer.json"
        train_wordpiece([f"the digit {d} moves." for d in range(10)], tokenizer, vocab_size=100)
        for size in args.sizes:
            root = Path(tmp) / str(size)
            root.mkdir()
            clips, pattern = make_clips(root, args.clips, args.frames, size)
            times: dict[tuple[str, str], list[float]] = {}
            for backend in BACKENDS:  # warm-up, untimed: first imports and decoder set-up
                loader_pass(pattern, args.clips, backend, min(size, args.image_size), tokenizer)
            for _ in range(args.repeats):
                for backend in BACKENDS:
                    times.setdefault(("raw", backend), []).append(raw_decode(clips, backend))
                    times.setdefault(("loader", backend), []).append(
                        loader_pass(pattern, args.clips, backend, min(size, args.image_size), tokenizer)
                    )
            for backend in BACKENDS:
                raw, loader = times["raw", backend], times["loader", backend]
                rows.append(
                    {
                        "size": size,
                        "backend": backend,
                        "clips": args.clips,
                        "frames_per_clip": args.frames,
                        "raw_frames_per_s": summary([SAMPLED_FRAMES * args.clips / t for t in raw]),
                        "loader_clips_per_s": summary([args.clips / t for t in loader]),
                        "loader_overhead": statistics.median(loader) / statistics.median(raw) - 1,
                        "raw_seconds": raw,
                        "loader_seconds": loader,
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
    write_results(rows, args)


def write_results(rows: list[dict], args) -> None:
    import av

    try:
        import decord

        decord_version = decord.__version__
    except ImportError:
        decord_version = "not installed"
    machine = machine_line(f"{len(os.sched_getaffinity(0))} cores", decord=decord_version, PyAV=av.__version__)
    lines = [
        f"{machine}. {args.clips} clips of {args.frames} frames (H.264, yuv420p), {SAMPLED_FRAMES} frames "
        f"sampled per clip, {args.repeats} runs each (alternating), one core. Produced by `benchmarks/video_decode.py`.",
        "",
        "| clip size | backend | raw decode frames/s min | median | max | loader clips/s min | median | max "
        "| loader overhead over raw decode |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        raw, loader = r["raw_frames_per_s"], r["loader_clips_per_s"]
        lines.append(
            f"| {r['size']}x{r['size']} | {r['backend']} | {cells(raw)} | {cells(loader, 1)} | "
            f"{100 * r['loader_overhead']:+.1f}% |"
        )
    save_results("video_decode", {"machine": machine, "args": vars(args), "rows": rows}, lines)


if __name__ == "__main__":
    main()
