"""Evaluation: zero-shot classification (and, per method, retrieval and intent tasks)."""

from __future__ import annotations

from pathlib import Path

from mmpt.data import demo_digits

# Demo corpora evaluable by name; each builds itself on first use.
_DEMO_SETS = {"digits": lambda root: demo_digits.build_digits(Path(root) / "digits") / "zeroshot"}


def resolve_dataset(name_or_path: str, data_root: str = "demo_data") -> Path:
    """A dataset folder from a path, or from a demo corpus name (built under `data_root` if missing)."""
    if name_or_path in _DEMO_SETS and not Path(name_or_path).exists():
        return _DEMO_SETS[name_or_path](data_root)
    return Path(name_or_path)
