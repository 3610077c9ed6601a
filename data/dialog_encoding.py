"""A dialog example to encoder inputs, as SPACE-2 builds them (spec §5.1-5.4, §6.1).

Per utterance: SPACE-2's word split, BERT WordPiece per word, the last `max_utt_len` pieces, wrapped
in role tokens (`<sos_u> ... <eos_u>` for the user, `<sos_r> ... <eos_r>` otherwise, which SPACE-2
maps onto BERT's `[unused12]`, `[unused6]`, `[unused13]`, `[unused7]`). Positions restart in every
utterance; turn ids count back from the current utterance (1); role ids alternate by distance from
the current utterance. The concatenation keeps its last `max_len` tokens.

MLM inputs: an utterance with labelled value spans has exactly those tokens masked; any other
utterance has 15% of its non-role tokens chosen, 80/10/10 mask/random/kept. The random draw comes
from torch's default generator, which the loader seeds per sample, so a resumed run redraws the same.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

from mmpt.data.dialog import Turn, words
from mmpt.losses.tree_score import MAX_LABEL_ELEMENTS, encode_labels

ROLE_TOKENS = {"sos_u": "[unused12]", "eos_u": "[unused6]", "sos_r": "[unused13]", "eos_r": "[unused7]"}
INPUT_FIELDS = ("input_ids", "positions", "turns", "roles", "mlm_input_ids", "mlm_labels")


def value_texts(turn: Turn) -> list[str]:
    """The labelled value strings of a turn: the spanned text, else the value when it occurs in the text."""
    text, found = turn["text"], []
    for intents in turn.get("label", {}).values():
        for slots in intents.values():
            for values in slots.values():
                for value in values:
                    span = value.get("span") if isinstance(value, dict) else None
                    if span:
                        found.append(text[span[0] : span[1]])
                    else:
                        raw = str(value.get("value", "") if isinstance(value, dict) else value)
                        if raw.strip() and raw.lower() in text.lower():
                            found.append(raw)
    return found


def span_flags(utterance_words: list[str], values: list[str]) -> list[int]:
    """1 for every word inside any occurrence of any value's word sequence, else 0."""
    flags = [0] * len(utterance_words)
    for value in values:
        target = words(value)
        if not target:
            continue
        for start in range(len(utterance_words) - len(target) + 1):
            if utterance_words[start : start + len(target)] == target:
                flags[start : start + len(target)] = [1] * len(target)
    return flags


@dataclass(frozen=True)
class DialogInputSpec:
    max_utt_len: int = 50
    max_turns: int = 16
    max_len: int = 256
    mlm_probability: float = 0.15
    max_label_elements: int = MAX_LABEL_ELEMENTS  # per tree view, in the label's tensor form


