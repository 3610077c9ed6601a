"""SPACE-2's semantic-tree scores, as read from the official code (DAMO-ConvAI `space-2/space/utils/scores.py`).

A frame `{domain: {intent: {slot: [value_obj, ...]}}}` is read as a tree and split into ten views (D, I, S, V and the
joined paths DI ... DISV, docs/space2.md). Two frames are compared per view by Jaccard; the combined
score is the mean Jaccard over the views present in either frame. Behaviour of the official code kept on purpose:

- keys that collide after strip/lower overwrite each other with Python dict semantics (the later content wins);
- placeholders are filtered by *substring*, so a value merely containing "default_intent" is dropped too;
- an empty frame scores 0 against anything, itself included; only the batch matrices put 1 on their diagonal;
- identical cleaned frames score 1 combined, but per view they score 0 wherever the view is empty;
- two different frames with no view present raise ZeroDivisionError, as the official code does (`fix_label` maps
  such labels to `{}` before scoring, so the pipeline never gets there).

The batch matrices are vectorised (multi-hot sets, sparse matmul for the intersections) and equal the scalar
functions after the float32 cast: J = inter / union in float64, and the combined score sums J over k = 0..9 in order
before dividing by the number of present views, as the Python code does.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

VIEWS: tuple[str, ...] = ("D", "I", "S", "V", "DI", "IS", "SV", "DIS", "ISV", "DISV")
PLACEHOLDERS = ("DEFAULT_DOMAIN", "DEFAULT_INTENT")

_LOWER_PLACEHOLDERS = tuple(p.lower() for p in PLACEHOLDERS)
_EMPTY_VIEWS: tuple[frozenset[str], ...] = tuple(frozenset() for _ in VIEWS)


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


def frame_views(frame: dict) -> list[frozenset[str]]:
    """The ten element sets of `frame` in `VIEWS` order (§2.1-2.3); all empty for an empty frame."""
    if not frame:
        return list(_EMPTY_VIEWS)
    return list(_views_of_clean(clean_frame(frame)))


def _jaccard(x: frozenset[str], y: frozenset[str]) -> float:
    union = len(x | y)
    return len(x & y) / union if union else 0.0


def view_scores(a: dict, b: dict) -> list[float]:
    """Per-view Jaccards (`return_all=True`): ten 0.0 if either frame is empty, 0.0 for a view absent from both."""
    if not a or not b:
        return [0.0] * len(VIEWS)
    return [_jaccard(x, y) for x, y in zip(frame_views(a), frame_views(b))]


def tree_score(a: dict, b: dict) -> float:
    """Combined score (§2.5): 0 if either is empty, 1 if the cleaned frames are equal, else the mean present Jaccard."""
    if not a or not b:
        return 0.0
    clean_a, clean_b = clean_frame(a), clean_frame(b)
    if clean_a == clean_b:
        return 1.0
    total, present = 0.0, 0
    for x, y in zip(_views_of_clean(clean_a), _views_of_clean(clean_b)):
        union = len(x | y)
        if union:
            total += len(x & y) / union
            present += 1
    if not present:
        raise ZeroDivisionError(_no_view_message(a, b))
    return total / present


def _no_view_message(a: dict, b: dict) -> str:
    return f"tree_score: no view present in either frame (the official code divides by zero): {a!r} vs {b!r}"


def _freeze(cleaned: dict):
    """Hashable key equal for two cleaned frames exactly when they are equal as dicts (value order matters)."""
    return frozenset(
        (d, frozenset((i, frozenset((s, tuple(vs)) for s, vs in slots.items())) for i, slots in intents.items()))
        for d, intents in cleaned.items()
    )


class _Groups:
    """Labels grouped by cleaned frame, shared by rows and columns so equal ids mean equal cleaned frames."""

    def __init__(self) -> None:
        self.ids: dict[object, int] = {}
        self.views: list[tuple[frozenset[str], ...]] = []
        self.empty: list[bool] = []

    def index(self, labels: Sequence[dict]) -> list[int]:
        out = []
        for label in labels:
            if not label:
                key, cleaned = None, None
            else:
                cleaned = clean_frame(label)
                key = _freeze(cleaned)
            gid = self.ids.get(key)
            if gid is None:
                gid = self.ids[key] = len(self.views)
                self.views.append(_EMPTY_VIEWS if cleaned is None else _views_of_clean(cleaned))
                self.empty.append(cleaned is None)
            out.append(gid)
        return out


def _check_offset(n_rows: int, n_cols: int, row_offset: int) -> None:
    if row_offset < 0 or row_offset + n_rows > n_cols:
        raise ValueError(f"rows [{row_offset}, {row_offset + n_rows}) are not inside the {n_cols} columns")


def _unique(gids: list[int]) -> tuple[list[int], torch.Tensor]:
    """Distinct group ids in first-seen order, and each label's position among them."""
    order: dict[int, int] = {}
    pos = [order.setdefault(g, len(order)) for g in gids]
    return list(order), torch.tensor(pos, dtype=torch.long)


