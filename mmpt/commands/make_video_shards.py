"""Pack a folder of videos and their captions into VICTOR training shards.

    python launch/make_video_shards.py --videos msrvtt/videos --captions msrvtt/train_val_videodatainfo.json \
        --out shards/msrvtt/train

--captions: MSR-VTT's json ({"sentences": [{"video_id", "caption"}]}), a csv with video_id,sentence columns,
or jsonl ({"video": id or relative path, "caption": text or [texts]} per line). A video id is found as
<videos>/<id>.mp4 (.webm, .avi) or as the relative path itself. Each clip becomes one sample: its video
bytes and a json member {"sentences": [...]}, the caption format VICTOR reads. Writes <out>-NNNNNN.tar and
sizes.json; captions whose video is missing are reported and skipped.

Exit 2 for a missing folder or captions file; exit 3 when more than --max-skip-rate of the captioned videos
are missing (the shards are written, to look at).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from mmpt.commands import installed

VIDEO_SUFFIXES = (".mp4", ".webm", ".avi")


def find_video(folder: Path, video: str) -> Path | None:
    candidates = [folder / video, *(folder / f"{video}{suffix}" for suffix in VIDEO_SUFFIXES)]
    return next((path for path in candidates if path.is_file() and path.suffix in VIDEO_SUFFIXES), None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--videos", required=True, help="folder of the video files")
    parser.add_argument("--captions", required=True, help="MSR-VTT json, video_id,sentence csv, or jsonl")
    parser.add_argument("--out", required=True, help="shard prefix, e.g. shards/msrvtt/train")
    parser.add_argument("--shard-size", type=int, default=1000)
    parser.add_argument(
        "--max-skip-rate",
        type=float,
        default=0.01,
        help="fail (exit 3) when more than this fraction of the captioned videos are missing",
    )
    args = parser.parse_args(argv)

    from mmpt.data.shards import DataError, MissingDataError
    from mmpt.data.video import write_video_shards
    from mmpt.data.video_captions import read_captions

    folder = Path(args.videos)
    if not folder.is_dir():
        raise MissingDataError(f"--videos {folder}: no such folder")
    captions = read_captions(args.captions)
    missing: list[str] = []

    def samples():
        for video, texts in captions.items():
            path = find_video(folder, video)
            if path is None:
                missing.append(video)
                continue
            key = re.sub(r"[^A-Za-z0-9_-]", "_", str(Path(video).with_suffix("")))  # no dots in tar keys
            yield {"__key__": key, path.suffix[1:]: path.read_bytes(), "json": {"sentences": texts}}

    sizes = write_video_shards(samples(), args.out, shard_size=args.shard_size)
    written = sum(sizes.values())
    print(
        f"wrote {written} clips ({sum(len(captions[v]) for v in captions if v not in missing)} captions) into "
        f"{len(sizes)} shard(s) at {args.out}-*.tar; {len(missing)} captioned video(s) not found"
    )
    for video in missing[:20]:
        print(f"missing: {video} (looked for {folder / video}.mp4, .webm, .avi)", file=sys.stderr)
    if missing and len(missing) > args.max_skip_rate * len(captions):
        raise DataError(
            f"{len(missing)} of {len(captions)} captioned videos are not in {folder} "
            f"(e.g. {missing[0]!r}), more than --max-skip-rate={args.max_skip_rate}"
        )
    return 0


run = installed(main)
