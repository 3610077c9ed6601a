"""Zero-shot image-text retrieval over the official M²-Encoder jsonl layout.

Each line: `{"image": path, "caption": [text, ...]}` (image paths relative to the jsonl's folder
unless absolute), or a CLIP_benchmark webdataset retrieval folder. Reports recall@1/5/10 in both directions and their mean, CLIP_benchmark style:
`text_retrieval_recall@k` (image -> text), `image_retrieval_recall@k` (text -> image), `mean_recall`.
Ranks count ties against the query (`RANK_TIES`), and the results say so.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from mmpt.data.image_text import IMAGE_FIELDS, decode_image, decode_text, pick_field
from mmpt.data.shards import DataError
from mmpt.data.stream import read_shard


@dataclass(frozen=True)
class ShardImage:
    """An image read from a shard, with what `Path` offers the evaluation: its bytes and a name."""

    data: bytes
    name: str

    def read_bytes(self) -> bytes:
        return self.data

    def __str__(self) -> str:
        return self.name


def load_retrieval_set(path: str | os.PathLike, media: str = "image") -> tuple[list[Any], list[list[str]]]:
    """(images, captions of each): from `{"<media>": path, "caption": [...]}` lines (relative paths from the
    file's folder), or from a CLIP_benchmark retrieval folder (`dataset_type.txt`, `test/*.tar` of an
    image and a `txt` of one caption per line)."""
    path = Path(path)
    if path.is_dir():
        return _load_wds_retrieval(path)
    files, captions = [], []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            file, texts = record[media], record["caption"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise DataError(f"{path}:{number}: expected {{\"{media}\": path, \"caption\": [...]}} ({exc})") from None
        texts = [texts] if isinstance(texts, str) else list(texts)
        if not texts:
            raise DataError(f"{path}:{number}: no captions")
        files.append(Path(file) if os.path.isabs(file) else path.parent / file)
        captions.append(texts)
    if not files:
        raise DataError(f"{path}: no records")
    return files, captions


def _load_wds_retrieval(folder: Path, split: str = "test") -> tuple[list[ShardImage], list[list[str]]]:
    kind = folder / "dataset_type.txt"
    if not kind.exists() or kind.read_text().strip().lower() != "retrieval":
        raise DataError(f"{folder}: a retrieval folder needs dataset_type.txt saying 'retrieval' (CLIP_benchmark's layout)")
    shards = sorted((folder / split).glob("*.tar"), key=lambda p: (len(p.stem), p.stem))  # 0, 1, ..., 10
    if not shards:
        raise DataError(f"{folder}: no {split}/*.tar shards")
    images, captions = [], []
    for shard in shards:
        for _, sample in read_shard(str(shard)):
            sample["__shard__"] = shard
            name = f"{shard}:{sample['__key__']}"
            texts = [t.strip() for t in decode_text(pick_field(sample, ("txt",), "caption")).splitlines() if t.strip()]
            if not texts:
                raise DataError(f"retrieval sample {name}: no captions")
            images.append(ShardImage(pick_field(sample, IMAGE_FIELDS, "image"), name))
            captions.append(texts)
    return images, captions


def official_caption_normalization(text: str) -> str:
    """What the official retrieval evaluation does to captions: lower-case, straighten double quotes."""
    return text.lower().replace("“", '"').replace("”", '"')


RANK_TIES = "pessimistic: every other candidate scoring at least as high as the query's match ranks before it"


def retrieval_ranks(scores: torch.Tensor, text_to_item: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """0-based ranks from a score matrix [items, texts]: (rank of each text's own item among all items,
    best rank of each item's own texts among all texts).

    Ties count against the query (`RANK_TIES`): a caption of another image that scores the same as
    the image's own caption, as identical captions do, ranks before it. Counting only strictly
    higher scores would let every set with repeated captions ("a dog on grass") report a perfect
    image-to-text recall for an image that cannot be told from the others.
    """
    own = scores[text_to_item, torch.arange(len(text_to_item))]
    item_rank = (scores.T >= own[:, None]).sum(1) - 1  # less the own item, which always ties with itself
    is_own = text_to_item[None, :] == torch.arange(len(scores))[:, None]
    best_own = scores.masked_fill(~is_own, float("-inf")).max(1).values
    text_rank = ((scores >= best_own[:, None]) & ~is_own).sum(1)
    return item_rank, text_rank


@torch.no_grad()
def encode_texts(model, tokenize, texts: list[str], batch_size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(L2-normalised features of each distinct text, index of each text's row): every copy of a caption
    gets the very same features, so its ties are exact, not subject to batch-dependent rounding."""
    distinct = list(dict.fromkeys(texts))
    row = {text: i for i, text in enumerate(distinct)}
    features = []
    for start in range(0, len(distinct), batch_size):
        tokens = tokenize(distinct[start : start + batch_size])
        features.append(model.encode_text(tokens["input_ids"].to(device), tokens["attention_mask"].to(device)).float().cpu())
    return F.normalize(torch.cat(features), dim=-1), torch.tensor([row[t] for t in texts])


def recall_metrics(image_features: torch.Tensor, text_features: torch.Tensor, text_to_image: torch.Tensor) -> dict:
    """Recall@1/5/10 both ways from L2-normalised features; an image is matched by any of its captions."""
    image_rank, text_rank = retrieval_ranks(image_features.float() @ text_features.float().T, text_to_image)
    metrics: dict[str, float] = {}
    for k in (1, 5, 10):
        metrics[f"image_retrieval_recall@{k}"] = (image_rank < k).float().mean().item()
        metrics[f"text_retrieval_recall@{k}"] = (text_rank < k).float().mean().item()
    metrics["mean_recall"] = sum(metrics.values()) / len(metrics)
    return metrics


@torch.no_grad()
def zeroshot_retrieval(model, tokenize, transform, path: str | os.PathLike, batch_size: int = 256,
                       device: str | torch.device = "cpu", normalize_text=None) -> dict:
    model.eval()
    images, captions = load_retrieval_set(path)
    texts = [normalize_text(t) if normalize_text else t for group in captions for t in group]
    text_to_image = torch.tensor([i for i, group in enumerate(captions) for _ in group])
    dtype = next(model.parameters()).dtype
    image_features = []
    for start in range(0, len(images), batch_size):
        batch = []
        for file in images[start : start + batch_size]:
            try:
                batch.append(transform(decode_image(file.read_bytes())))
            except Exception as exc:
                raise DataError(f"retrieval image {file} cannot be read: {exc}") from None
        image_features.append(model.encode_image(torch.stack(batch).to(device=device, dtype=dtype)).cpu())
    text_features, rows = encode_texts(model, tokenize, texts, batch_size, device)
    return recall_metrics(F.normalize(torch.cat(image_features).float(), dim=-1), text_features[rows], text_to_image)
