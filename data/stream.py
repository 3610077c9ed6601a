"""Deterministic, resumable streams of raw (undecoded) samples.

One stream serves one *slot* — a (rank, dataloader worker) pair — and is a pure function of the
seed, the slot and the shard list. Its position is small (epoch, shard, member, the identities of
the samples in the shuffle buffer, the buffer's RNG state), so a checkpoint can hold it and a
resumed run reads exactly the samples an uninterrupted run would have read next, re-reading only
the shards the shuffle buffer still draws from.

Shard assignment per epoch:
- ``epoch`` mode: all shards are shuffled with a seed shared by every slot and slot ``s`` of ``S``
  takes ``order[s::S]`` — every sample is read exactly once per epoch across all slots.
- ``resampled`` mode: each slot draws ``len(shards)`` shards with replacement per epoch from its
  own seed — the usual choice for large pretraining runs, where epochs don't matter.
"""

from __future__ import annotations

import logging
import os
import random
import re
import tarfile
from collections.abc import Callable, Iterator
from typing import Any

from webdataset.gopen import gopen
from webdataset.tariterators import group_by_keys

from mmpt.data.shards import DataError, shard_size

log = logging.getLogger(__name__)

Tag = tuple[int, int]  # (position of the shard in this slot's epoch order, sample index inside the shard)


ShardEndHandler = Callable[[str, int, "str | None"], None]  # (url, samples it yielded, what broke or None)
META_MEMBER = re.compile(r"__[^/]*__($|/)")  # webdataset's convention for archive-level metadata files


