"""The demo dialog corpus: generated English task-oriented dialogs labelled with SPACE-2 semantic trees.

Six domains (banking, restaurant, hotel, travel, taxi, weather) and 31 user intents are rendered from paraphrase
templates whose slot placeholders are filled with values, so every slot value has an exact character span. Turn
labels are frames `{domain: {intent_or_act: {slot: [{"value", "span"}]}}}` (greetings and thanks sit under
`DEFAULT_DOMAIN`, bare answers under `DEFAULT_INTENT`), written in the official SPACE-2 format.

Every intent's ten templates are split: the first six render the pre-training dialogs (`labelled/train.json`,
`unlabelled/train.jsonl`), the last four only the DialoGLUE-style intent classification set (`intent/*.csv`), two
for its train split and two for its test split. Test utterances thus have surface forms seen neither in
pre-training nor in few-shot fine-tuning, so accuracy measures how well the learned intent structure transfers,
not recall of memorised sentences or templates. Intents share slots (date, time, city, people) and wording (book,
change and cancel a booking in several domains) so keywords alone do not solve the task.

Deterministic (a seeded `random.Random`, no set iteration): two builds are byte-identical. Nothing is downloaded.
"""

from __future__ import annotations

import csv
import io
import json
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import yaml

from mmpt.demo import register
from mmpt.demo.corpus import COMPLETE_MARKER, fresh_staging, is_built, mark_complete, publish

DEFAULT_DOMAIN = "DEFAULT_DOMAIN"
DEFAULT_INTENT = "DEFAULT_INTENT"
HELDOUT_TEMPLATES = 4  # the last four of every intent's ten templates: two for intent train, two for intent test


@dataclass(frozen=True)
class Intent:
    """Paraphrase templates (pre-training first, the last `HELDOUT_TEMPLATES` held out), the slots the system asks
    for when the user left them out, and the system's inform replies."""

    templates: tuple[str, ...]
    asks: tuple[str, ...] = ()
    replies: tuple[str, ...] = ()

    @property
    def pretrain_templates(self) -> tuple[str, ...]:
        return self.templates[:-HELDOUT_TEMPLATES]

    @property
    def heldout_templates(self) -> tuple[str, ...]:
        return self.templates[-HELDOUT_TEMPLATES:]

    def intent_templates(self, split: str) -> tuple[str, ...]:
        """The held-out templates of the intent classification `split` ("train" or "test"): disjoint halves."""
        half = HELDOUT_TEMPLATES // 2
        return self.heldout_templates[:half] if split == "train" else self.heldout_templates[half:]


def _load_vocabulary(path: Path) -> tuple[dict, dict, dict, dict, dict]:
    """Slot values, intents, requests, answers and domain-less turns, as `dialog_templates.yaml` writes them."""
    tables = yaml.safe_load(path.read_text(encoding="utf-8"))
    intents = {
        domain: {name: Intent(tuple(t["templates"]), tuple(t["asks"]), tuple(t["replies"])) for name, t in g.items()}
        for domain, g in tables["intents"].items()
    }
    general = {(turn["role"], turn["act"]): turn["texts"] for turn in tables["general"]}
    return tables["values"], intents, tables["requests"], tables["answers"], general


VALUES: dict[str, list[str]]
INTENTS: dict[str, dict[str, Intent]]  # domain -> intent
REQUESTS: dict[str, list[str]]  # the system's request for a missing slot
ANSWERS: dict[str, list[str]]  # the user's answer to it
GENERAL: dict[tuple[str, str], list[str]]  # turns with no domain: (role, act) -> texts
VALUES, INTENTS, REQUESTS, ANSWERS, GENERAL = _load_vocabulary(Path(__file__).with_name("dialog_templates.yaml"))

_PLACEHOLDER = re.compile(r"\{(\w+)\}")


def categories() -> list[str]:
    """Intent classification labels, `<domain>_<intent>`, sorted."""
    return sorted(f"{domain}_{name}" for domain, intents in INTENTS.items() for name in intents)


def slots_of(template: str) -> list[str]:
    return _PLACEHOLDER.findall(template)


def fill(template: str, values: dict[str, str]) -> tuple[str, dict[str, list[dict]]]:
    """Render `template` with `values`; returns the text and `{slot: [{"value", "span": [start, end)}]}`."""
    pieces: list[str] = []
    slots: dict[str, list[dict]] = {}
    cursor = position = 0
    for match in _PLACEHOLDER.finditer(template):
        literal = template[cursor : match.start()]
        value = values[match.group(1)]
        start = position + len(literal)
        pieces += [literal, value]
        slots.setdefault(match.group(1), []).append({"value": value, "span": [start, start + len(value)]})
        position = start + len(value)
        cursor = match.end()
    pieces.append(template[cursor:])
    return "".join(pieces), slots


