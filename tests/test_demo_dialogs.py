"""The generated dialog corpus: official SPACE-2 format, exact spans, held-out intent surface forms, determinism."""

from __future__ import annotations

import csv
import json
from collections import Counter
from pathlib import Path

import pytest

from mmpt.demo import dialogs as demo_dialogs
from mmpt.demo.dialogs import COMPLETE_MARKER, INTENTS, build_dialogs

FILES = [
    "labelled/train.json",
    "unlabelled/train.jsonl",
    "intent/train.csv",
    "intent/test.csv",
    "intent/categories.json",
    "stats.json",
    COMPLETE_MARKER,
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return build_dialogs(tmp_path_factory.mktemp("dialogs") / "demo")


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle)
        assert reader.fieldnames == ["text", "category"]
        return list(reader)


def pretraining_user_texts(root: Path) -> set[str]:
    labelled = json.loads((root / "labelled/train.json").read_text(encoding="utf-8"))
    texts = {turn["text"] for dialog in labelled.values() for turn in dialog["turns"] if turn["role"] == "user"}
    for line in (root / "unlabelled/train.jsonl").read_text(encoding="utf-8").splitlines():
        texts |= {turn["text"] for turn in json.loads(line)["turns"] if turn["role"] == "user"}
    return texts


def test_templates_are_well_formed():
    for domain, intents in INTENTS.items():
        for name, intent in intents.items():
            assert len(intent.pretrain_templates) >= 6 and len(intent.intent_templates("train")) >= 1
            assert len(intent.intent_templates("test")) >= 1, (domain, name)
            assert not set(intent.pretrain_templates) & set(intent.heldout_templates)
            assert not set(intent.intent_templates("train")) & set(intent.intent_templates("test"))
            for template in intent.templates + intent.replies:
                assert all(slot in demo_dialogs.VALUES for slot in demo_dialogs.slots_of(template)), template


def test_build_is_deterministic_and_complete(corpus, tmp_path):
    again = build_dialogs(tmp_path / "again")
    for name in FILES:
        assert (corpus / name).read_bytes() == (again / name).read_bytes(), name
    other_seed = build_dialogs(tmp_path / "seed1", seed=1)
    assert (other_seed / "labelled/train.json").read_bytes() != (corpus / "labelled/train.json").read_bytes()
    assert not list(tmp_path.glob(".*building*"))  # the staging folder was renamed into place


def test_second_call_does_not_rebuild(tmp_path):
    root = build_dialogs(tmp_path / "d", labelled_dialogs=20, unlabelled_dialogs=20, intent_train=10, intent_test=10)
    (root / "labelled/train.json").write_text("{}")
    assert build_dialogs(root) == root
    assert (root / "labelled/train.json").read_text() == "{}"


def test_interrupted_build_is_redone(tmp_path):
    root = tmp_path / "d"
    (root / "labelled").mkdir(parents=True)  # a partial folder without the marker
    build_dialogs(root, labelled_dialogs=20, unlabelled_dialogs=20, intent_train=10, intent_test=10)
    assert (root / COMPLETE_MARKER).exists() and (root / "intent/test.csv").exists()


def test_labelled_dialogs_follow_the_official_format(corpus):
    dialogs = json.loads((corpus / "labelled/train.json").read_text(encoding="utf-8"))
    assert len(dialogs) == 1200
    seen_domains, seen_intents, n_values, n_no_slots, n_default = set(), set(), 0, 0, 0
    for dialog_id, dialog in dialogs.items():
        turns = dialog["turns"]
        assert 1 <= len(turns) <= 4, dialog_id
        for index, turn in enumerate(turns):
            assert turn["turn_id"] == index
            assert turn["role"] == ("user" if index % 2 == 0 else "system")
            assert isinstance(turn["text"], str) and turn["text"]
            label = turn["label"]
            assert isinstance(label, dict) and label
            for domain, intents in label.items():
                assert isinstance(intents, dict) and intents
                n_default += domain == demo_dialogs.DEFAULT_DOMAIN
                seen_domains.add(domain)
                for intent, slots in intents.items():
                    assert isinstance(slots, dict)
                    n_no_slots += turn["role"] == "user" and not slots
                    if turn["role"] == "user":
                        seen_intents.add((domain, intent))
                    for slot, values in slots.items():
                        assert isinstance(values, list)
                        for value in values:
                            assert set(value) == {"value", "span"}
                            start, end = value["span"]
                            assert 0 <= start < end <= len(turn["text"])
                            assert turn["text"][start:end].lower() == str(value["value"]).lower(), (turn, slot)
                            n_values += 1
    assert {"banking", "restaurant", "hotel", "travel", demo_dialogs.DEFAULT_DOMAIN} <= seen_domains
    assert len({pair for pair in seen_intents if pair[0] in INTENTS and pair[1] in INTENTS[pair[0]]}) == sum(
        len(intents) for intents in INTENTS.values()
    )
    assert n_values > 1000 and n_no_slots > 0 and n_default > 0


def test_unlabelled_dialogs_have_no_labels(corpus):
    lines = (corpus / "unlabelled/train.jsonl").read_text(encoding="utf-8").splitlines()
    assert len(lines) == 4000
    ids = set()
    for line in lines:
        dialog = json.loads(line)
        assert set(dialog) == {"id", "turns"}
        ids.add(dialog["id"])
        assert 1 <= len(dialog["turns"]) <= 4
        for index, turn in enumerate(dialog["turns"]):
            assert set(turn) == {"role", "text"}
            assert turn["role"] == ("user" if index % 2 == 0 else "system")
    assert len(ids) == len(lines)


def test_intent_set_is_held_out_and_balanced(corpus):
    train, test = read_csv(corpus / "intent/train.csv"), read_csv(corpus / "intent/test.csv")
    categories = json.loads((corpus / "intent/categories.json").read_text())
    assert categories == sorted(categories) and len(categories) == len(set(categories)) >= 30
    for rows, minimum in ((train, 10), (test, 10)):
        counts = Counter(row["category"] for row in rows)
        assert sorted(counts) == categories
        assert min(counts.values()) >= minimum
    assert min(Counter(row["category"] for row in train).values()) == 30
    assert min(Counter(row["category"] for row in test).values()) == 20
    train_texts, test_texts = {row["text"] for row in train}, {row["text"] for row in test}
    assert len(train_texts) == len(train) and len(test_texts) == len(test) and not train_texts & test_texts
    assert not (train_texts | test_texts) & pretraining_user_texts(corpus)


def test_stats_match_the_files(corpus):
    stats = json.loads((corpus / "stats.json").read_text())
    labelled = json.loads((corpus / "labelled/train.json").read_text(encoding="utf-8"))
    assert stats["labelled_dialogs"] == len(labelled)
    assert stats["labelled_turns"] == sum(len(dialog["turns"]) for dialog in labelled.values())
    assert stats["domains"] == len(INTENTS) >= 5
    assert stats["intents"] == len(json.loads((corpus / "intent/categories.json").read_text()))
