"""Zero-shot text-to-video and video-to-text retrieval with the pooled unimodal features.

Annotation files:
- jsonl, one clip per line: `{"video": path, "caption": [text, ...]}` (paths relative to the file's folder);
- csv with a header naming `video_id` and `sentence` (MSR-VTT style: the 1k-A test list of JSFusion,
  `MSRVTT_JSFUSION_test.csv` with `key,vid_key,video_id,sentence`), one row per caption;
  clip `<video_id>` is looked up as `<video_root>/<video_id>.{mp4,webm,avi}` (default root: `videos/`
  beside the file);
- json: DiDeMo's annotation list, as paragraph-to-video retrieval (each video's descriptions joined).

Metrics (MSR-VTT protocol: every text query ranks all clips): `video_retrieval_recall@{1,5,10}`,
`video_retrieval_median_rank`, `video_retrieval_mean_rank` (text -> video), the same with `text_`
(video -> text; a clip is found by the best-ranked of its captions), and `mean_recall`. Ranks start at 1.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from mmpt.data.shards import DataError, MissingDataError
from mmpt.eval.retrieval import encode_files, encode_texts, retrieval_ranks
from mmpt.eval.retrieval_formats import load_retrieval_set

VIDEO_SUFFIXES = (".mp4", ".webm", ".avi")


def _find_video(file: Path, listing: Path, *elsewhere: Path) -> Path:
    """`file` (else each of `elsewhere`), or it with a video suffix added: a listing may name a clip by its id."""
    for place in (file, *elsewhere):
        for candidate in (place, *(place.with_name(place.name + suffix) for suffix in VIDEO_SUFFIXES)):
            if candidate.is_file():
                return candidate
    raise DataError(f"{listing}: video {file} not found (also tried it with {', '.join(VIDEO_SUFFIXES)})")


def _csv(path: Path, video_root: Path | None) -> tuple[list[Path], list[list[str]]]:
    root = video_root or path.parent / "videos"
    grouped: dict[str, list[str]] = {}
    with open(path, encoding="utf-8", newline="") as handle:
        reader = csv.DictReader(handle)
        if not reader.fieldnames or not {"video_id", "sentence"} <= set(reader.fieldnames):
            raise DataError(f"{path}: expected a header with columns video_id,sentence; got {reader.fieldnames}")
        for number, row in enumerate(reader, start=2):
            if not row["video_id"] or not row["sentence"]:
                raise DataError(f"{path}:{number}: empty video_id or sentence")
            grouped.setdefault(row["video_id"], []).append(row["sentence"])
    return [_find_video(root / video_id, path) for video_id in grouped], list(grouped.values())


def _didemo(path: Path, root: Path) -> tuple[list[Path], list[list[str]]]:
    """DiDeMo's annotation list (`{"video", "description", ...}` per moment), read as paragraph-to-video
    retrieval: a video's descriptions joined in file order into one query, as the field evaluates it."""
    try:
        records = json.loads(path.read_text(encoding="utf-8"))
        grouped: dict[str, list[str]] = {}
        for record in records:
            grouped.setdefault(record["video"], []).append(record["description"].strip())
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise DataError(
            f'{path}: expected DiDeMo\'s list of {{"video", "description"}} ({type(exc).__name__}: {exc})'
        ) from None
    videos = [root / name if (root / name).is_file() else _find_video(root / Path(name).stem, path) for name in grouped]
    return videos, [[" ".join(sentences)] for sentences in grouped.values()]


def load_video_retrieval_set(
    path: str | os.PathLike, video_root: str | os.PathLike | None = None
) -> tuple[list[Path], list[list[str]]]:
    """(video files, captions of each) from a jsonl, an MSR-VTT-style csv or DiDeMo's json. A jsonl's relative paths
    and ids are found beside it, else under `video_root`; a csv's and a json's under `video_root` (default: the
    `videos/` folder beside them)."""
    path = Path(path)
    if not path.is_file():
        raise MissingDataError(f"retrieval annotation file {path} does not exist")
    if path.suffix == ".json":
        return _didemo(path, Path(video_root) if video_root else path.parent / "videos")
    if path.suffix != ".csv":
        videos, captions = load_retrieval_set(path, media="video")  # relative to the jsonl's folder
        under_root = [
            Path(video_root) / v.relative_to(path.parent) if video_root and v.is_relative_to(path.parent) else v
            for v in videos
        ]
        return [_find_video(v, path, r) for v, r in zip(videos, under_root)], captions
    videos, captions = _csv(path, Path(video_root) if video_root else None)
    if not videos:
        raise DataError(f"{path}: no records")
    return videos, captions


def video_rank_metrics(video_features: torch.Tensor, text_features: torch.Tensor, text_to_video: torch.Tensor) -> dict:
    video_rank, text_rank = retrieval_ranks(video_features.float() @ text_features.float().T, text_to_video)
    metrics: dict[str, float] = {}
    for name, ranks in (("video_retrieval", video_rank + 1), ("text_retrieval", text_rank + 1)):
        for k in (1, 5, 10):
            metrics[f"{name}_recall@{k}"] = (ranks <= k).float().mean().item()
        metrics[f"{name}_median_rank"] = ranks.float().quantile(0.5).item()  # as np.median: mean of the middle two
        metrics[f"{name}_mean_rank"] = ranks.float().mean().item()
    recalls = [v for k, v in metrics.items() if "recall@" in k]
    metrics["mean_recall"] = sum(recalls) / len(recalls)
    return metrics


def video_encoder(model, device: str | torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """A batch of clips to fp32 features: float clips (normalised frames or features) in the model's dtype, uint8
    frames as they are (the model normalises them)."""
    dtype = next(model.parameters()).dtype

    def encode(clips: torch.Tensor) -> torch.Tensor:
        clips = clips.to(device, dtype if clips.is_floating_point() else None)
        return model.encode_video(clips).float()

    return encode


@torch.no_grad()
def video_retrieval(
    model,
    tokenize: Callable,
    decode_video: Callable[[bytes], torch.Tensor],
    path: str | os.PathLike,
    batch_size: int = 64,
    device: str | torch.device = "cpu",
    video_root: str | os.PathLike | None = None,
) -> dict:
    """Retrieval metrics of `model` (`encode_video`, `encode_text`) on an annotation file.

    `decode_video(bytes)` gives one clip's model input (frames [T, C, H, W]), e.g. an evaluation-mode
    `VideoTextDecoder.decode_video`; an unreadable clip is an error naming the file (evaluation sets are
    fixed, so skipping one would change the benchmark).
    """
    model.eval()
    videos, captions = load_video_retrieval_set(path, video_root)
    texts = [t for group in captions for t in group]
    text_to_video = torch.tensor([i for i, group in enumerate(captions) for _ in group])
    encode = video_encoder(model, device)
    video_features = encode_files(videos, decode_video, encode, batch_size, "video", (OSError, ValueError))
    text_features, rows = encode_texts(model, tokenize, texts, batch_size, device)
    return video_rank_metrics(F.normalize(video_features, dim=-1), text_features[rows], text_to_video)
