"""Video frames decoded at the model's size against a full-size decode, per CPU core.

VICTOR's loader takes T frames of a clip and resizes their shorter side to the model's image size before a
centre crop (`data.video.ResizeCenterCrop`). Decoded at full size, each frame is converted to a full-size RGB
array that the resize then throws most of away. With `short_side`, FFmpeg scales each frame while it converts
it to RGB (decord's scale filter, PyAV's swscale), and only the crop is left to do. The H.264 decoding itself
is the same work either way: what is saved is the full-size colour conversion and the resize.

Clips: `--clips` clips panning across scikit-learn's two sample photographs (texture a decoder pays for),
H.264 yuv420p, `--frames` frames at each `--sizes` resolution. A pass decodes the 8 evaluation frames of
every clip (the middle of 8 equal segments) and crops them to 224 px, both ways and with both backends,
alternating, `--repeats` times after one untimed pass, in this process pinned to one core.
Results: benchmarks/results/video_at_size.{json,md}.

    python benchmarks/video_at_size.py        # ~3 minutes on an idle core
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
from common import cells, machine_line, save_results, summary

SAMPLED_FRAMES = 8
IMAGE_SIZE = 224


def panning_clips(count: int, frames: int, width: int, height: int) -> list[bytes]:
    from PIL import Image
    from sklearn.datasets import load_sample_images

    from mmpt.demo.moving_digits import encode_mp4

    photos = load_sample_images().images
    clips = []
    for index in range(count):
        step = 2 + index % 3
        photo = Image.fromarray(photos[index % len(photos)])
        pixels = np.asarray(photo.resize((width + step * frames, height + step * frames), Image.BICUBIC))
        clip = np.stack([pixels[step * i : step * i + height, step * i : step * i + width] for i in range(frames)])
        clips.append(encode_mp4(clip))
    return clips


def one_pass(clips: list[bytes], backend: str, at_size: bool) -> float:
    from mmpt.data.video import ResizeCenterCrop, decode_frames, frame_indices

    crop = ResizeCenterCrop(IMAGE_SIZE)
    short_side = IMAGE_SIZE if at_size else None
    started = time.perf_counter()
    for data in clips:
        crop(decode_frames(data, lambda n: frame_indices(n, SAMPLED_FRAMES, train=False), backend, 1, short_side))
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clips", type=int, default=16)
    parser.add_argument("--frames", type=int, default=32, help="frames per clip (8 are sampled)")
    parser.add_argument("--sizes", nargs="+", default=["1280x720", "640x360"])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    import torch

    from mmpt.data.video import BACKENDS

    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    torch.set_num_threads(1)
    rows = []
    for size in args.sizes:
        width, height = (int(v) for v in size.split("x"))
        clips = panning_clips(args.clips, args.frames, width, height)
        ways = [(backend, at_size) for backend in BACKENDS for at_size in (False, True)]
        for backend, at_size in ways:  # warm-up, untimed
            one_pass(clips, backend, at_size)
        times: dict[tuple[str, bool], list[float]] = {way: [] for way in ways}
        for _ in range(args.repeats):
            for way in ways:
                times[way].append(one_pass(clips, *way))
        for backend in BACKENDS:
            full, scaled = times[backend, False], times[backend, True]
            rows.append(
                {
                    "size": size,
                    "backend": backend,
                    "mean_clip_kib": sum(map(len, clips)) / len(clips) / 1024,
                    "full_decode_frames_per_s": summary([SAMPLED_FRAMES * args.clips / t for t in full]),
                    "at_size_frames_per_s": summary([SAMPLED_FRAMES * args.clips / t for t in scaled]),
                    "speedup": statistics.median(full) / statistics.median(scaled),
                    "full_seconds": full,
                    "at_size_seconds": scaled,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    write_results(rows, args)


def write_results(rows: list[dict], args) -> None:
    import av
    import decord

    machine = machine_line(f"one core of {os.cpu_count()}", decord=decord.__version__, PyAV=av.__version__)
    lines = [
        "# Video frames decoded at the model's size vs a full-size decode, per core",
        "",
        f"{machine}. {args.clips} clips panning across photographs, {args.frames} frames each (H.264, yuv420p); "
        f"{SAMPLED_FRAMES} frames decoded per clip and centre-cropped to {IMAGE_SIZE} px; {args.repeats} runs "
        "each after a warm-up, alternating. Produced by `benchmarks/video_at_size.py`.",
        "",
        "| clip size | backend | mean clip KiB | full decode frames/s min | median | max "
        "| at size frames/s min | median | max | speed-up (medians) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        full, scaled = r["full_decode_frames_per_s"], r["at_size_frames_per_s"]
        lines.append(
            f"| {r['size']} | {r['backend']} | {r['mean_clip_kib']:.0f} | {cells(full)} | {cells(scaled)} | "
            f"{r['speedup']:.2f}x |"
        )
    lines += [
        "",
        f"Clips of {SAMPLED_FRAMES} frames per second per GPU on an 8-GPU node with N cores per GPU, one of them "
        "running the rank and N - 1 loading (the at-size median per core / 8 frames x (N - 1)):",
        "",
        "| clip size | backend | N = 8 | N = 12 | N = 16 |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        per_core = r["at_size_frames_per_s"]["median"] / SAMPLED_FRAMES
        lines.append(
            f"| {r['size']} | {r['backend']} | " + " | ".join(f"{per_core * (n - 1):.0f}" for n in (8, 12, 16)) + " |"
        )
    save_results("video_at_size", {"machine": machine, "args": vars(args), "rows": rows}, lines)


if __name__ == "__main__":
    main()
