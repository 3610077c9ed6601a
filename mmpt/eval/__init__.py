"""Evaluation: zero-shot classification (and, per method, retrieval and intent tasks)."""

from __future__ import annotations

from pathlib import Path

from mmpt import demo

# Demo corpora evaluable by name, and the folder of each that holds the zero-shot set.
_DEMO_SETS = {"digits": "zeroshot"}


def resolve_dataset(name_or_path: str, data_root: str = "demo_data") -> Path:
    """A dataset folder from a path, or from a demo corpus name (built under `data_root` if missing)."""
    if name_or_path in _DEMO_SETS and not Path(name_or_path).exists():
        return demo.build(name_or_path, data_root) / _DEMO_SETS[name_or_path]
    return Path(name_or_path)
