"""Building a demo corpus exactly once: stage it in a private directory, then rename it into place.

A corpus counts as built only once its COMPLETE marker exists, which a builder writes last into the
staging directory; several ranks racing to build it leave one copy and no half-written one.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

COMPLETE_MARKER = "COMPLETE"


def is_built(root: str | os.PathLike) -> bool:
    return (Path(root) / COMPLETE_MARKER).exists()


def fresh_staging(root: Path) -> Path:
    """An empty directory beside `root`, private to this process, to build into."""
    staging = root.with_name(f".{root.name}.building-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    return staging


def publish(staging: Path, root: Path) -> Path:
    """Rename the finished `staging` to `root`; if another process got there first, keep its copy."""
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
        os.rename(staging, root)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not is_built(root):
            raise
    return root
