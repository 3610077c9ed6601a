"""SPACE-2's semantic-tree scores, as read from the official code (DAMO-ConvAI `space-2/space/utils/scores.py`).

A frame `{domain: {intent: {slot: [value_obj, ...]}}}` is read as a tree and split into ten views (D, I, S, V and the
joined paths DI ... DISV, docs/space2.md). Two frames are compared per view by Jaccard; the combined
score is the mean Jaccard over the views present in either frame. Behaviour of the official code kept on purpose:

- keys that collide after strip/lower overwrite each other with Python dict semantics (the later content wins);
- placeholders are filtered by *substring*, so a value merely containing "default_intent" is dropped too;
- an empty frame scores 0 against anything; each example scores 1 against itself (the matrices' diagonal);
- identical cleaned frames score 1 combined, but per view they score 0 wherever the view is empty.

Training scores labels as hashed codes on the device (below); tests/tree_score_reference.py computes the same
scores plainly, pair by pair, as the official code does, and the tests hold the codes' matrices to it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

VIEWS: tuple[str, ...] = ("D", "I", "S", "V", "DI", "IS", "SV", "DIS", "ISV", "DISV")
PLACEHOLDERS = ("DEFAULT_DOMAIN", "DEFAULT_INTENT")

_LOWER_PLACEHOLDERS = tuple(p.lower() for p in PLACEHOLDERS)


def fix_label(label: dict) -> dict:
    """`{}` when any domain is empty or holds an empty `'DEFAULT_INTENT'` (exact case); otherwise `label` itself.

    Applied when examples are built, so labels carrying no information become unlabelled (§2.6).
    """
    for intents in label.values():
        if not intents:
            return {}
        if "DEFAULT_INTENT" in intents and not intents["DEFAULT_INTENT"]:
            return {}
    return label


def _clean_value(value_obj) -> str:
    raw = value_obj["value"] if isinstance(value_obj, dict) else value_obj
    return str(raw).strip().lower()


def clean_frame(frame: dict) -> dict:
    """Keys strip()+lower(), values `str(value).strip().lower()`; value order and empty strings kept (§2.1)."""
    return {
        domain.strip().lower(): {
            intent.strip().lower(): {
                slot.strip().lower(): [_clean_value(v) for v in values] for slot, values in slots.items()
            }
            for intent, slots in intents.items()
        }
        for domain, intents in frame.items()
    }


def _is_placeholder(element: str) -> bool:
    return any(p in element for p in _LOWER_PLACEHOLDERS)


def _views_of_clean(cleaned: dict) -> tuple[frozenset[str], ...]:
    """The ten element sets of a cleaned frame: lists joined with '-', placeholder substrings dropped, deduplicated."""
    lists: tuple[list[str], ...] = tuple([] for _ in VIEWS)
    d_, i_, s_, v_, di, is_, sv, dis, isv, disv = lists
    for d, intents in cleaned.items():
        d_.append(d)
        for i, slots in intents.items():
            i_.append(i)
            di.append(f"{d}-{i}")
            for s, values in slots.items():
                s_.append(s)
                is_.append(f"{i}-{s}")
                dis.append(f"{d}-{i}-{s}")
                for v in values:
                    v_.append(v)
                    sv.append(f"{s}-{v}")
                    isv.append(f"{i}-{s}-{v}")
                    disv.append(f"{d}-{i}-{s}-{v}")
    return tuple(frozenset(e for e in elements if not _is_placeholder(e)) for elements in lists)


def _check_offset(n_rows: int, n_cols: int, row_offset: int) -> None:
    if row_offset < 0 or row_offset + n_rows > n_cols:
        raise ValueError(f"rows [{row_offset}, {row_offset + n_rows}) are not inside the {n_cols} columns")


def _jaccards(inter: torch.Tensor, union: torch.Tensor) -> torch.Tensor:
    present = union > 0
    return torch.where(present, inter / torch.where(present, union, 1.0), 0.0)


# ----------------------------------------------------------------------------- labels as tensors
#
# Training scores labels inside the step, against every rank's labels. Gathering Python objects there would
# pickle them and read them back to the host each step, so a label becomes fixed-shape integers when it is
# read from the shards: each view's elements as 64-bit hashes (0 pads), and one hash of the whole cleaned
# frame (0 for an empty frame). The scores below are computed from those on the device and equal the
# official scores (a collision of two 64-bit hashes among one batch's elements is the only way they differ).


MAX_LABEL_ELEMENTS = 32  # elements per view a label encoding holds by default (`method.max_label_elements`)


@dataclass(frozen=True)
class LabelCodes:
    """Labels of n examples: `views` [n, 10, E] element hashes (0 = padding), `frames` [n] frame hashes (0 = empty)."""

    views: torch.Tensor
    frames: torch.Tensor


def _hash(text: str) -> int:
    value = int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little", signed=True)
    return value or 1  # 0 is the padding


def _canonical(cleaned: dict) -> str:
    """Equal for two cleaned frames exactly when they are equal as dicts (key order aside, value order kept)."""
    return repr(
        sorted(
            (d, sorted((i, sorted((s, tuple(vs)) for s, vs in slots.items())) for i, slots in intents.items()))
            for d, intents in cleaned.items()
        )
    )


def encode_labels(labels: Sequence[dict], max_elements: int) -> LabelCodes:
    """Labels to tensors; ValueError naming the example and view when one has more than `max_elements` elements."""
    views = torch.zeros(len(labels), len(VIEWS), max_elements, dtype=torch.long)
    frames = torch.zeros(len(labels), dtype=torch.long)
    for row, label in enumerate(labels):
        if not label:
            continue
        cleaned = clean_frame(label)
        frames[row] = _hash(_canonical(cleaned))
        for k, elements in enumerate(_views_of_clean(cleaned)):
            if len(elements) > max_elements:
                raise ValueError(
                    f"label of example {row} has {len(elements)} elements in view {VIEWS[k]}, more than "
                    f"the {max_elements} its encoding holds"
                )
            views[row, k, : len(elements)] = torch.tensor([_hash(e) for e in sorted(elements)], dtype=torch.long)
    return LabelCodes(views, frames)


def _code_counts(rows: torch.Tensor, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """|A ∩ B| and |A ∪ B| (float64) for element-hash sets rows [n, E] x cols [N, E]: every row element is looked
    up in every column's sorted set (searchsorted), so memory is N x n x E, not N x n x E x E."""
    n, width = rows.shape
    total = cols.shape[0]
    sorted_cols = cols.sort(dim=1).values
    queries = rows.reshape(1, n * width).expand(total, -1).contiguous()
    where = torch.searchsorted(sorted_cols, queries).clamp(max=width - 1)
    found = (sorted_cols.gather(1, where) == queries) & (queries != 0)
    inter = found.view(total, n, width).sum(-1).T.double()
    union = (rows != 0).sum(1, dtype=torch.float64)[:, None] + (cols != 0).sum(1, dtype=torch.float64)[None] - inter
    return inter, union


