"""Pack local image-caption pairs into training shards that mmpt and open_clip read as img2dataset output.

    python launch/make_image_text_shards.py --images photos/ --out shards/photos          # photo.jpg + photo.txt
    python launch/make_image_text_shards.py --table pairs.csv --image-column path \\
        --caption-columns caption,caption_zh --out shards/pairs --resize 384
    python launch/make_image_text_shards.py --cn-clip MUGE/train_imgs.tsv MUGE/train_texts.jsonl --out shards/muge

Writes <out>/00000.tar, 00001.tar, ... each sample <key>.jpg, <key>.txt (the first caption column, or the
first one the row fills) and <key>.json (key, every caption column the row fills, source, sizes, status), with
<shard>_stats.json beside each shard, as img2dataset does. --resize N shrinks images whose shorter side is longer
than N to N (aspect kept; img2dataset's keep_ratio), so training decodes less. Shards are made in parallel
(--processes); a shard is finished once its _stats.json exists: an interrupted run, started again, keeps those and
makes the rest, the same shards as one run.

Pairs that cannot be used are skipped and counted by reason (missing image, unreadable image, no caption);
each shard's _stats.json names them (`skipped_pairs`: source and reason).
Exit 2 for a missing input or column; exit 3 when more than --max-skip-rate of the pairs were skipped (the
shards are written, to look at).
"""

from __future__ import annotations

import argparse
import io
import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

from mmpt.commands import installed

KEY_DIGITS = 4  # a sample's key: its shard's 5 digits, then its index in the shard (img2dataset's layout)


def shard_name(index: int) -> str:
    return f"{index:05d}"