def _view_counts(groups: _Groups, rows: list[int], cols: list[int], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """|A_k ∩ B_k| and |A_k ∪ B_k| (float64, exact integers) for distinct row groups x distinct column groups."""
    row_sets = [groups.views[g][k] for g in rows]
    col_sets = [groups.views[g][k] for g in cols]
    vocab: dict[str, int] = {}
    r_idx, r_elem = [], []
    for r, elements in enumerate(row_sets):
        for e in elements:
            r_idx.append(r)
            r_elem.append(vocab.setdefault(e, len(vocab)))
    c_idx, c_elem = [], []
    for c, elements in enumerate(col_sets):
        for e in elements:
            v = vocab.get(e)  # an element no row has cannot be in an intersection
            if v is not None:
                c_idx.append(c)
                c_elem.append(v)
    row_hot = torch.zeros(len(vocab), len(rows), dtype=torch.float64)
    row_hot[r_elem, r_idx] = 1.0
    col_hot = torch.sparse_coo_tensor(
        torch.tensor([c_idx, c_elem], dtype=torch.long).reshape(2, -1),
        torch.ones(len(c_idx), dtype=torch.float64),
        (len(cols), len(vocab)),
        check_invariants=False,
    )
    inter = torch.sparse.mm(col_hot, row_hot).T
    row_size = torch.tensor([len(s) for s in row_sets], dtype=torch.float64)
    col_size = torch.tensor([len(s) for s in col_sets], dtype=torch.float64)
    union = row_size[:, None] + col_size[None, :] - inter
    return inter, union


def _jaccards(inter: torch.Tensor, union: torch.Tensor) -> torch.Tensor:
    present = union > 0
    return torch.where(present, inter / torch.where(present, union, 1.0), 0.0)


def view_score_matrices(
    row_labels: list[dict], col_labels: list[dict], row_offset: int = 0, views: Sequence[int] | None = None
) -> torch.Tensor:
    """[K, n_rows, n_cols] float32: M[k, i, j] = J_views[k](row i, col j), and 1 at (i, row_offset + i).

    The per-view matrices of `build_score_multiple_matrix_on_the_fly` (§2.7), for rows that are the columns
    row_offset .. row_offset + n_rows - 1 (one rank's examples among all ranks' gathered ones).
    """
    n_rows, n_cols = len(row_labels), len(col_labels)
    _check_offset(n_rows, n_cols, row_offset)
    views = list(range(len(VIEWS))) if views is None else [int(k) for k in views]
    for k in views:
        if not 0 <= k < len(VIEWS):
            raise ValueError(f"view index {k} is outside 0..{len(VIEWS) - 1}")
    groups = _Groups()
    rows, row_pos = _unique(groups.index(row_labels))
    cols, col_pos = _unique(groups.index(col_labels))
    out = torch.empty(len(views), n_rows, n_cols, dtype=torch.float32)
    for slot, k in enumerate(views):
        jac = _jaccards(*_view_counts(groups, rows, cols, k))  # empty labels have empty sets: 0, as rule 1 says
        out[slot] = jac[row_pos][:, col_pos].to(torch.float32)
    diag = torch.arange(n_rows)
    out[:, diag, diag + row_offset] = 1.0
    return out


def combined_score_matrix(row_labels: list[dict], col_labels: list[dict], row_offset: int = 0) -> torch.Tensor:
    """[n_rows, n_cols] float32: tree_score(row i, col j), and 1 at (i, row_offset + i)
    (`build_score_matrix_on_the_fly`).

    Raises ZeroDivisionError, like `tree_score`, for an off-diagonal pair of different frames with no view present.
    """
    n_rows, n_cols = len(row_labels), len(col_labels)
    _check_offset(n_rows, n_cols, row_offset)
    groups = _Groups()
    row_gids, col_gids = groups.index(row_labels), groups.index(col_labels)
    rows, row_pos = _unique(row_gids)
    cols, col_pos = _unique(col_gids)
    total = torch.zeros(len(rows), len(cols), dtype=torch.float64)
    present = torch.zeros(len(rows), len(cols), dtype=torch.int64)
    for k in range(len(VIEWS)):  # k = 0..9 in order, as Python's sum, so the float64 total rounds the same
        inter, union = _view_counts(groups, rows, cols, k)
        total += _jaccards(inter, union)
        present += union > 0
    mean = total / torch.where(present > 0, present, 1)
    row_empty = torch.tensor([groups.empty[g] for g in rows], dtype=torch.bool)
    col_empty = torch.tensor([groups.empty[g] for g in cols], dtype=torch.bool)
    empty = row_empty[:, None] | col_empty[None, :]
    equal = torch.tensor(rows, dtype=torch.long)[:, None] == torch.tensor(cols, dtype=torch.long)[None, :]
    score = torch.where(empty, 0.0, torch.where(equal, 1.0, mean))
    undefined = (present == 0) & ~empty & ~equal
    full = score[row_pos][:, col_pos].to(torch.float32)
    diag = torch.arange(n_rows)
    undefined = undefined[row_pos][:, col_pos]
    undefined[diag, diag + row_offset] = False
    if undefined.any():
        i, j = (int(t) for t in undefined.nonzero()[0])
        raise ZeroDivisionError(_no_view_message(row_labels[i], col_labels[j]))
    full[diag, diag + row_offset] = 1.0
    return full


# ----------------------------------------------------------------------------- labels as tensors
#
# Training scores labels inside the step, against every rank's labels. Gathering Python objects there would
# pickle them and read them back to the host each step, so a label becomes fixed-shape integers when it is
# read from the shards: each view's elements as 64-bit hashes (0 pads), and one hash of the whole cleaned
# frame (0 for an empty frame). The scores below are computed from those on the device and equal the
# matrices above (a collision of two 64-bit hashes among one batch's elements is the only way they differ).


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
    """[K, n, N] float32 on the codes' device: `view_score_matrices` (or `combined_score_matrix` as [1, n, N]) of
    the encoded labels, with no host read.

    One difference from `combined_score_matrix`, ours: a pair of different non-empty frames with no view present
    scores 0, where the official code divides by zero (the step cannot stop on a value it does not read).
    """
    n, total = rows.frames.shape[0], cols.frames.shape[0]
    _check_offset(n, total, row_offset)
    if combined:
        summed = torch.zeros(n, total, dtype=torch.float64, device=rows.views.device)
        present = torch.zeros(n, total, dtype=torch.float64, device=rows.views.device)
        for k in range(len(VIEWS)):  # k = 0..9 in order, as `combined_score_matrix` sums
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
