"""SPACE-2 semantic-tree scores against values worked out by hand from the official scoring rules (docs/space2.md)."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from tree_score_reference import combined_score_matrix, frame_views, tree_score, view_score_matrices, view_scores

from mmpt.losses.tree_score import VIEWS, clean_frame, code_score_matrices, encode_labels, fix_label


def v(value, span=None):
    return {"value": value, "span": span}


def views_dict(frame):
    return dict(zip(VIEWS, frame_views(frame)))


def fs(*elements):
    return frozenset(elements)


# The spec's worked example (§2.5).
A = {
    "hotel": {"inform": {"area": [v("north", [0, 5])], "price": [v("cheap", [6, 11])]}},
    "taxi": {"request": {"leaveat": []}},
}
B = {"Hotel": {"inform": {"area": [v("North")]}, "DEFAULT_INTENT": {"stars": [v("4")]}}}


def test_worked_example():
    expected = [1 / 2, 1 / 2, 1 / 4, 1 / 3, 1 / 2, 1 / 3, 1 / 3, 1 / 3, 1 / 2, 1 / 2]
    assert view_scores(A, B) == expected
    assert tree_score(A, B) == pytest.approx(49 / 120, abs=1e-15)  # (5/2 + 1/4 + 4/3) / 10
    assert torch.tensor(tree_score(A, B), dtype=torch.float32) == torch.tensor(49 / 120, dtype=torch.float32)
    assert views_dict(B) == {
        "D": fs("hotel"),
        "I": fs("inform"),
        "S": fs("area", "stars"),
        "V": fs("north", "4"),
        "DI": fs("hotel-inform"),
        "IS": fs("inform-area"),
        "SV": fs("area-north", "stars-4"),
        "DIS": fs("hotel-inform-area"),
        "ISV": fs("inform-area-north"),
        "DISV": fs("hotel-inform-area-north"),
    }


def test_empty_frames_score_zero():
    for a, b in ((A, {}), ({}, A), ({}, {})):
        assert tree_score(a, b) == 0.0
        assert view_scores(a, b) == [0.0] * 10
    assert frame_views({}) == [frozenset()] * 10


def test_identical_frames_combined_one_but_empty_views_zero():
    intent_only = {"DEFAULT_DOMAIN": {"book_flight": {}}}  # only view I is non-empty
    assert tree_score(intent_only, copy.deepcopy(intent_only)) == 1.0
    assert view_scores(intent_only, copy.deepcopy(intent_only)) == [0, 1, 0, 0, 0, 0, 0, 0, 0, 0]
    assert tree_score(A, copy.deepcopy(A)) == 1.0
    assert view_scores(A, copy.deepcopy(A)) == [1.0] * 10


def test_case_whitespace_and_int_values():
    a = {" Hotel ": {"INFORM": {"Stars ": [v(3)]}}}
    b = {"hotel": {"inform": {"stars": [v(" 3 ")]}}}
    assert clean_frame(a) == clean_frame(b) == {"hotel": {"inform": {"stars": ["3"]}}}
    assert tree_score(a, b) == 1.0
    assert view_scores(a, b) == [1.0] * 10
    # str(3.0) is "3.0": the value views differ, D I S DI IS DIS agree: 6/10.
    c = {"hotel": {"inform": {"stars": [v(3.0)]}}}
    assert view_scores(a, c) == [1, 1, 1, 0, 1, 1, 0, 1, 0, 0]
    assert tree_score(a, c) == 6 / 10


def test_plain_values_in_value_list():
    assert clean_frame({"h": {"i": {"s": ["North ", 4, v("x")]}}}) == {"h": {"i": {"s": ["north", "4", "x"]}}}


def test_value_order_matters_for_equality_only():
    a = {"h": {"i": {"s": [v("x"), v("y")]}}}
    b = {"h": {"i": {"s": [v("y"), v("x")]}}}
    assert view_scores(a, b) == [1.0] * 10
    assert tree_score(a, b) == 1.0  # not equal as dicts, but every view matches: 10/10
    # Only placeholders: equal frames take the shortcut, reordered values are not equal and fall through to 0/0.
    p = {"DEFAULT_DOMAIN": {"DEFAULT_INTENT": {"default_intent_s": [v("default_domain 1"), v("default_domain 2")]}}}
    q = {"DEFAULT_DOMAIN": {"DEFAULT_INTENT": {"default_intent_s": [v("default_domain 2"), v("default_domain 1")]}}}
    assert tree_score(p, copy.deepcopy(p)) == 1.0
    with pytest.raises(ZeroDivisionError):
        tree_score(p, q)
    c = {"h": {"i": {"s": [v("x"), v("")]}}}  # the empty string is an element
    assert views_dict(c)["V"] == fs("x", "")
    assert view_scores(a, c) == [1, 1, 1, 1 / 3, 1, 1, 1 / 3, 1, 1 / 3, 1 / 3]


def test_key_collisions_later_content_wins_first_position_kept():
    frame = {"Hotel": {"inform": {"area": [v("north")]}}, "taxi": {"book": {}}, "hotel ": {"request": {"stars": []}}}
    cleaned = clean_frame(frame)
    assert cleaned == {"hotel": {"request": {"stars": []}}, "taxi": {"book": {}}}
    assert list(cleaned) == ["hotel", "taxi"]
    assert tree_score(frame, {"taxi": {"book": {}}, "hotel": {"request": {"stars": []}}}) == 1.0
    assert views_dict({"h": {"Inform": {"a": [v("1")]}, "inform": {"b": []}}})["S"] == fs("b")


def test_default_domain_frame():
    assert views_dict({"DEFAULT_DOMAIN": {"inform": {"area": [v("north")]}}}) == {
        "D": fs(),
        "I": fs("inform"),
        "S": fs("area"),
        "V": fs("north"),
        "DI": fs(),
        "IS": fs("inform-area"),
        "SV": fs("area-north"),
        "DIS": fs(),
        "ISV": fs("inform-area-north"),
        "DISV": fs(),
    }


def test_default_intent_keeps_s_v_sv():
    assert views_dict({"hotel": {"DEFAULT_INTENT": {"stars": [v("4")]}}}) == {
        "D": fs("hotel"),
        "I": fs(),
        "S": fs("stars"),
        "V": fs("4"),
        "DI": fs(),
        "IS": fs(),
        "SV": fs("stars-4"),
        "DIS": fs(),
        "ISV": fs(),
        "DISV": fs(),
    }


def test_placeholder_substring_filtering():
    frame = {
        "hotel": {"inform": {"name": [v("The DEFAULT_INTENT Inn")], "area": [v("north")], "default_domain_id": []}}
    }
    views = views_dict(frame)
    assert views["S"] == fs("name", "area")
    assert views["V"] == fs("north")
    assert views["SV"] == fs("area-north")
    assert views["DISV"] == fs("hotel-inform-area-north")
    assert views_dict({"Default_Domain ": {"inform": {}}})["D"] == fs()


def test_multiple_domains_and_dedup():
    a = {"hotel": {"inform": {"area": [v("north")]}}, "taxi": {"inform": {"area": [v("north")]}}}
    b = {"hotel": {"inform": {"area": [v("north")]}}}
    assert views_dict(a)["I"] == fs("inform")
    assert view_scores(a, b) == [1 / 2, 1, 1, 1, 1 / 2, 1, 1, 1 / 2, 1, 1 / 2]
    assert tree_score(a, b) == 8 / 10


def test_slot_with_empty_value_list():
    views = views_dict({"hotel": {"request": {"stay": []}}})
    assert views == {
        "D": fs("hotel"),
        "I": fs("request"),
        "S": fs("stay"),
        "V": fs(),
        "DI": fs("hotel-request"),
        "IS": fs("request-stay"),
        "SV": fs(),
        "DIS": fs("hotel-request-stay"),
        "ISV": fs(),
        "DISV": fs(),
    }


def test_intent_with_empty_slots():
    bye = {"hotel": {"bye": {}}}
    assert views_dict(bye) == {k: fs() for k in VIEWS} | {"D": fs("hotel"), "I": fs("bye"), "DI": fs("hotel-bye")}
    thank = {"hotel": {"thank": {}}}
    assert view_scores(bye, thank) == [1, 0, 0, 0, 0, 0, 0, 0, 0, 0]
    assert tree_score(bye, thank) == 1 / 3  # D, I, DI present; only D matches
    matrix = combined_score_matrix([bye, thank], [bye, thank])
    assert matrix[0, 1].item() == 0.3333333432674408  # float32(1/3) = 0.33333334
    assert matrix.dtype == torch.float32


def test_dash_join_ambiguity():
    a = {"d": {"i": {"a-b": [v("c")]}}}
    b = {"d": {"i": {"a": [v("b-c")]}}}
    assert views_dict(a)["SV"] == views_dict(b)["SV"] == fs("a-b-c")
    assert view_scores(a, b) == [1, 1, 0, 0, 1, 0, 1, 0, 1, 1]
    assert tree_score(a, b) == 6 / 10


def test_no_view_present_raises_zero_division():
    a = {"DEFAULT_DOMAIN": {}}
    b = {"DEFAULT_DOMAIN": {"DEFAULT_INTENT": {}}}
    with pytest.raises(ZeroDivisionError, match="DEFAULT_INTENT"):
        tree_score(a, b)
    with pytest.raises(ZeroDivisionError):
        combined_score_matrix([a, b], [a, b])
    assert combined_score_matrix([a], [a]).tolist() == [[1.0]]
    assert tree_score(b, copy.deepcopy(b)) == 1.0  # identical frames take the shortcut first
    assert view_scores(a, b) == [0.0] * 10
    assert view_score_matrices([a, b], [a, b]).tolist() == [[[1.0, 0.0], [0.0, 1.0]]] * 10
    assert fix_label(a) == {} and fix_label(b) == {}


def test_fix_label():
    assert fix_label({}) == {}
    assert fix_label({"hotel": {}}) == {}
    assert fix_label({"taxi": {"inform": {"a": []}}, "hotel": {}}) == {}
    assert fix_label({"hotel": {"DEFAULT_INTENT": {}}}) == {}
    assert fix_label({"hotel": {"inform": {"area": [v("north")]}, "DEFAULT_INTENT": {}}}) == {}
    kept = [
        {"hotel": {"DEFAULT_INTENT": {"stars": [v("4")]}}},
        {"hotel": {"default_intent": {}}},  # the check is case-sensitive
        {"DEFAULT_DOMAIN": {"book_flight": {}}},
        A,
        B,
    ]
    for label in kept:
        before = copy.deepcopy(label)
        assert fix_label(label) is label
        assert label == before


# Random frames: small vocabularies so that equal frames, collisions, placeholders and repeats all occur.
DOMAINS = ["hotel", " Hotel", "TAXI", "taxi ", "restaurant", "DEFAULT_DOMAIN", "Default_Domain", "a-b"]
INTENTS = ["inform", "Inform ", "request", "DEFAULT_INTENT", "book", "a", "b-c"]
SLOTS = ["area", "price", "stars", "a", "b-c", "name", "x_default_intent"]
VALUES = [v("north"), v("North "), v(3), v("3"), v(""), v("cheap"), v("b-c"), "plain", 4, v("the default_domain")]


def random_frame(rng: random.Random) -> dict:
    if rng.random() < 0.1:
        return {}
    return {
        rng.choice(DOMAINS): {
            rng.choice(INTENTS): {
                rng.choice(SLOTS): rng.sample(VALUES, rng.randint(0, 2)) for _ in range(rng.randint(0, 2))
            }
            for _ in range(rng.randint(0, 2))
        }
        for _ in range(rng.randint(1, 2))
    }


def random_labels(seed: int, n: int) -> list[dict]:
    rng = random.Random(seed)
    labels = [random_frame(rng) for _ in range(n)]
    for i in rng.sample(range(n), n // 5):  # repeats: the same object and an equal copy
        labels[i] = labels[rng.randrange(n)] if rng.random() < 0.5 else copy.deepcopy(labels[rng.randrange(n)])
    return labels


def test_symmetry():
    labels = random_labels(0, 60)
    for a in labels:
        for b in labels:
            assert view_scores(a, b) == view_scores(b, a)
            try:
                ab = tree_score(a, b)
            except ZeroDivisionError:
                with pytest.raises(ZeroDivisionError):
                    tree_score(b, a)
            else:
                assert ab == tree_score(b, a)


def expected_matrices(rows, cols, offset, views):
    per_view = torch.tensor([[view_scores(a, b) for b in cols] for a in rows], dtype=torch.float64)
    per_view = per_view.permute(2, 0, 1)[views].to(torch.float32)
    combined = torch.zeros(len(rows), len(cols), dtype=torch.float64)
    undefined = False
    for i, a in enumerate(rows):
        for j, b in enumerate(cols):
            if j == offset + i:
                continue
            try:
                combined[i, j] = tree_score(a, b)
            except ZeroDivisionError:
                undefined = True
    combined = combined.to(torch.float32)
    for i in range(len(rows)):
        per_view[:, i, offset + i] = 1.0
        combined[i, offset + i] = 1.0
    return per_view, (None if undefined else combined)


@pytest.mark.parametrize("seed", range(12))
def test_batch_matrices_equal_scalar_functions(seed):
    rng = random.Random(1000 + seed)
    cols = random_labels(seed, 48)
    if seed % 2:
        cols = [fix_label(label) for label in cols]  # as the pipeline does
    n_rows = rng.randint(1, 16)
    offset = rng.randint(0, len(cols) - n_rows)
    rows = [copy.deepcopy(label) for label in cols[offset : offset + n_rows]]
    views = list(range(10)) if seed < 4 else rng.sample(range(10), rng.randint(1, 10))
    per_view, combined = expected_matrices(rows, cols, offset, views)
    got = view_score_matrices(rows, cols, row_offset=offset, views=None if seed < 2 else views)
    assert got.dtype == torch.float32 and got.shape == (len(views), n_rows, len(cols))
    assert torch.equal(got, per_view)
    if combined is None:
        with pytest.raises(ZeroDivisionError):
            combined_score_matrix(rows, cols, row_offset=offset)
    else:
        got = combined_score_matrix(rows, cols, row_offset=offset)
        assert got.dtype == torch.float32 and torch.equal(got, combined)


@pytest.mark.parametrize("seed", range(8))
def test_scores_of_encoded_labels_equal_the_scalar_functions(seed):
    """The training step's tensor path (`encode_labels` + `code_score_matrices`) against the per-pair functions;
    where the official code divides by zero, the tensor path scores 0 (and nothing else differs)."""
    rng = random.Random(2000 + seed)
    cols = random_labels(100 + seed, 40)
    if seed % 2:
        cols = [fix_label(label) for label in cols]
    n_rows = rng.randint(1, 12)
    offset = rng.randint(0, len(cols) - n_rows)
    rows = cols[offset : offset + n_rows]
    views = rng.sample(range(10), rng.randint(1, 10))
    per_view, _ = expected_matrices(rows, cols, offset, views)
    row_codes, col_codes = encode_labels(rows, 8), encode_labels(cols, 8)
    assert torch.equal(code_score_matrices(row_codes, col_codes, offset, views), per_view)
    combined = torch.tensor([[tree_score_or_zero(a, b) for b in cols] for a in rows], dtype=torch.float64).float()
    combined[torch.arange(n_rows), offset + torch.arange(n_rows)] = 1.0
    assert torch.equal(code_score_matrices(row_codes, col_codes, offset, [0], combined=True)[0], combined)


def tree_score_or_zero(a, b):
    try:
        return tree_score(a, b)
    except ZeroDivisionError:
        return 0.0


def test_label_encoding_says_which_example_overflows():
    crowded = {"hotel": {"inform": {f"slot{i}": [v("x")] for i in range(5)}}}
    with pytest.raises(ValueError, match="example 1 has 5 elements in view S, more than the 4"):
        encode_labels([{}, crowded], 4)


def test_batch_diagonal_is_one_for_empty_labels():
    labels = [{}, A, {}, B]
    per_view = view_score_matrices(labels, labels)
    combined = combined_score_matrix(labels, labels)
    eye = torch.eye(4, dtype=torch.float32)
    assert torch.equal(per_view[:, [0, 2]][:, :, [0, 2]], eye[[0, 2]][:, [0, 2]].expand(10, 2, 2))
    assert combined.diagonal().tolist() == [1.0] * 4
    assert combined[0].tolist() == [1.0, 0.0, 0.0, 0.0]  # two different empty examples are still negatives
    assert combined[1, 3].item() == torch.tensor(49 / 120, dtype=torch.float32).item()
    # Rows 1..2 of the columns: the diagonal moves with the offset.
    shifted = view_score_matrices(labels[1:3], labels, row_offset=1, views=[3, 1])
    assert shifted.shape == (2, 2, 4)
    expected = [[[0, 1, 0, 1 / 3], [0, 0, 1, 0]], [[0, 1, 0, 1 / 2], [0, 0, 1, 0]]]
    assert torch.equal(shifted, torch.tensor(expected, dtype=torch.float32))


def test_bad_offset_and_view_index():
    with pytest.raises(ValueError):
        view_score_matrices([A, B], [A, B], row_offset=1)
    with pytest.raises(ValueError):
        combined_score_matrix([A], [A], row_offset=-1)
    with pytest.raises(ValueError):
        view_score_matrices([A], [A], views=[10])
