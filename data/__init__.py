"""Data layer (installed as ``mmpt.data``): shard writers, resumable readers, decoders, demo corpora.

Knows nothing of models; a method combines a decoder from here with its own tokenizer/transforms. The names below
are imported when first used, so that a module that needs only `mmpt.data.shards` (a command's error types) does
not import torch with the loader.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mmpt.data.loader import BatchStream, MissingFieldError, Source, StatefulLoader, StreamSpec
    from mmpt.data.shards import DataError, ShardSetWriter, count_samples, expand_shards

_LAZY = {
    **dict.fromkeys(["BatchStream", "MissingFieldError", "Source", "StatefulLoader", "StreamSpec"], "mmpt.data.loader"),
    **dict.fromkeys(["DataError", "ShardSetWriter", "count_samples", "expand_shards"], "mmpt.data.shards"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mmpt.data' has no attribute {name!r}")


__all__ = [
    "BatchStream",
    "DataError",
    "MissingFieldError",
    "ShardSetWriter",
    "Source",
    "StatefulLoader",
    "StreamSpec",
    "count_samples",
    "expand_shards",
]