def _draw(rng: random.Random, slot: str, state: dict[str, str]) -> str:
    """A value for `slot`, different from values already used in the dialog (from and to are never equal)."""
    taken = set(state.values())
    choices = [value for value in VALUES[slot] if value not in taken] or VALUES[slot]
    return rng.choice(choices)


def _render(rng: random.Random, template: str, state: dict[str, str]) -> tuple[str, dict[str, list[dict]]]:
    """Fill `template`, reusing values the dialog already has and drawing (and remembering) the others."""
    for slot in slots_of(template):
        if slot not in state:
            state[slot] = _draw(rng, slot, state)
    return fill(template, state)


def _turn(role: str, text: str, label: dict) -> dict:
    return {"role": role, "text": text, "label": label}


def _general(rng: random.Random, role: str, act: str) -> dict:
    return _turn(role, rng.choice(GENERAL[(role, act)]), {DEFAULT_DOMAIN: {act: {}}})


def _dialog(rng: random.Random, goals: list[tuple[str, str]]) -> list[dict]:
    """One dialog of 1-4 turns, user first, rendered from pre-training templates only."""
    domain, name = rng.choice(goals)
    intent = INTENTS[domain][name]
    state: dict[str, str] = {}
    script: list[dict] = []
    greeting = rng.random() < 0.1
    if greeting:
        script += [_general(rng, "user", "greet"), _general(rng, "system", "greet")]
    text, slots = _render(rng, rng.choice(intent.pretrain_templates), state)
    script.append(_turn("user", text, {domain: {name: slots}}))
    missing = [slot for slot in intent.asks if slot not in state]
    if missing:
        slot = missing[0]
        script.append(_turn("system", rng.choice(REQUESTS[slot]), {domain: {"request": {slot: []}}}))
        state[slot] = _draw(rng, slot, state)
        if rng.random() < 0.2:  # a bare value: the slot is known, the intent is not annotated
            text, slots = fill(f"{{{slot}}}", state)
            script.append(_turn("user", text, {domain: {DEFAULT_INTENT: slots}}))
        else:
            text, slots = fill(rng.choice(ANSWERS[slot]), state)
            script.append(_turn("user", text, {domain: {name: slots}}))
        text, slots = _render(rng, rng.choice(intent.replies), state)
        script.append(_turn("system", text, {domain: {"inform": slots}}))
    else:
        text, slots = _render(rng, rng.choice(intent.replies), state)
        script.append(_turn("system", text, {domain: {"inform": slots}}))
        closing = rng.choice(["thank", "thank", "bye"])
        script.append(_general(rng, "user", closing))
        script.append(_general(rng, "system", "welcome" if closing == "thank" else "bye"))
    length = rng.choice([3, 4]) if greeting else rng.choice([1, 2, 2, 3, 3, 4, 4, 4])
    return [{"turn_id": turn_id, **turn} for turn_id, turn in enumerate(script[:length])]


def _goals() -> list[tuple[str, str]]:
    return [(domain, name) for domain, intents in INTENTS.items() for name in intents]


def _intent_examples(rng: random.Random, sizes: dict[str, int], seen: set[str]) -> dict[str, list[list[str]]]:
    """`{split: rows}` of `[text, category]` rendered from the split's held-out templates with fresh values: unique,
    and never the text of a pre-training user turn (`seen`)."""
    out: dict[str, list[list[str]]] = {split: [] for split in sizes}
    for domain, name in _goals():
        category, intent = f"{domain}_{name}", INTENTS[domain][name]
        for split, size in sizes.items():
            templates = intent.intent_templates(split)
            texts: list[str] = []
            known: set[str] = set()
            for _ in range(50 * size):
                if len(texts) == size:
                    break
                text, _slots = _render(rng, rng.choice(templates), {})
                if text not in known and text not in seen:
                    known.add(text)
                    texts.append(text)
            out[split] += [[text, category] for text in texts]
    return out


def _csv(rows: list[list[str]]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["text", "category"])
    writer.writerows(rows)
    return buffer.getvalue()


