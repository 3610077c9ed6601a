"""Intent classification with a linear head on a dialog encoder: full data and k-shot.

Utterances are encoded as one-turn user dialogs and represented by the encoder's L2-normalised
dialog vector; a multinomial logistic-regression head (the linear head) is trained on the training
split, or on k examples per intent drawn with each seed, and scored by accuracy on the test split.
The encoder stays frozen: this measures the representation pretraining produced, cheaply enough to
average several k-shot draws.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from sklearn.linear_model import LogisticRegression

from mmpt.data.dialog import read_intent_csv
from mmpt.data.dialog_encoding import collate_dialogs
from mmpt.data.shards import DataError


def resolve_intent_dataset(name_or_path: str, data_root: str = "demo_data") -> Path:
    """A directory with train.csv and test.csv, or 'dialogs' for the demo corpus's held-out intents."""
    if name_or_path == "dialogs" and not Path(name_or_path).exists():
        from mmpt.data.demo_dialogs import build_dialogs

        return build_dialogs(Path(data_root) / "dialogs") / "intent"
    path = Path(name_or_path)
    for split in ("train.csv", "test.csv"):
        if not (path / split).is_file():
            raise DataError(f"intent dataset {path}: {split} is missing (expected train.csv and test.csv)")
    return path


@torch.no_grad()
def embed_utterances(model, encoder, texts: list[str], batch_size: int = 64) -> np.ndarray:
    """Normalised dialog vectors of one-turn user dialogs, in order."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    parts = []
    for start in range(0, len(texts), batch_size):
        examples = [encoder.encode([{"role": "user", "text": text, "label": {}}]) for text in texts[start:start + batch_size]]
        batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in collate_dialogs(examples).items()}
        parts.append(model.encode_dialog(batch).float().cpu().numpy())
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


def linear_head_accuracy(train_x: np.ndarray, train_y: list[str], test_x: np.ndarray, test_y: list[str],
                         seed: int) -> float:
    head = LogisticRegression(C=10.0, max_iter=3000, random_state=seed)
    head.fit(train_x, train_y)
    return float((head.predict(test_x) == np.array(test_y)).mean())


def intent_classification(model, encoder, data_dir: str | Path, *, shots: list[int], full: bool = True,
                          seeds: int = 3, batch_size: int = 64) -> dict[str, Any]:
    data_dir = Path(data_dir)
    train = read_intent_csv(data_dir / "train.csv")
    test = read_intent_csv(data_dir / "test.csv")
    train_x = embed_utterances(model, encoder, [t for t, _ in train], batch_size)
    test_x = embed_utterances(model, encoder, [t for t, _ in test], batch_size)
    train_y, test_y = [c for _, c in train], [c for _, c in test]
    metrics: dict[str, float] = {}
    runs: dict[str, list[float]] = {}
    if full:
        metrics["full/accuracy"] = linear_head_accuracy(train_x, train_y, test_x, test_y, seed=0)
    for k in shots:
        scores = []
        for seed in range(seeds):
            chosen = kshot_indices(train_y, k, seed)
            scores.append(linear_head_accuracy(train_x[chosen], [train_y[i] for i in chosen], test_x, test_y, seed))
        runs[f"{k}shot"] = scores
        metrics[f"{k}shot/accuracy_mean"] = float(np.mean(scores))
        metrics[f"{k}shot/accuracy_std"] = float(np.std(scores))
    return {"dataset": str(data_dir), "task": "intent_classification", "intents": len(set(train_y)),
            "train": len(train), "test": len(test), "metrics": metrics, "runs": runs}
