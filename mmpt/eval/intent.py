"""Intent classification on a dialog encoder: a linear probe and full fine-tuning, full data and k-shot.

Utterances are encoded as one-turn user dialogs. Two protocols:
- the linear probe (mmpt's cheap check): the encoder frozen, a multinomial logistic-regression head
  on its L2-normalised dialog vector, trained on the training split or on k examples per intent
  drawn with each seed;
- full fine-tuning (how SPACE-2 and DialoGLUE report intent accuracy): the whole encoder and a
  linear head on the CLS state trained with cross-entropy on a copy of the model; the test accuracy
  at the epoch of best validation accuracy when `val.csv` exists, else after the last epoch.
Both score accuracy on the test split. DialoGLUE's intent folders (BANKING77, CLINC150, HWU64:
`train.csv`, `val.csv`, `test.csv`, `train_10.csv`, columns text,category) read as they are; a
`train_<k>.csv` is the fixed k-shot split the benchmark prescribes, used instead of random draws.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.linear_model import LogisticRegression
from torch import nn

from mmpt.data.dialog import read_intent_csv
from mmpt.data.dialog_encoding import collate_dialogs
from mmpt.data.shards import MissingDataError


def resolve_intent_dataset(name_or_path: str, data_root: str = "demo_data") -> Path:
    """A directory with train.csv and test.csv, or 'dialogs' for the demo corpus's held-out intents."""
    if name_or_path == "dialogs" and not Path(name_or_path).exists():
        from mmpt.demo.dialogs import build_dialogs  # the dialogs and intent sets, without training shards

        return build_dialogs(Path(data_root) / "dialogs") / "intent"
    path = Path(name_or_path)
    for split in ("train.csv", "test.csv"):
        if not (path / split).is_file():
            raise MissingDataError(f"intent dataset {path}: {split} is missing (expected train.csv and test.csv)")
    return path


@torch.no_grad()
def embed_utterances(model, encoder, texts: list[str], batch_size: int = 64) -> np.ndarray:
    """Normalised dialog vectors of one-turn user dialogs, in order."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    parts = []
    for start in range(0, len(texts), batch_size):
        parts.append(
            model.encode_dialog(dialog_batch(encoder, texts[start : start + batch_size], device)).float().cpu().numpy()
        )
    model.train(was_training)
    return np.concatenate(parts)


def kshot_indices(labels: list[str], k: int, seed: int) -> list[int]:
    """k indices per label (all of a label's when it has fewer), drawn with `seed`."""
    rng = random.Random(seed)
    by_label: dict[str, list[int]] = {}
    for index, label in enumerate(labels):
        by_label.setdefault(label, []).append(index)
    chosen = [i for label in sorted(by_label) for i in rng.sample(by_label[label], min(k, len(by_label[label])))]
    return sorted(chosen)


def linear_head_accuracy(
    train_x: np.ndarray, train_y: list[str], test_x: np.ndarray, test_y: list[str], seed: int
) -> float:
    head = LogisticRegression(C=10.0, max_iter=3000, random_state=seed)
    head.fit(train_x, train_y)
    return float(np.mean(head.predict(test_x) == np.array(test_y)))


def dialog_batch(encoder, texts: list[str], device: torch.device) -> dict[str, Any]:
    examples = [encoder.encode([{"role": "user", "text": text, "label": {}}]) for text in texts]
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in collate_dialogs(examples).items()}


@dataclass
class FineTuning:
    epochs: int = 5
    lr: float = 3e-5  # the encoder's
    head_lr: float = 1e-3
    batch_size: int = 32