def build_dialogs(
    root: str | os.PathLike,
    seed: int = 0,
    *,
    labelled_dialogs: int = 1200,
    unlabelled_dialogs: int = 4000,
    intent_train: int = 30,
    intent_test: int = 20,
) -> Path:
    """Build the corpus at `root` unless already complete; safe when several ranks race to build it.

    Layout: `labelled/train.json` (official SPACE-2 format), `unlabelled/train.jsonl` (`{"id", "turns": [{"role",
    "text"}]}` lines), `intent/{train,test}.csv` (`text,category`) with `intent/categories.json`, `stats.json`.
    """
    root = Path(root)
    if is_built(root):
        return root
    staging = fresh_staging(root)
    goals = _goals()

    labelled_rng = random.Random(f"demo-dialogs-labelled-{seed}")
    labelled = {f"lab-{index:05d}": {"turns": _dialog(labelled_rng, goals)} for index in range(labelled_dialogs)}
    unlabelled_rng = random.Random(f"demo-dialogs-unlabelled-{seed}")
    unlabelled = [
        {
            "id": f"unl-{index:05d}",
            "turns": [{"role": t["role"], "text": t["text"]} for t in _dialog(unlabelled_rng, goals)],
        }
        for index in range(unlabelled_dialogs)
    ]

    seen = {turn["text"] for dialog in labelled.values() for turn in dialog["turns"] if turn["role"] == "user"}
    seen |= {turn["text"] for dialog in unlabelled for turn in dialog["turns"] if turn["role"] == "user"}
    sizes = {"train": intent_train, "test": intent_test}
    intent = _intent_examples(random.Random(f"demo-dialogs-intent-{seed}"), sizes, seen)

    (staging / "labelled").mkdir(parents=True)
    (staging / "unlabelled").mkdir()
    (staging / "intent").mkdir()
    (staging / "labelled" / "train.json").write_text(json.dumps(labelled, ensure_ascii=False) + "\n", encoding="utf-8")
    (staging / "unlabelled" / "train.jsonl").write_text(
        "".join(json.dumps(dialog, ensure_ascii=False) + "\n" for dialog in unlabelled), encoding="utf-8"
    )
    for split, rows in intent.items():
        (staging / "intent" / f"{split}.csv").write_text(_csv(rows), encoding="utf-8")
    (staging / "intent" / "categories.json").write_text(json.dumps(categories(), indent=1) + "\n", encoding="utf-8")
    stats = {
        "domains": len(INTENTS),
        "intents": len(goals),
        "labelled_dialogs": len(labelled),
        "labelled_turns": sum(len(dialog["turns"]) for dialog in labelled.values()),
        "unlabelled_dialogs": len(unlabelled),
        "unlabelled_turns": sum(len(dialog["turns"]) for dialog in unlabelled),
        "intent_train": len(intent["train"]),
        "intent_test": len(intent["test"]),
        "pretrain_templates": sum(len(INTENTS[d][n].pretrain_templates) for d, n in goals),
        "heldout_templates": sum(len(INTENTS[d][n].heldout_templates) for d, n in goals),
        "seed": seed,
    }
    (staging / "stats.json").write_text(json.dumps(stats, indent=1) + "\n", encoding="utf-8")
    mark_complete(
        staging,
        f"{stats['labelled_dialogs']} labelled, {stats['unlabelled_dialogs']} unlabelled dialogs, "
        f"{stats['intents']} intents",
    )
    if root.is_dir() and any(root.iterdir()) and not is_built(root):
        _replace_outputs(staging, root)  # a partial corpus from an interrupted build: overwrite its outputs
        return root
    return publish(staging, root)


def _replace_outputs(staging: Path, root: Path) -> None:
    """Move the staged outputs over those in `root`, the marker last; other files in `root` are left alone."""
    for child in sorted(staging.iterdir()):
        if child.name == COMPLETE_MARKER:
            continue
        target = root / child.name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        os.replace(child, target)
    os.replace(staging / COMPLETE_MARKER, root / COMPLETE_MARKER)
    staging.rmdir()


@register("dialogs")
def build_dialog_shards(root: str | os.PathLike, seed: int = 0) -> Path:
    """The corpus at `root` plus its training shards in `root/shards` (labelled-*.tar, unlabelled-*.tar)."""
    from mmpt.data.dialog import write_dialog_shards

    root = build_dialogs(root, seed)
    shards = root / "shards"
    if not (shards / COMPLETE_MARKER).is_file():
        shutil.rmtree(shards, ignore_errors=True)
        write_dialog_shards(
            shards,
            labelled=[root / "labelled" / "train.json"],
            unlabelled=[root / "unlabelled" / "train.jsonl"],
            shard_size=1000,
        )
        (shards / COMPLETE_MARKER).write_text("")
    return root
