"""Evaluation: zero-shot classification (and, per method, retrieval and intent tasks)."""

from __future__ import annotations

from pathlib import Path

from mmpt import demo

# Zero-shot sets of the demo corpora, evaluable by name: (corpus, folder inside it).
# digits_unseen: the same held-out scans drawn at other sizes and positions, with prompt wordings training never saw.
DEMO_SETS = {"digits": ("digits", "zeroshot"), "digits_unseen": ("digits", "zeroshot_unseen")}
# Every evaluation set a demo corpus provides by name, whatever the method (video and dialog ones resolve in theirs).
DEMO_NAMES = (*DEMO_SETS, "moving_digits", "dialogs")


def resolve_dataset(name_or_path: str, data_root: str = "demo_data") -> Path:
    """A dataset folder from a path, or from a demo corpus name (built under `data_root` if missing)."""
    if name_or_path in DEMO_SETS and not Path(name_or_path).exists():
        corpus, folder = DEMO_SETS[name_or_path]
        return demo.build(corpus, data_root) / folder
    return Path(name_or_path)
