"""The files a run and a release leave behind, and how they are written and found.

Shared by the engine (which writes a run's checkpoints and weights) and releases (which read and
write them), so neither imports the other: file names, durable writes (a crash never leaves half a
file under the final name), permissions, and resolving a release named by a path or a hub id.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

WEIGHTS = "model.safetensors"  # a finished run's consolidated weights, and a release's (or its shard index)
RELEASE_CONFIG = "config.json"
RUN_CONFIG = "config.yaml"
RELEASE_FORMAT = "mmpt-release"  # config.json's "format": what tells a release from another library's model folder
FINAL_EVALUATION = "final_evaluation.json"  # a run's end-of-training evaluation, written once it completed
HUB_PREFIX = "hf-hub:"


class ReleaseError(RuntimeError):
    """A release that cannot be found or loaded; the message is one line meant for the user."""


def has_weights(directory: Path) -> bool:
    """Whether `directory` holds a model's weights (one safetensors file, or shards and their index)."""
    return (directory / WEIGHTS).is_file() or (directory / f"{WEIGHTS}.index.json").is_file()


def release_record(directory: Path) -> dict[str, Any]:
    """A release's config.json; ReleaseError where the folder's config.json is another library's (a transformers
    or open_clip model folder)."""
    import json

    record = json.loads((directory / RELEASE_CONFIG).read_text())
    if not isinstance(record, dict) or record.get("format") != RELEASE_FORMAT:
        raise ReleaseError(
            f'{directory / RELEASE_CONFIG} is not an mmpt release (no "format": "{RELEASE_FORMAT}"; another '
            "library's model folder?)"
        )
    return record


def resolve(name_or_path: str | os.PathLike) -> Path:
    """A local directory, or `hf-hub:<org>/<name>[@revision]` fetched through the hub cache.

    HF_HUB_OFFLINE=1 is honoured (the cache only); an id that cannot be reached is a one-line ReleaseError.
    """
    text = str(name_or_path)
    if not text.startswith(HUB_PREFIX):
        path = Path(text)
        if not path.is_dir():
            raise ReleaseError(f"{path} is not a directory (use {HUB_PREFIX}<org>/<name> for a hub id)")
        return path
    repo, _, revision = text[len(HUB_PREFIX) :].partition("@")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(snapshot_download(repo, revision=revision or None))
    except (LocalEntryNotFoundError, RepositoryNotFoundError, HfHubHTTPError, OSError, ValueError) as exc:
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
        why = "not in the local hub cache and HF_HUB_OFFLINE is set" if offline else f"{type(exc).__name__}"
        raise ReleaseError(f"cannot load {text}: {why} ({' '.join(str(exc).split())[:200]})") from None


def fsync(path: Path) -> None:
    """Flush a file (or a directory's entries) to stable storage."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def temporary_for(path: Path) -> Path:
    """Where `path` is written before it is renamed into place (hidden, beside it: the rename is atomic)."""
    return path.with_name(f".{path.name}.tmp")


def commit(temporary: Path, path: Path) -> None:
    """Sync `temporary`, rename it to `path` and sync the folder: after this, `path` is whole on disk."""
    fsync(temporary)
    temporary.replace(path)
    fsync(path.parent)


def atomic_write(path: Path, text: str) -> None:
    temporary = temporary_for(path)
    temporary.write_text(text)
    commit(temporary, path)


def atomic_torch_save(obj: Any, path: Path) -> None:
    import torch

    temporary = temporary_for(path)
    torch.save(obj, temporary)
    commit(temporary, path)


def shareable(path: Path) -> None:
    """Give a written file the permissions the umask allows (safetensors writes 0600 through a temporary
    file): weights are handed to other users, jobs and hubs."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)
