"""Captions of a folder of videos, from the annotation files video corpora ship, for packing into shards.

- MSR-VTT's json (`train_val_videodatainfo.json`): `{"sentences": [{"video_id", "caption"}, ...]}`;
- csv with a header naming `video_id` and `sentence` (MSR-VTT's and JSFusion's lists), a row per caption;
- jsonl, a clip per line: `{"video": id or relative path, "caption": text or [texts]}`.

Every format gives {video id: [captions]}; shards hold them as the one caption format VICTOR reads (see
`mmpt.data.video`): a `json` member `{"sentences": [...]}`.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from mmpt.data.shards import DataError, MissingDataError


def read_captions(path: str | Path) -> dict[str, list[str]]:
    """{video id (or path relative to the videos folder): its non-empty captions, in file order}."""
    path = Path(path)
    if not path.is_file():
        raise MissingDataError(f"{path}: no such captions file")
    grouped: dict[str, list[str]] = {}

    def add(video: object, captions: object, where: str) -> None:
        texts = captions if isinstance(captions, list) else [captions]
        strings = [t for t in texts if isinstance(t, str)]
        if not isinstance(video, str) or not video or len(strings) != len(texts):
            raise DataError(f"{where}: expected a video id and caption text(s), got {video!r}: {captions!r}")
        grouped.setdefault(video, []).extend(t.strip() for t in strings if t.strip())

    try:
        if path.suffix == ".csv":
            with path.open(newline="", encoding="utf-8") as handle:
                reader = csv.DictReader(handle)
                if not reader.fieldnames or not {"video_id", "sentence"} <= set(reader.fieldnames):
                    raise DataError(
                        f"{path}: expected a header with columns video_id,sentence; got {reader.fieldnames}"
                    )
                for number, row in enumerate(reader, 2):
                    add(row["video_id"], row["sentence"], f"{path}:{number}")
        elif path.suffix == ".json":
            data = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(data, dict) or not isinstance(data.get("sentences"), list):
                raise DataError(f'{path}: expected MSR-VTT\'s {{"sentences": [{{"video_id", "caption"}}, ...]}}')
            for index, record in enumerate(data["sentences"]):
                add(record.get("video_id"), record.get("caption"), f"{path}: sentences[{index}]")
        else:
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if line.strip():
                    record = json.loads(line)
                    add(record.get("video"), record.get("caption"), f"{path}:{number}")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as exc:
        raise DataError(f"{path}: cannot read captions ({type(exc).__name__}: {exc})") from None
    captioned = {video: texts for video, texts in grouped.items() if texts}
    if not captioned:
        raise DataError(f"{path}: no captions")
    return captioned