class DialogEncoder:
    """Example json -> variable-length tensors of one example; picklable for loader workers.

    `tokenizer` is a Hugging Face BERT-family tokenizer whose vocabulary has the `[unusedN]` slots.
    """

    def __init__(self, tokenizer, spec: DialogInputSpec = DialogInputSpec(), *, with_mlm: bool = True):
        self.tokenizer, self.spec, self.with_mlm = tokenizer, spec, with_mlm
        vocab = tokenizer.get_vocab()
        missing = [t for t in ROLE_TOKENS.values() if t not in vocab]
        if missing:
            raise ValueError(
                f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no {', '.join(missing)} "
                "(SPACE-2's role tokens live in BERT's unused vocabulary slots)"
            )
        self.role_ids = {name: vocab[token] for name, token in ROLE_TOKENS.items()}
        self.mask_id, self.vocab_size = tokenizer.mask_token_id, len(vocab)

    def pieces(self, turn: Turn) -> tuple[list[int], list[int]]:
        """Word-piece ids of one utterance and their span flags, before truncation and role tokens."""
        utterance_words = words(turn["text"])
        flags = span_flags(utterance_words, value_texts(turn))
        encoded = self.tokenizer(utterance_words, add_special_tokens=False)["input_ids"] if utterance_words else []
        ids = [i for word in encoded for i in word]
        piece_flags = [flag for word, flag in zip(encoded, flags) for _ in word]
        if not ids:
            raise ValueError(f"utterance {turn['text']!r} has no tokens")
        return ids, piece_flags

    def encode(self, turns: list[Turn]) -> dict[str, torch.Tensor]:
        """Inputs for a dialog whose last turn is the current one."""
        spec = self.spec
        turns = turns[-spec.max_turns :]
        count = len(turns)
        current_is_user = turns[-1]["role"] == "user"
        fields: dict[str, list[int]] = {name: [] for name in INPUT_FIELDS}
        for t, turn in enumerate(turns, 1):
            ids, flags = self.pieces(turn)
            ids, flags = ids[-spec.max_utt_len :], flags[-spec.max_utt_len :]
            user = turn["role"] == "user"
            ids = [self.role_ids["sos_u" if user else "sos_r"], *ids, self.role_ids["eos_u" if user else "eos_r"]]
            flags = [0, *flags, 0]
            distance = count - t + 1
            fields["input_ids"] += ids
            fields["positions"] += range(len(ids))
            fields["turns"] += [distance] * len(ids)
            fields["roles"] += [int((distance % 2 == 1) == current_is_user)] * len(ids)
            if self.with_mlm:
                masked, labels = self.mask_utterance(ids, flags)
                fields["mlm_input_ids"] += masked
                fields["mlm_labels"] += labels
        names = INPUT_FIELDS if self.with_mlm else INPUT_FIELDS[:4]
        return {name: torch.tensor(fields[name][-spec.max_len :], dtype=torch.long) for name in names}

    def mask_utterance(self, ids: list[int], flags: list[int]) -> tuple[list[int], list[int]]:
        """(MLM input, labels with 0 = not predicted) of one wrapped utterance."""
        if any(flags):
            return ([self.mask_id if f else i for i, f in zip(ids, flags)], [i if f else 0 for i, f in zip(ids, flags)])
        count = len(ids)
        chosen = torch.rand(count) < self.spec.mlm_probability
        chosen[0] = chosen[-1] = False  # the role tokens
        action = torch.rand(count)
        random_ids = torch.randint(1, self.vocab_size, (count,))
        masked, labels = [], []
        for index, token in enumerate(ids):
            if not chosen[index]:
                masked.append(token)
                labels.append(0)
                continue
            labels.append(token)
            if action[index] < 0.8:
                masked.append(self.mask_id)
            elif action[index] < 0.9:
                masked.append(int(random_ids[index]))
            else:
                masked.append(token)
        return masked, labels

    def __call__(self, sample: dict | list) -> dict[str, Any]:
        """A shard sample (`json` field: {"id", "turns", "label"}) to one example's tensors; a list of dialogs
        (each a list of {"role", "text"} turns) to a padded batch."""
        if isinstance(sample, list):
            return collate_dialogs([self.encode(dialog) for dialog in sample])
        raw = sample["json"]
        example = json.loads(raw.decode("utf-8") if isinstance(raw, bytes) else raw)
        try:
            codes = encode_labels([example["label"]], self.spec.max_label_elements)
        except ValueError as exc:
            # skipped and counted like any sample that cannot be decoded, with the key to change
            raise ValueError(f"dialog {example['id']!r}: {exc}; raise method.max_label_elements") from None
        return {
            **self.encode(example["turns"]),
            "label": example["label"],
            "id": example["id"],
            "label_views": codes.views[0],
            "label_frame": codes.frames[0],
        }


def collate_dialogs(examples: list[dict[str, Any]]) -> dict[str, Any]:
    """Right-pad every token field with 0 to the longest example; labels and ids stay lists. With MLM inputs,
    `mlm_positions` [P, 2] lists the predicted tokens in row-major order, found here on the host: on the
    device their number would be a value to read back before the step could size its MLM logits."""
    length = max(len(e["input_ids"]) for e in examples)
    batch: dict[str, Any] = {}
    for name in INPUT_FIELDS:
        if name in examples[0]:
            padded = torch.zeros(len(examples), length, dtype=torch.long)
            for row, example in enumerate(examples):
                padded[row, : len(example[name])] = example[name]
            batch[name] = padded
    batch["attention_mask"] = batch["input_ids"] != 0
    if "mlm_labels" in batch:  # (row, column) of every predicted token: the step gathers them without a host read
        batch["mlm_positions"] = batch["mlm_labels"].nonzero()
    batch["label"] = [e.get("label", {}) for e in examples]
    if "label_views" in examples[0]:  # what the loss scores on the device (`tree_score.LabelCodes`)
        batch["label_views"] = torch.stack([e["label_views"] for e in examples])
        batch["label_frame"] = torch.stack([e["label_frame"] for e in examples])
    batch["id"] = [e.get("id", "") for e in examples]
    return batch
