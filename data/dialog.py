"""Dialog corpora to training examples: SPACE-2's JSON format, DialoGLUE intent CSVs, unlabelled jsonl.

Every reader checks each dialog and skips a malformed one, recording its id, file and reason in a
`DialogReport`, so a bad record costs that record only and is never silent. One example is made per
turn of the triggered role with its history, as SPACE-2's `build_examples_multi_turn` does, and
examples are written to WebDataset shards as one `json` field each; tokenisation happens when a
shard is read (`mmpt.data.dialog_encoding`), so one shard set serves any tokenizer.
"""

from __future__ import annotations

import csv
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mmpt.data.shards import DataError, MissingDataError, ShardSetWriter
from mmpt.losses.tree_score import fix_label

ROLES = ("user", "system")
WORD_SPLIT = re.compile(r"(\W+)")
Turn = dict[str, Any]


def words(text: str) -> list[str]:
    """SPACE-2's pre-tokenisation: lower-case, split on runs of non-word characters, keep them, drop blanks."""
    return [piece.strip() for piece in WORD_SPLIT.split(text.lower()) if piece.strip()]


@dataclass
class DialogReport:
    """What a conversion kept and what it skipped (file, dialog id, reason)."""

    dialogs: int = 0
    examples: int = 0
    skipped: list[tuple[str, str, str]] = field(default_factory=list)

    def skip(self, file: str | Path, dialog_id: str, reason: str) -> None:
        self.skipped.append((str(file), str(dialog_id), reason))

    def skip_rate(self) -> float:
        """Skipped dialogs (or intent rows) as a fraction of all read."""
        read = self.dialogs + len(self.skipped)
        return len(self.skipped) / read if read else 0.0

    def commonest_reason(self) -> str:
        """The most frequent skip reason, its variable parts (names, numbers) left in."""
        reasons = [reason for _, _, reason in self.skipped]
        return max(set(reasons), key=reasons.count) if reasons else ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "dialogs": self.dialogs,
            "examples": self.examples,
            "skipped": len(self.skipped),
            "skipped_records": [{"file": f, "id": i, "reason": r} for f, i, r in self.skipped],
        }


# ----------------------------------------------------------------------------- checking


def check_label(label: Any, text: str) -> None:
    """Raise ValueError naming what is wrong with a frame {domain: {intent: {slot: [{"value", "span"}]}}}."""
    if not isinstance(label, dict):
        raise ValueError(f"label must be a mapping, got {type(label).__name__}")
    for domain, intents in label.items():
        if not isinstance(intents, dict):
            raise ValueError(f"label[{domain!r}] must map intents to slots, got {type(intents).__name__}")
        for intent, slots in intents.items():
            if not isinstance(slots, dict):
                raise ValueError(f"label[{domain!r}][{intent!r}] must map slots to values, got {type(slots).__name__}")
            for slot, values in slots.items():
                where = f"label[{domain!r}][{intent!r}][{slot!r}]"
                if not isinstance(values, list):
                    raise ValueError(f"{where} must be a list of values, got {type(values).__name__}")
                for value in values:
                    _check_value(value, text, where)


def _check_value(value: Any, text: str, where: str) -> None:
    if not isinstance(value, dict) or "value" not in value or "span" not in value:
        example = f'{{"value": {json.dumps(value, ensure_ascii=False)}, "span": null}}'
        raise ValueError(
            f"{where}: every value must be an object with 'value' and 'span' (null when the text has "
            f"no span for it), e.g. {example}, got {value!r}"
        )
    if not isinstance(value["value"], (str, int, float)):
        raise ValueError(f"{where}: value must be a string or number, got {value['value']!r}")
    span = value["span"]
    if span:
        ok = (
            isinstance(span, list)
            and len(span) == 2
            and all(isinstance(i, int) for i in span)
            and 0 <= span[0] < span[1] <= len(text)
        )
        if not ok:
            raise ValueError(f"{where}: span {span!r} is not [start, end) inside a text of {len(text)} characters")