def code_score_matrices(
    rows: LabelCodes, cols: LabelCodes, row_offset: int, views: Sequence[int], combined: bool = False
) -> torch.Tensor:
    """[K, n, N] float32 on the codes' device: per view k in `views`, M[k, i, j] = the Jaccard of row i's and column
    j's view k (or, `combined`, the combined score as [1, n, N]), and 1 at (i, row_offset + i); no host read.

    One difference from the official combined score, ours: a pair of different non-empty frames with no view present
    scores 0, where the official code divides by zero (the step cannot stop on a value it does not read).
    """
    n, total = rows.frames.shape[0], cols.frames.shape[0]
    _check_offset(n, total, row_offset)
    if combined:
        summed = torch.zeros(n, total, dtype=torch.float64, device=rows.views.device)
        present = torch.zeros(n, total, dtype=torch.float64, device=rows.views.device)
        for k in range(len(VIEWS)):  # k = 0..9 in order, as the official code sums
            inter, union = _code_counts(rows.views[:, k], cols.views[:, k])
            summed += _jaccards(inter, union)
            present += union > 0
        mean = summed / present.clamp(min=1)
        empty = (rows.frames[:, None] == 0) | (cols.frames[None] == 0)
        equal = rows.frames[:, None] == cols.frames[None]
        out = torch.where(empty, 0.0, torch.where(equal, 1.0, mean)).float()[None]
    else:
        out = torch.stack([_jaccards(*_code_counts(rows.views[:, k], cols.views[:, k])) for k in views]).float()
    # Each local example against itself among the columns: a fill, where writing 1.0 through index tensors
    # would copy the scalar to the GPU from host memory and wait for the device.
    out.diagonal(offset=row_offset, dim1=1, dim2=2).fill_(1.0)
    return out
