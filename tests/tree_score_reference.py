"""SPACE-2's semantic-tree scores written plainly, as the official code computes them (DAMO-ConvAI
`space-2/space/utils/scores.py`): the scalar scores per pair of frames, and the batch matrices built from them
(sets and a sparse matmul, no hashing). The tests hold `mmpt.losses.tree_score`'s hashed label codes, which
training scores on the device, to these.

Behaviour of the official code kept on purpose (docs/space2.md):
- an empty frame scores 0 against anything, itself included; only the batch matrices put 1 on their diagonal;
- identical cleaned frames score 1 combined, but per view they score 0 wherever the view is empty;
- two different frames with no view present raise ZeroDivisionError, as the official code does.
The batch matrices equal the scalar functions after the float32 cast: J = inter / union in float64, and the
combined score sums J over k = 0..9 in order before dividing by the number of present views.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mmpt.losses.tree_score import VIEWS, _check_offset, _jaccards, _views_of_clean, clean_frame

_EMPTY_VIEWS: tuple[frozenset[str], ...] = tuple(frozenset() for _ in VIEWS)


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