def check_turn(turn: Any, *, labelled: bool) -> Turn:
    """The turn reduced to role/text/label, or ValueError saying what is wrong."""
    if not isinstance(turn, dict):
        raise ValueError(f"a turn must be an object, got {type(turn).__name__}")
    if turn.get("role") not in ROLES:
        raise ValueError(f"turn role must be one of {ROLES}, got {turn.get('role')!r}")
    if not isinstance(turn.get("text"), str):
        raise ValueError(f"turn text must be a string, got {turn.get('text')!r}")
    label = turn.get("label", {}) if labelled else {}
    if labelled and "label" not in turn:
        raise ValueError("a labelled turn has no 'label' (use {} for an unlabelled turn)")
    check_label(label, turn["text"])
    return {"role": turn["role"], "text": turn["text"], "label": label}


def _checked_turns(turns: Any, *, labelled: bool) -> list[Turn]:
    if not isinstance(turns, list) or not turns:
        raise ValueError("'turns' must be a non-empty list")
    checked = []
    for index, turn in enumerate(turns):
        try:
            checked.append(check_turn(turn, labelled=labelled))
        except ValueError as exc:
            raise ValueError(f"turn {index}: {exc}") from None
    return checked


# ----------------------------------------------------------------------------- reading


def read_space2_json(path: str | Path, report: DialogReport, labelled: bool = True) -> Iterator[tuple[str, list[Turn]]]:
    """Dialogs of an official SPACE-2 file: {dialog id: {"turns": [{role, text, label, ...}]}} (AnPreDial; with
    `labelled=False`, UnPreDial's files of the same layout, their labels left out)."""
    path = Path(path)
    if not path.is_file():
        raise MissingDataError(f"{path}: no such SPACE-2 dialog file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"{path}: cannot read a SPACE-2 dialog file: {exc}") from None
    if not isinstance(data, dict):
        raise DataError(f"{path}: top level must map dialog ids to dialogs, got {type(data).__name__}")
    for dialog_id, dialog in data.items():
        try:
            if not isinstance(dialog, dict):
                raise ValueError(f"a dialog must be an object with 'turns', got {type(dialog).__name__}")
            turns = _checked_turns(dialog.get("turns"), labelled=labelled)
        except ValueError as exc:
            report.skip(path, dialog_id, str(exc))
            continue
        yield str(dialog_id), turns


def read_unlabelled(path: str | Path, report: DialogReport) -> Iterator[tuple[str, list[Turn]]]:
    """Unlabelled dialogs of a `.jsonl` file (`read_unlabelled_jsonl`) or of an UnPreDial `.json` file."""
    if Path(path).suffix == ".json":
        return read_space2_json(path, report, labelled=False)
    return read_unlabelled_jsonl(path, report)


def read_unlabelled_jsonl(path: str | Path, report: DialogReport) -> Iterator[tuple[str, list[Turn]]]:
    """Unlabelled dialogs, one per line: {"id": ..., "turns": [{"role", "text"}, ...]}; ids default to line numbers."""
    path = Path(path)
    if not path.is_file():
        raise MissingDataError(f"{path}: no such dialog file")
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            dialog_id = f"line {number}"
            try:
                record = json.loads(line)
                if not isinstance(record, dict):
                    raise ValueError(f"a line must be an object with 'turns', got {type(record).__name__}")
                dialog_id = str(record.get("id", dialog_id))
                turns = _checked_turns(record.get("turns"), labelled=False)
            except (ValueError, json.JSONDecodeError) as exc:
                report.skip(path, dialog_id, str(exc))
                continue
            yield dialog_id, turns


def read_intent_csv(path: str | Path, report: DialogReport | None = None) -> list[tuple[str, str]]:
    """(text, category) rows of a DialoGLUE-style intent file with a `text,category` header."""
    path = Path(path)
    report = report or DialogReport()
    with path.open(encoding="utf-8", newline="") as handle:
        reader = csv.DictReader(handle)
        missing = {"text", "category"} - set(reader.fieldnames or [])
        if reader.fieldnames is None:
            raise DataError(f"{path} is empty (expected a text,category header and rows)")
        if missing:
            raise DataError(f"{path}: intent CSV needs columns text and category; missing {', '.join(sorted(missing))}")
        rows = []
        for number, row in enumerate(reader, 2):
            text, category = (row.get("text") or "").strip(), (row.get("category") or "").strip()
            if not text or not category:
                report.skip(path, f"line {number}", "empty text or category")
                continue
            rows.append((text, category))
    return rows


def intent_dialogs(rows: Iterable[tuple[str, str]], prefix: str) -> Iterator[tuple[str, list[Turn]]]:
    """Intent rows as one-turn labelled dialogs, labelled as SPACE-2 does: {"DEFAULT_DOMAIN": {intent: {}}}."""
    for index, (text, category) in enumerate(rows):
        yield f"{prefix}-{index}", [{"role": "user", "text": text, "label": {"DEFAULT_DOMAIN": {category: {}}}}]


# ----------------------------------------------------------------------------- examples


def dialog_examples(
    dialog_id: str, turns: list[Turn], *, trigger_role: str = "user", max_turns: int = 16
) -> Iterator[dict[str, Any]]:
    """One example per turn whose role is a substring of `trigger_role` ("user", "user_system").

    An example holds the last `max_turns` turns up to and including its own and `fix_label` of its
    own label. It is dropped (ValueError) when any utterance of its history has no words.
    """
    for index, turn in enumerate(turns):
        if turn["role"] not in trigger_role:
            continue
        history = turns[: index + 1]
        empty = [i for i, t in enumerate(history) if not words(t["text"])]
        if empty:
            raise ValueError(f"turn {empty[0]} has no words")
        yield {
            "id": f"{dialog_id}#{index}",
            "turns": [dict(t) for t in history[-max_turns:]],
            "label": fix_label(turn["label"]),
        }


def write_examples(
    dialogs: Iterable[tuple[str, str, list[Turn]]],
    prefix: str | Path,
    report: DialogReport,
    *,
    trigger_role: str = "user",
    max_turns: int = 16,
    shard_size: int = 2000,
) -> DialogReport:
    """Examples of (file, dialog id, turns) into shards `{prefix}-000000.tar`, ...; a dialog with an unusable
    turn is skipped and recorded."""
    with ShardSetWriter(prefix, max_samples=shard_size) as writer:
        for file, dialog_id, turns in dialogs:
            try:
                examples = list(dialog_examples(dialog_id, turns, trigger_role=trigger_role, max_turns=max_turns))
            except ValueError as exc:
                report.skip(file, dialog_id, str(exc))
                continue
            report.dialogs += 1
            for example in examples:
                example["source"] = file
                key = re.sub(r"[^A-Za-z0-9_-]", "_", example["id"])  # tar member names: no dots or slashes
                writer.write({"__key__": f"{report.examples:08d}_{key}"[:120], "json": json.dumps(example)})
                report.examples += 1
    return report


def write_dialog_shards(
    out_dir: str | Path,
    *,
    labelled: Iterable[str | Path] = (),
    unlabelled: Iterable[str | Path] = (),
    intent: Iterable[str | Path] = (),
    trigger_role: str = "user",
    max_turns: int = 16,
    shard_size: int = 2000,
) -> dict[str, DialogReport]:
    """Shard sets `labelled-*.tar` (SPACE-2 json files and intent CSVs) and `unlabelled-*.tar` (jsonl dialogs, or
    UnPreDial json files); a missing input file is a `MissingDataError` before anything is written.

    Writes `report.json` beside them with the counts and every skipped record.
    """
    labelled, unlabelled, intent = list(labelled), list(unlabelled), list(intent)
    for path in [*labelled, *intent, *unlabelled]:  # all of them, before anything is written
        if not Path(path).is_file():
            raise MissingDataError(f"{path}: no such dialog file")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    reports: dict[str, DialogReport] = {}

    def labelled_dialogs(report: DialogReport) -> Iterator[tuple[str, str, list[Turn]]]:
        for path in labelled:
            yield from ((str(path), i, t) for i, t in read_space2_json(path, report))
        for path in intent:
            yield from ((str(path), i, t) for i, t in intent_dialogs(read_intent_csv(path, report), Path(path).stem))

    def unlabelled_dialogs(report: DialogReport) -> Iterator[tuple[str, str, list[Turn]]]:
        for path in unlabelled:
            yield from ((str(path), i, t) for i, t in read_unlabelled(path, report))

    for name, dialogs in (("labelled", labelled_dialogs), ("unlabelled", unlabelled_dialogs)):
        report = DialogReport()
        write_examples(
            dialogs(report),
            out_dir / name,
            report,
            trigger_role=trigger_role,
            max_turns=max_turns,
            shard_size=shard_size,
        )
        reports[name] = report
    (out_dir / "report.json").write_text(json.dumps({k: r.to_dict() for k, r in reports.items()}, indent=2))
    return reports