def finetune_accuracy(
    model,
    encoder,
    train: list[tuple[str, str]],
    test: list[tuple[str, str]],
    val: list[tuple[str, str]] | None,
    settings: FineTuning,
    seed: int = 0,
) -> float:
    """Test accuracy of a copy of `model` fine-tuned whole, with a linear head on its CLS state."""
    torch.manual_seed(seed)
    device = next(model.parameters()).device
    tuned = copy.deepcopy(model).train()
    intents = sorted({c for _, c in train})
    index = {c: i for i, c in enumerate(intents)}
    hidden = tuned.dialog_vector(dialog_batch(encoder, [train[0][0]], device)).shape[-1]
    head = nn.Linear(hidden, len(intents)).to(device)
    optimizer = torch.optim.AdamW(
        [{"params": tuned.parameters(), "lr": settings.lr}, {"params": head.parameters(), "lr": settings.head_lr}],
        weight_decay=0.01,
    )

    @torch.no_grad()
    def accuracy(rows: list[tuple[str, str]]) -> float:
        tuned.eval()
        right = 0
        for start in range(0, len(rows), 64):
            part = rows[start : start + 64]
            predicted = head(tuned.dialog_vector(dialog_batch(encoder, [t for t, _ in part], device))).argmax(-1)
            right += sum(intents[p] == c for p, (_, c) in zip(predicted.tolist(), part))
        tuned.train()
        return right / len(rows)

    generator = random.Random(seed)
    best_val, result = -1.0, 0.0
    for _ in range(settings.epochs):
        order = list(range(len(train)))
        generator.shuffle(order)
        for start in range(0, len(order), settings.batch_size):
            part = [train[i] for i in order[start : start + settings.batch_size]]
            logits = head(tuned.dialog_vector(dialog_batch(encoder, [t for t, _ in part], device)))
            loss = F.cross_entropy(logits, torch.tensor([index[c] for _, c in part], device=device))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        score = accuracy(val) if val else 0.0
        if val is None or score > best_val:
            best_val, result = score, accuracy(test)
    return result


def intent_classification(
    model,
    encoder,
    data_dir: str | Path,
    *,
    shots: list[int],
    full: bool = True,
    seeds: int = 3,
    batch_size: int = 64,
    finetune: FineTuning | None = None,
) -> dict[str, Any]:
    """Linear-probe accuracies (full data and each k-shot setting) and, with `finetune`, the same settings
    fully fine-tuned (one run per setting: fine-tuning is the costly protocol)."""
    data_dir = Path(data_dir)
    train = read_intent_csv(data_dir / "train.csv")
    test = read_intent_csv(data_dir / "test.csv")
    val = read_intent_csv(data_dir / "val.csv") if (data_dir / "val.csv").is_file() else None
    train_x = embed_utterances(model, encoder, [t for t, _ in train], batch_size)
    test_x = embed_utterances(model, encoder, [t for t, _ in test], batch_size)
    train_y, test_y = [c for _, c in train], [c for _, c in test]
    metrics: dict[str, float] = {}
    runs: dict[str, list[float]] = {}
    splits: dict[str, str] = {}
    if full:
        metrics["full/accuracy"] = linear_head_accuracy(train_x, train_y, test_x, test_y, seed=0)
        if finetune:
            metrics["full/finetuned_accuracy"] = finetune_accuracy(model, encoder, train, test, val, finetune)
    for k in shots:
        fixed = data_dir / f"train_{k}.csv"
        if fixed.is_file():  # the benchmark's own k-shot split
            rows = read_intent_csv(fixed)
            draws = [rows]
            splits[f"{k}shot"] = fixed.name
        else:
            short = sorted(c for c in set(train_y) if train_y.count(c) <= k)
            if len(short) == len(set(train_y)):  # every draw would be the whole training split: one run
                draws = [train]
                splits[f"{k}shot"] = f"all of train.csv: no intent has more than {k} examples"
            else:
                draws = [[train[i] for i in kshot_indices(train_y, k, seed)] for seed in range(seeds)]
                splits[f"{k}shot"] = (
                    f"{seeds} random draw{'s' if seeds > 1 else ''} of {k} per intent from train.csv"
                    + (
                        f" ({len(short)} of {len(set(train_y))} intents have {k} or fewer: all of theirs)"
                        if short
                        else ""
                    )
                )
        scores = []
        for seed, rows in enumerate(draws):
            x = embed_utterances(model, encoder, [t for t, _ in rows], batch_size)
            scores.append(linear_head_accuracy(x, [c for _, c in rows], test_x, test_y, seed))
        runs[f"{k}shot"] = scores
        metrics[f"{k}shot/accuracy_mean"] = float(np.mean(scores))
        metrics[f"{k}shot/accuracy_std"] = float(np.std(scores))
        if finetune:
            metrics[f"{k}shot/finetuned_accuracy"] = finetune_accuracy(model, encoder, draws[0], test, val, finetune)
    return {
        "dataset": str(data_dir),
        "task": "intent_classification",
        "intents": len(set(train_y)),
        "train": len(train),
        "test": len(test),
        "metrics": metrics,
        "runs": runs,
        "kshot_splits": splits,
        "protocols": {
            "accuracy": "linear probe on the frozen encoder",
            **(
                {
                    "finetuned_accuracy": "whole encoder + linear head fine-tuned"
                    + (", test accuracy at the best validation epoch" if val else ", after the last epoch")
                }
                if finetune
                else {}
            ),
        },
    }
