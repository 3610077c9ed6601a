"""How fast `mmpt-make-image-text-shards` turns a folder of photo-sized JPEGs into shards, with 1 and 2 processes,
keeping the images as they are and resizing them to a 384-px short side (img2dataset's common setting).

The input: 600 JPEGs of 1024x768 (quality 90, smooth gradients with noise, ~170 KB each, like web photos) with a
caption file beside each, in shards of 100 (processes share the work shard by shard). Each setting runs 3 times into a fresh folder; the table gives pairs/s (median of the
three) and the bytes written. Results: benchmarks/results/make_image_text_shards.{json,md}.

    python benchmarks/make_image_text_shards.py    # ~3 minutes on 2 cores

What carries over: the work is decoding and re-encoding JPEGs (resize) or copying bytes (no resize), per process;
it scales with the cores given to `--processes` until the disk is the limit. On a GPU host, run it before
training, not beside it: the loader needs those cores.
"""

from __future__ import annotations

import io
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from common import REPO, machine_line, save_results
from PIL import Image

PHOTOS, SIZE = 600, (1024, 768)
SHARD = ["--shard-size", "100"]  # processes share the work shard by shard: 6 shards here
SETTINGS = {  # name: extra arguments
    "as they are, 1 process": [*SHARD, "--processes", "1"],
    "as they are, 2 processes": [*SHARD, "--processes", "2"],
    "resized to 384, 1 process": [*SHARD, "--processes", "1", "--resize", "384"],
    "resized to 384, 2 processes": [*SHARD, "--processes", "2", "--resize", "384"],
}


def photos(folder: Path) -> int:
    """PHOTOS JPEGs with captions beside them; returns their bytes."""
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0 : SIZE[1], 0 : SIZE[0]]
    total = 0
    for i in range(PHOTOS):
        base = np.stack([(x * (i % 7 + 1) + y) % 256, (y * (i % 5 + 1)) % 256, (x + y * 2 + 40 * i) % 256], -1)
        pixels = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="JPEG", quality=90)
        (folder / f"{i:04d}.jpg").write_bytes(buffer.getvalue())
        (folder / f"{i:04d}.txt").write_text(f"photo number {i}")
        total += len(buffer.getvalue())
    return total


def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        source = Path(scratch) / "photos"
        source.mkdir()
        size = photos(source)
        for name, extra in SETTINGS.items():
            seconds, written = [], 0
            for repeat in range(3):
                out = Path(scratch) / f"out-{len(rows)}-{repeat}"
                command = [sys.executable, str(REPO / "launch/make_image_text_shards.py"), "--images", str(source)]
                started = time.perf_counter()
                subprocess.run([*command, "--out", str(out), *extra], check=True, capture_output=True, cwd=REPO)
                seconds.append(time.perf_counter() - started)
                written = sum(p.stat().st_size for p in out.glob("*.tar"))
            rows.append({"setting": name, "seconds": seconds, "pairs_per_s": PHOTOS / statistics.median(seconds),
                         "mb_written": written / 1e6})  # fmt: skip
            print(rows[-1], flush=True)
    lines = [
        f"{machine_line('2 cores')}. {PHOTOS} JPEGs of {SIZE[0]}x{SIZE[1]} ({size / 1e6:.0f} MB) with caption files; "
        "median of 3 runs, process start included. Produced by `benchmarks/make_image_text_shards.py`.",
        "",
        "| images | pairs/s | seconds (median) | MB written |",
        "|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['setting']} | {row['pairs_per_s']:.0f} | {statistics.median(row['seconds']):.1f} | "
            f"{row['mb_written']:.0f} |"
        )
    save_results("make_image_text_shards", {"photos": PHOTOS, "size": SIZE, "input_bytes": size, "rows": rows}, lines)


if __name__ == "__main__":
    main()