def read_shard(url: str, start: int = 0, on_end: ShardEndHandler | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
    """(index, sample) pairs of one tar shard from sample `start` on.

    A tar that cannot be opened or breaks (truncated, corrupt header, unreadable member) ends with a
    warning. Once the shard is read to its end, `on_end` is told how many samples it yielded in all
    and what broke, if anything.
    """
    errors: list[str] = []

    def note(exc: Exception) -> bool:
        errors.append(f"{type(exc).__name__}: {exc}")
        log.warning("unreadable data in shard %s skipped: %s", url, errors[-1])
        return True

    yielded = 0
    try:
        stream = gopen(url, "rb")
    except OSError as exc:
        note(exc)
    else:
        try:
            for index, sample in enumerate(group_by_keys(_tar_members(url, stream, note), handler=note)):
                yielded = index + 1
                if index >= start:
                    yield index, sample
        finally:
            stream.close()
    if on_end is not None:
        on_end(url, yielded, errors[-1] if errors else None)


def _tar_members(url: str, stream: Any, note: Callable[[Exception], bool]) -> Iterator[dict[str, Any]]:
    """The regular files of a tar as webdataset's grouping expects them; a break is noted, including a
    corrupt header mid-archive, where Python's tarfile ends the archive without an error."""
    try:
        # Closing the archive leaves `stream` open (the caller closes it).
        with tarfile.open(fileobj=stream, mode="r|*") as archive:
            for info in archive:
                if info.isreg() and not META_MEMBER.match(info.name):
                    member = archive.extractfile(info)
                    assert member is not None  # a regular file
                    yield {"fname": info.name, "data": member.read(), "__url__": url}
                archive.members = []  # pyright: ignore[reportAttributeAccessIssue] (streaming: keep no member list)
            end = archive.offset
    except (tarfile.TarError, OSError, EOFError, ValueError) as exc:
        note(exc)
        return
    if not _ends_with_zero_block(url, end):
        note(tarfile.ReadError(f"no valid tar header at byte {end}; the rest of the shard is unreadable"))


def _ends_with_zero_block(url: str, offset: int) -> bool:
    """Whether a plain local tar really ends at `offset` (an all-zero end block, or nothing, follows)."""
    if not url.endswith(".tar") or not os.path.isfile(url):
        return True  # compressed or remote: nothing to look at, trust the reader
    with open(url, "rb") as handle:
        handle.seek(offset)
        return not handle.read(512).strip(b"\0")


def check_epoch_shards(name: str, shards: int, readers: int) -> None:
    """In epoch mode every reader (ranks x workers) reads whole shards of its own: fewer shards leave one idle."""
    if shards < readers:
        raise DataError(
            f"source {name!r}: {shards} shards cannot feed {readers} readers (ranks x workers) in "
            f"epoch mode; write at least {readers} shards, use fewer workers, or use mode: resampled"
        )


class ShardStream:
    """Infinite (or `max_epochs`-long) raw sample stream of one slot; see the module docstring."""

    def __init__(
        self,
        urls: list[str],
        *,
        slot: int,
        num_slots: int,
        seed: int,
        mode: str = "resampled",
        shuffle_buffer: int = 1000,
        max_epochs: int | None = None,
        name: str = "data",
        start_epoch: int = 0,
        on_loss: Callable[[str, int | None], None] | None = None,
    ):
        """`on_loss(source name, samples lost, or None when the shard's size is unknown)` is called for a
        shard that turns out broken or short of its known size, once per read of it."""
        if mode not in ("resampled", "epoch"):
            raise ValueError(f"unknown sampling mode {mode!r}")
        if mode == "epoch":
            check_epoch_shards(name, len(urls), num_slots)
        self.urls, self.slot, self.num_slots, self.seed = urls, slot, num_slots, seed
        self.mode, self.buffer_size, self.max_epochs, self.name = mode, shuffle_buffer, max_epochs, name
        self.epoch, self.shard_pos, self.member = start_epoch, 0, 0
        self._buffer: list[tuple[Tag, dict]] = []
        self._rng = self._buffer_rng(start_epoch)
        self._resume_tags: list[Tag] | None = None
        self.on_loss = on_loss
        self._sizes: dict = {}
        self._unreadable: dict[str, str] = {}  # shard -> what broke it, for shards that yielded nothing

    # -- positions ---------------------------------------------------------------------------

    def shard_order(self, epoch: int) -> list[str]:
        if self.mode == "epoch":
            order = list(self.urls)
            random.Random(f"{self.seed}/order/{epoch}").shuffle(order)
            return order[self.slot :: self.num_slots]
        rng = random.Random(f"{self.seed}/resample/{self.slot}/{epoch}")
        return [rng.choice(self.urls) for _ in self.urls]

    def _buffer_rng(self, epoch: int) -> random.Random:
        return random.Random(f"{self.seed}/buffer/{self.slot}/{epoch}")

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "shard_pos": self.shard_pos,
            "member": self.member,
            "buffer": [list(tag) for tag, _ in self._buffer],
            "rng": _rng_state_to_list(self._rng.getstate()),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.shard_pos, self.member = state["epoch"], state["shard_pos"], state["member"]
        self._rng.setstate(_rng_state_from_list(state["rng"]))
        self._resume_tags = [tuple(tag) for tag in state["buffer"]]

    # -- iteration ---------------------------------------------------------------------------

    def _refill_buffer(self, order: list[str], tags: list[Tag]) -> list[tuple[Tag, dict]]:
        """Re-read the samples a checkpointed shuffle buffer held, in their buffer order."""
        wanted = set(tags)
        found: dict[Tag, dict] = {}
        for shard_pos in sorted({pos for pos, _ in tags}):
            for index, sample in read_shard(order[shard_pos]):
                if (shard_pos, index) in wanted:
                    found[(shard_pos, index)] = self._annotate(sample, order[shard_pos], shard_pos)
        missing = wanted - found.keys()
        if missing:
            raise DataError(
                f"source {self.name!r}: cannot resume, samples {sorted(missing)[:5]} are gone from their shards"
            )
        return [(tag, found[tag]) for tag in tags]

    def _annotate(self, sample: dict, url: str, shard_pos: int) -> dict:
        """Where the sample was read: a resampled shard can be read twice in one epoch."""
        sample["__shard__"], sample["__shard_pos__"], sample["__epoch__"] = url, shard_pos, self.epoch
        return sample

    def _tagged_samples(self, order: list[str]) -> Iterator[tuple[Tag, dict]]:
        while self.shard_pos < len(order):
            url = order[self.shard_pos]
            for index, sample in read_shard(url, self.member, self._shard_ended):
                self.member = index + 1
                yield (self.shard_pos, index), self._annotate(sample, url, self.shard_pos)
            self.shard_pos, self.member = self.shard_pos + 1, 0

    def _shard_ended(self, url: str, yielded: int, error: str | None) -> None:
        if error is not None and yielded == 0:
            self._unreadable[url] = error
        else:  # read this time (a remote shard's failure may have passed)
            self._unreadable.pop(url, None)
        size = shard_size(url, self._sizes)
        lost = None if size is None else max(0, size - yielded)
        if self.on_loss is not None and (error is not None or lost):
            self.on_loss(self.name, lost)

    def _check_readable(self, order: list[str]) -> None:
        """A pass that read nothing, where every shard this reader can draw has yielded nothing but an error
        (a CSV named as a shard, truncated tars), would repeat forever: it is a data error."""
        reachable = set(order if self.mode == "epoch" else self.urls)
        if reachable and reachable <= self._unreadable.keys():
            url = sorted(reachable)[0]
            raise DataError(
                f"source {self.name!r}: none of its {len(reachable)} shard(s) could be read "
                f"({url}: {self._unreadable[url]})"
            )

    def _take(self) -> dict:
        pick = self._rng.randrange(len(self._buffer))
        self._buffer[pick], self._buffer[-1] = self._buffer[-1], self._buffer[pick]
        return self._buffer.pop()[1]

    def __iter__(self) -> Iterator[dict]:
        while self.max_epochs is None or self.epoch < self.max_epochs:
            order = self.shard_order(self.epoch)
            if self._resume_tags is not None:
                self._buffer = self._refill_buffer(order, self._resume_tags)
                self._resume_tags = None
            read = 0
            for tagged in self._tagged_samples(order):
                read += 1
                if self.buffer_size == 0:
                    yield tagged[1]
                    continue
                self._buffer.append(tagged)
                if len(self._buffer) >= self.buffer_size:
                    yield self._take()
            while self._buffer:
                yield self._take()
            if not read:
                self._check_readable(order)
            self.epoch, self.shard_pos, self.member = self.epoch + 1, 0, 0
            self._rng = self._buffer_rng(self.epoch)


class MixedStream:
    """Weighted mix of several sources (e.g. zh:en = 1:1), one sample at a time, resumable."""

    def __init__(self, streams: list[ShardStream], weights: list[float], *, seed: int, slot: int):
        self.streams, self.weights = streams, weights
        self._rng = random.Random(f"{seed}/mix/{slot}")

    def state_dict(self) -> dict[str, Any]:
        return {"rng": _rng_state_to_list(self._rng.getstate()), "sources": [s.state_dict() for s in self.streams]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["sources"]) != len(self.streams):
            raise DataError(
                f"checkpointed data position has {len(state['sources'])} sources, config has {len(self.streams)}"
            )
        self._rng.setstate(_rng_state_from_list(state["rng"]))
        for stream, sub in zip(self.streams, state["sources"]):
            stream.load_state_dict(sub)

    def __iter__(self) -> Iterator[dict]:
        iterators = [iter(s) for s in self.streams]
        live = list(range(len(iterators)))
        while live:
            choice = live[0] if len(live) == 1 else self._rng.choices(live, [self.weights[i] for i in live])[0]
            try:
                sample = next(iterators[choice])
            except StopIteration:
                live.remove(choice)
                continue
            sample["__source__"] = self.streams[choice].name
            yield sample


def _rng_state_to_list(state: tuple) -> list:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def _rng_state_from_list(state: list) -> tuple:
    version, internal, gauss = state
    return (version, tuple(internal), gauss)
