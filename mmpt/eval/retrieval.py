"""Zero-shot image-text retrieval on the layouts of `mmpt.eval.retrieval_formats` (the official
M²-Encoder jsonl, Karpathy and ALBEF/BLIP json, Chinese-CLIP, CLIP_benchmark webdataset).

Reports recall@1/5/10 in both directions and their mean (MR), CLIP_benchmark style:
`text_retrieval_recall@k` (image -> text), `image_retrieval_recall@k` (text -> image), `mean_recall`.
Ranks count ties against the query (`RANK_TIES`), and the results say so.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from mmpt.data.image_text import decode_image
from mmpt.data.shards import DataError
from mmpt.eval.retrieval_formats import RetrievalSet, read_retrieval_set


def official_caption_normalization(text: str) -> str:
    """What the official retrieval evaluation does to captions: lower-case, straighten double quotes."""
    return text.lower().replace("“", '"').replace("”", '"')


RANK_TIES = "pessimistic: every other candidate scoring at least as high as the query's match ranks before it"


def as_matches(match: torch.Tensor, items: int) -> torch.Tensor:
    """A bool [items, texts] match matrix from one (each text's item index) or as given."""
    if match.dtype == torch.bool:
        return match
    return match[None, :] == torch.arange(items)[:, None]


def retrieval_ranks(scores: torch.Tensor, match: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """0-based ranks from a score matrix [items, texts] and which pairs match (a bool matrix, or each
    text's item index): (rank of each text's best-scoring matching item among the items, rank of each
    item's best-scoring matching text among the texts, for items that some text matches).

    Ties count against the query (`RANK_TIES`): a caption of another image that scores the same as
    the image's own caption, as identical captions do, ranks before it. Counting only strictly
    higher scores would let every set with repeated captions ("a dog on grass") report a perfect
    image-to-text recall for an image that cannot be told from the others.
    """
    matches = as_matches(match, len(scores))
    masked = scores.masked_fill(~matches, float("-inf"))
    best_item = masked.max(0).values  # per text
    item_rank = ((scores >= best_item[None, :]) & ~matches).sum(0)
    best_text = masked.max(1).values  # per item
    text_rank = ((scores >= best_text[:, None]) & ~matches).sum(1)
    return item_rank, text_rank[matches.any(1)]


@torch.no_grad()
def encode_texts(model, tokenize, texts: list[str], batch_size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(L2-normalised features of each distinct text, index of each text's row): every copy of a caption
    gets the very same features, so its ties are exact, not subject to batch-dependent rounding."""
    distinct = list(dict.fromkeys(texts))
    row = {text: i for i, text in enumerate(distinct)}
    features = []
    for start in range(0, len(distinct), batch_size):
        tokens = tokenize(distinct[start : start + batch_size])
        features.append(
            model.encode_text(tokens["input_ids"].to(device), tokens["attention_mask"].to(device)).float().cpu()
        )
    return F.normalize(torch.cat(features), dim=-1), torch.tensor([row[t] for t in texts])


def recall_metrics(image_features: torch.Tensor, text_features: torch.Tensor, match: torch.Tensor) -> dict:
    """Recall@1/5/10 both ways and their mean (MR) from L2-normalised features; `match`: which texts
    describe which images (see `retrieval_ranks`); an image is found by any of its texts."""
    image_rank, text_rank = retrieval_ranks(image_features.float() @ text_features.float().T, match)
    metrics: dict[str, float] = {}
    for k in (1, 5, 10):
        metrics[f"image_retrieval_recall@{k}"] = (image_rank < k).float().mean().item()
        metrics[f"text_retrieval_recall@{k}"] = (text_rank < k).float().mean().item()
    metrics["mean_recall"] = sum(metrics.values()) / len(metrics)
    return metrics


@torch.no_grad()
def zeroshot_retrieval(
    model,
    tokenize,
    transform,
    path: str | os.PathLike,
    batch_size: int = 256,
    device: str | torch.device = "cpu",
    normalize_text=None,
    fields=None,
    predictions: str | os.PathLike | None = None,
) -> dict:
    """Retrieval metrics of `model` on any layout `read_retrieval_set` reads (`fields`: where shard samples keep
    their image and captions); `predictions`: a file for each caption's top 10 images (`write_top_images`)."""
    model.eval()
    data = read_retrieval_set(path, fields)
    texts = [normalize_text(t) for t in data.texts] if normalize_text else data.texts
    dtype = next(model.parameters()).dtype
    encode = lambda batch: model.encode_image(batch.to(device=device, dtype=dtype))
    image_features = encode_files(data.images, lambda raw: transform(decode_image(raw)), encode, batch_size, "image")
    text_features, rows = encode_texts(model, tokenize, texts, batch_size, device)
    images = F.normalize(image_features, dim=-1)
    if predictions is not None:
        write_top_images(predictions, text_features[rows] @ images.T, data)
    return recall_metrics(images, text_features[rows], data.matches)


def encode_files(
    files: list[Path],
    prepare,
    encode,
    batch_size: int,
    what: str,
    errors: type[Exception] | tuple[type[Exception], ...] = Exception,
) -> torch.Tensor:
    """fp32 host features of `files`, read, `prepare`d and `encode`d in batches; a file that fails with `errors`
    is a DataError naming it (evaluation sets are fixed: skipping one would change the benchmark)."""
    features = []
    for start in range(0, len(files), batch_size):
        batch = []
        for file in files[start : start + batch_size]:
            try:
                batch.append(prepare(file.read_bytes()))
            except errors as exc:
                raise DataError(f"retrieval {what} {file} cannot be read: {exc}") from None
        features.append(encode(torch.stack(batch)).float().cpu())
    return torch.cat(features)


def write_top_images(path: str | os.PathLike, scores: torch.Tensor, data: RetrievalSet, k: int = 10) -> None:
    """Each caption's `k` best images, best first, as Chinese-CLIP's `make_topk_predictions` writes them (the
    format MUGE's leaderboard and its `evaluation.py` read): one `{"text_id", "image_ids"}` line per caption, ids
    the layout's own (positions for layouts without ids)."""
    text_ids = data.text_ids or list(range(len(data.texts)))
    image_ids = data.image_ids or list(range(len(data.images)))
    top = scores.topk(min(k, scores.shape[1]), dim=1).indices.tolist()
    lines = [json.dumps({"text_id": t, "image_ids": [image_ids[i] for i in row]}) for t, row in zip(text_ids, top)]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")
