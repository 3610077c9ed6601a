"""Building a demo corpus exactly once: stage it in a private directory, then rename it into place.

A corpus counts as built only once its COMPLETE marker exists, which a builder writes last into the
staging directory; several ranks racing to build it leave one copy and no half-written one.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

COMPLETE_MARKER = "COMPLETE"


def is_built(root: str | os.PathLike, version: int = 1) -> bool:
    """True once `root` is complete. A corpus complete under another builder `version` is an error that
    names the folder: using it would silently lack what this version writes."""
    marker = Path(root) / COMPLETE_MARKER
    if not marker.exists():
        return False
    found = built_version(marker)
    if found != version:
        raise RuntimeError(
            f"{root} holds a demo corpus built by version {found} of its builder; this mmpt "
            f"builds version {version}. Delete {root} and it is rebuilt on next use."
        )
    return True


def built_version(marker: Path) -> int:
    first = marker.read_text().split("\n", 1)[0]
    return int(first.removeprefix("version: ")) if first.startswith("version: ") else 1


def mark_complete(staging: Path, summary: str, version: int = 1) -> None:
    """Written last: the corpus counts as built from here on."""
    head = f"version: {version}\n" if version != 1 else ""
    (staging / COMPLETE_MARKER).write_text(head + summary + "\n")


def fresh_staging(root: Path) -> Path:
    """An empty directory beside `root`, private to this process, to build into."""
    staging = root.with_name(f".{root.name}.building-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    return staging


def publish(staging: Path, root: Path, version: int = 1) -> Path:
    """Rename the finished `staging` to `root`; if another process got there first, keep its copy (built by the
    same builder `version`)."""
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
        os.rename(staging, root)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not is_built(root, version):
            raise
    return root