def jpeg_of(data: bytes, resize: int | None) -> tuple[bytes, dict[str, int]]:
    """The image as JPEG bytes (the original file where it is a JPEG needing no resize) and its sizes; raises
    on an image PIL cannot decode."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        width, height = image.size
        sizes = {"original_width": width, "original_height": height}
        scale = resize / min(width, height) if resize is not None and min(width, height) > resize else 1.0
        target = (max(1, round(width * scale)), max(1, round(height * scale)))
        kept = image.format == "JPEG" and image.mode == "RGB" and scale == 1.0
        # A JPEG decodes at the smallest DCT scale still covering what is needed (1/8 where the bytes are kept: the
        # whole stream is still read, so damage is still found), several times faster than at full size.
        image.draft(None, (1, 1) if kept else target)
        image.load()
        if kept:
            return data, {**sizes, "width": width, "height": height}
        rgb = image.convert("RGB")
        if rgb.size != target:
            rgb = rgb.resize(target, Image.Resampling.BICUBIC)
        out = io.BytesIO()
        rgb.save(out, format="JPEG", quality=95)
        return out.getvalue(), {**sizes, "width": rgb.width, "height": rgb.height}


def write_shard(task: tuple[int, list[Any], Path, int | None]) -> dict[str, Any]:
    """Write shard `index` of `pairs` (a temporary name, renamed when complete) and its _stats.json; returns the
    stats. Runs in a worker process."""
    from webdataset.writer import TarWriter

    index, pairs, out, resize = task
    name = shard_name(index)
    skipped: list[dict[str, str]] = []  # {"source", "reason"} of each pair left out, in order
    written = 0
    partial = out / f"{name}.tar.partial"
    with TarWriter(str(partial), mtime=0) as tar:  # mtime fixed: the same pairs give byte-identical shards
        for position, pair in enumerate(pairs):
            captions = {column: text for column, text in pair.captions.items() if text}
            if not captions:
                skipped.append({"source": pair.source, "reason": "no_caption"})
                continue
            try:
                if pair.offset == -1:
                    raise FileNotFoundError(pair.source)
                data = pair.image_bytes()
            except OSError:
                skipped.append({"source": pair.source, "reason": "missing_image"})
                continue
            except ValueError:  # a tsv line whose base64 is damaged
                skipped.append({"source": pair.source, "reason": "unreadable_image"})
                continue
            try:
                image, sizes = jpeg_of(data, resize)
            except Exception:  # PIL raises several kinds for damaged or non-image bytes
                skipped.append({"source": pair.source, "reason": "unreadable_image"})
                continue
            key = f"{name}{position:0{KEY_DIGITS}d}"
            first = next(iter(captions.values()))
            record = {
                "key": key,
                # img2dataset's "caption" is the .txt, unless a caption column of that name is empty in this row
                **({} if "caption" in pair.captions else {"caption": first}),
                **captions,
                "source": pair.source,
                **sizes,
                "status": "success",
            }
            tar.write({"__key__": key, "jpg": image, "txt": first, "json": json.dumps(record, ensure_ascii=False)})
            written += 1
    os.replace(partial, out / f"{name}.tar")
    reasons = Counter(pair["reason"] for pair in skipped)
    stats = {"count": len(pairs), "successes": written, "failed": len(skipped), "skipped": dict(reasons)}
    stats["skipped_pairs"] = skipped
    (out / f"{name}_stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    return stats


def read_pairs(args: argparse.Namespace) -> list[Any]:
    from mmpt.data.pairs import cn_clip_pairs, folder_pairs, table_pairs
    from mmpt.data.shards import MissingDataError

    if args.images:
        return folder_pairs(Path(args.images))
    if args.table:
        if not args.image_column or not args.caption_columns:
            raise MissingDataError("--table needs --image-column and --caption-columns")
        columns = [c.strip() for c in args.caption_columns.split(",") if c.strip()]
        root = Path(args.images_root) if args.images_root else None
        return table_pairs(Path(args.table), args.image_column, columns, root, args.encoding)
    return cn_clip_pairs(Path(args.cn_clip[0]), Path(args.cn_clip[1]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--images", help="a folder of images, each with its caption in <stem>.txt beside it")
    source.add_argument("--table", help="a .csv, .tsv, .jsonl or .parquet table of image paths and captions")
    source.add_argument("--cn-clip", nargs=2, metavar=("IMGS_TSV", "TEXTS_JSONL"), help="Chinese-CLIP's layout")
    parser.add_argument("--image-column", help="with --table: the column of image paths")
    parser.add_argument("--caption-columns", help="with --table: caption columns, comma-separated (first: .txt)")
    parser.add_argument("--images-root", help="with --table: image paths are relative to this (default: its folder)")
    parser.add_argument("--encoding", default="utf-8", help="with --table: its text encoding (e.g. gb18030)")
    parser.add_argument("--out", required=True, help="folder of the shards")
    parser.add_argument("--shard-size", type=int, default=10_000, help="pairs per shard (at most 10000)")
    parser.add_argument("--resize", type=int, default=None, help="shrink images to this shorter side (pixels)")
    parser.add_argument("--processes", type=int, default=os.cpu_count() or 1, help="worker processes")
    parser.add_argument(
        "--max-skip-rate", type=float, default=0.01, help="exit 3 when more than this fraction of pairs is skipped"
    )
    args = parser.parse_args(argv)
    if not 0 < args.shard_size <= 10**KEY_DIGITS:
        parser.error(f"--shard-size must be between 1 and {10**KEY_DIGITS}")

    from multiprocessing import get_context

    from tqdm import tqdm

    from mmpt.data.shards import DataError, MissingDataError

    pairs = read_pairs(args)
    if not pairs:
        raise MissingDataError("no image-caption pairs found in the input")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    chunks = [pairs[i : i + args.shard_size] for i in range(0, len(pairs), args.shard_size)]
    done = {
        i: json.loads((out / f"{shard_name(i)}_stats.json").read_text())
        for i in range(len(chunks))
        if (out / f"{shard_name(i)}_stats.json").is_file() and (out / f"{shard_name(i)}.tar").is_file()
    }
    todo = [(i, chunk, out, args.resize) for i, chunk in enumerate(chunks) if i not in done]
    stats = list(done.values())
    workers = max(1, min(args.processes, len(todo)))
    if workers == 1:  # no process to start for one shard or one worker
        stats += [write_shard(task) for task in tqdm(todo, desc="shards", unit="shard")]
    else:
        with get_context("spawn").Pool(workers) as pool:
            stats += list(tqdm(pool.imap_unordered(write_shard, todo), total=len(todo), desc="shards", unit="shard"))
    skipped: Counter[str] = Counter()
    for shard in stats:
        skipped.update(shard["skipped"])
    written = sum(s["successes"] for s in stats)
    reasons = ", ".join(f"{n} {reason.replace('_', ' ')}" for reason, n in sorted(skipped.items())) or "none"
    kept = f" ({len(done)} kept from an earlier run)" if done else ""
    print(f"wrote {written} of {len(pairs)} pairs into {len(chunks)} shard(s) at {out}{kept}; skipped: {reasons}")
    named = [pair for shard in stats for pair in shard.get("skipped_pairs", [])]
    first = f"; the first: {named[0]['source']} ({named[0]['reason'].replace('_', ' ')})" if named else ""
    if skipped:
        print(f"each skipped pair is named in {out}/*_stats.json (skipped_pairs){first}")
    if sum(skipped.values()) > args.max_skip_rate * len(pairs):
        raise DataError(
            f"{sum(skipped.values())} of {len(pairs)} pairs skipped ({reasons}), more than --max-skip-rate="
            f"{args.max_skip_rate}{first}; each is named in {out}/*_stats.json"
        )
    return 0


run = installed(main)
