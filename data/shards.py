"""Writing WebDataset tar shards and resolving shard patterns.

A shard set is a directory of `<prefix>-NNNNNN.tar` files plus `sizes.json` (shard name -> sample
count), the same convention open_clip's loader reads to know a dataset's size without a scan.
"""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path
from typing import Any

import braceexpand
from webdataset.writer import TarWriter


class DataError(RuntimeError):
    """Data that cannot be used as configured; the message names the file, shard or sample."""


class MissingDataError(DataError):
    """A data file or shard that is not there: a path to correct (exit 2), not data to repair (exit 3)."""


class ShardSetWriter:
    """Packs samples (dicts with `__key__` and byte/str/int fields) into numbered tar shards.

    >>> with ShardSetWriter("out/train", max_samples=1000) as writer:
    ...     writer.write({"__key__": "000001", "png": png_bytes, "txt": "a caption"})
    """

    def __init__(self, prefix: str | os.PathLike, max_samples: int = 10_000, start_index: int = 0):
        self.prefix = Path(prefix)
        self.prefix.parent.mkdir(parents=True, exist_ok=True)
        self.max_samples = max_samples
        self.sizes: dict[str, int] = {}
        self._index = start_index
        self._writer: TarWriter | None = None
        self._name = ""

    def _open_next(self) -> None:
        self._close_current()
        self._name = f"{self.prefix.name}-{self._index:06d}.tar"
        self._index += 1
        # mtime fixed so the same samples always give byte-identical shards.
        self._writer = TarWriter(str(self.prefix.parent / self._name), mtime=0)
        self.sizes[self._name] = 0

    def _close_current(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def write(self, sample: dict[str, Any]) -> None:
        if "__key__" not in sample:
            raise DataError(f"sample written to {self.prefix} has no '__key__'")
        if self._writer is None or self.sizes[self._name] >= self.max_samples:
            self._open_next()
        assert self._writer is not None  # opened just above when there was none
        self._writer.write(sample)
        self.sizes[self._name] += 1

    def close(self) -> dict[str, int]:
        """Finish the last shard and merge this set's counts into the directory's sizes.json."""
        self._close_current()
        sizes_file = self.prefix.parent / "sizes.json"
        sizes = json.loads(sizes_file.read_text()) if sizes_file.exists() else {}
        sizes.update(self.sizes)
        sizes_file.write_text(json.dumps(sizes, indent=1, sort_keys=True))
        return dict(self.sizes)

    def __enter__(self) -> ShardSetWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def is_remote(url: str) -> bool:
    return "://" in url or url.startswith("pipe:")


def relative_to_cwd(path: str) -> str:
    """Where a relative path was looked for (a config's paths are the command's, not the config file's)."""
    return "" if os.path.isabs(os.path.expanduser(path)) else f", relative to {os.getcwd()}"


def expand_shards(pattern: str) -> list[str]:
    """Shard URLs of a pattern: comma-separated parts, each brace-expanded (`{000..009}`) or globbed (a glob
    matching tars and other files, `shards/*` over img2dataset's output, means the tars).

    Raises DataError when a part matches nothing, naming the part.
    """
    urls: list[str] = []
    for part in (p.strip() for p in pattern.split(",")):
        if not part:
            continue
        for url in braceexpand.braceexpand(part):
            if is_remote(url):
                urls.append(url)
            elif any(ch in url for ch in "*?["):
                matches = sorted(glob.glob(url))
                if not matches:
                    raise MissingDataError(f"no shard matches {url!r} (from pattern {pattern!r}{relative_to_cwd(url)})")
                tars = [match for match in matches if match.endswith(".tar")]
                urls.extend(tars or matches)  # not the _stats.json, .parquet or sizes.json written beside tars
            elif os.path.isfile(url):
                urls.append(url)
            elif os.path.isdir(url):
                raise MissingDataError(
                    f"shard {url!r} is a folder: name its shards ({url.rstrip('/')}/*.tar or "
                    f"{url.rstrip('/')}/{{00000..00009}}.tar)"
                )
            else:
                raise MissingDataError(f"shard {url!r} does not exist (from pattern {pattern!r}{relative_to_cwd(url)})")
    if not urls:
        raise MissingDataError(f"no shard matches pattern {pattern!r}")
    return urls


def shard_size(url: str, cache: dict[Path, dict] | None = None) -> int | None:
    """Samples in one local shard: from `sizes.json` beside it (mmpt, open_clip) or from img2dataset's
    `<shard>_stats.json` (`successes`: the samples it wrote); None when neither knows."""
    if is_remote(url):
        return None
    path = Path(url)
    cache = {} if cache is None else cache
    if path.parent not in cache:
        sizes_file = path.parent / "sizes.json"
        cache[path.parent] = json.loads(sizes_file.read_text()) if sizes_file.exists() else {}
    if path.name in cache[path.parent]:
        return int(cache[path.parent][path.name])
    stats_file = path.with_name(f"{path.stem}_stats.json")
    if stats_file.exists():
        try:
            return int(json.loads(stats_file.read_text())["successes"])
        except (ValueError, KeyError, TypeError):
            return None
    return None


def count_samples(urls: list[str]) -> int | None:
    """Total samples of the shards (see `shard_size`), or None when any count is unknown."""
    cache: dict[Path, dict] = {}
    sizes = [shard_size(url, cache) for url in urls]
    known = [size for size in sizes if size is not None]
    return sum(known) if len(known) == len(sizes) else None
