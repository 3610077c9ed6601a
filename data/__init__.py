"""Data layer (installed as ``mmpt.data``): shard writers, resumable readers, decoders, demo corpora.

Knows nothing of models; a method combines a decoder from here with its own tokenizer/transforms.
"""

from mmpt.data.loader import BatchStream, MissingFieldError, Source, StatefulLoader, StreamSpec
from mmpt.data.shards import DataError, ShardSetWriter, count_samples, expand_shards

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
