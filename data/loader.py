"""From raw samples to training batches, in DataLoader workers, with a checkpointable position.

Each worker owns one slot stream (`data.stream`), decodes and transforms samples, skips and counts
the ones that fail, batches them and sends each batch together with the position of its stream
after that batch (a `Delivery`; with a GPU, its tensors are pinned on arrival). The main process
keeps the position of the last batch it *handed to training* from every worker: that, plus how many
batches were consumed, is the loader's state. PyTorch hands out iterable-dataset batches round-robin
over workers, so on resume the workers are rotated to continue with the same worker that was next.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from mmpt.data import counts
from mmpt.data.fields import MissingFieldError, SampleFields, TextEncodingError
from mmpt.data.shards import DataError, expand_shards
from mmpt.data.stream import MixedStream, ShardStream, read_shard

log = logging.getLogger(__name__)


LOGGED_SKIPS = 10  # a reader logs its first skipped samples, then one in 1000: web data has millions
FIELD_CHECK_SAMPLES = 16  # a source whose first this many samples all miss a field is misconfigured, not damaged


def first_samples(url: str) -> list[dict[str, Any]]:
    """A local shard's first `FIELD_CHECK_SAMPLES` samples: what the checks before training read of a source."""
    return [sample for _, sample in itertools.islice(read_shard(url), FIELD_CHECK_SAMPLES)]


@dataclass
class Source:
    name: str
    urls: list[str]
    weight: float = 1.0
    fields: SampleFields = field(default_factory=SampleFields)  # where its samples keep caption, image, video

    @classmethod
    def from_pattern(
        cls, pattern: str, weight: float = 1.0, name: str | None = None, fields: SampleFields | None = None
    ) -> Source:
        return cls(name=name or pattern, urls=expand_shards(pattern), weight=weight, fields=fields or SampleFields())


@dataclass
class SkipPolicy:
    """When unusable samples stop the run: a source whose skip rate passes `max_rate` once it has been read
    `min_samples` times, or that gave no usable sample in that many reads (whatever `max_rate` is)."""

    max_rate: float = 0.01
    min_samples: int = 200

    def violation(self, counts_: dict[str, int]) -> str | None:
        """Why `counts_` (one source's, or the totals) breaks the policy, or None."""
        seen, skipped = counts_["seen"], counts.skipped(counts_)
        if seen < self.min_samples or not skipped:
            return None
        reasons = ", ".join(f"{r} {counts_[r]}" for r in counts.SKIP_REASONS if counts_[r])
        commonest = counts.commonest_reason(counts_)
        if counts_["decoded"] == 0:
            return f"none of {seen} samples read could be used ({reasons}; commonest: {commonest})"
        if skipped > self.max_rate * seen:
            return (
                f"{skipped} of {seen} samples could not be used ({reasons}; commonest: {commonest}), more than "
                f"max_skip_rate={self.max_rate}"
            )
        return None


@dataclass
class StreamSpec:
    """Everything a worker needs to rebuild its stream; plain data so it pickles to workers."""

    sources: list[Source]
    batch_size: int
    seed: int = 0
    mode: str = "resampled"
    shuffle_buffer: int = 1000
    rank: int = 0
    world_size: int = 1
    num_workers: int = 0
    max_epochs: int | None = None
    drop_last: bool = True
    start_epoch: int = 0  # where every reader starts when there is no saved position
    per_source: bool = False  # one sub-batch per source, of a fixed share of batch_size (see `batch_shares`)

    def shares(self) -> list[int]:
        return batch_shares(self.batch_size, [s.weight for s in self.sources])


def batch_shares(batch_size: int, weights: list[float]) -> list[int]:
    """Split a batch over sources in proportion to their weights (largest remainders), at least 1 each."""
    total = sum(weights)
    exact = [batch_size * w / total for w in weights]
    shares = [int(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (shares[i] - exact[i], i))
    for i in by_remainder[: batch_size - sum(shares)]:
        shares[i] += 1
    if min(shares) < 1:
        raise ValueError(f"batch_size {batch_size} is too small to give every source (weights {weights}) a sample")
    return shares


def sample_seed(seed: int, slot: int, sample: dict) -> int:
    """A per-sample seed for random augmentation: the same read of a sample gets the same draw on resume."""
    where = (sample.get("__shard__"), sample.get("__shard_pos__"), sample.get("__key__"), sample.get("__epoch__"))
    text = f"{seed}/{slot}/{where}"
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


class BatchStream(IterableDataset):
    """Decoded, batched samples of one rank; iterate it through a `StatefulLoader`."""

    def __init__(
        self,
        spec: StreamSpec,
        decode: Callable[[dict], dict],
        collate: Callable[[list[dict]], Any] = torch.utils.data.default_collate,
    ):
        super().__init__()
        self.spec, self.decode, self.collate = spec, decode, collate
        self.fields = {source.name: source.fields for source in spec.sources}
        self.skip_policy = SkipPolicy()  # set by the StatefulLoader that iterates this stream
        self.start_states: dict[int, dict] = {}
        self.rotation = 0
        for source in spec.sources:
            self._make_stream(source, slot=0)  # fail here, in the main process, on bad shard counts

    @property
    def num_slots(self) -> int:
        return self.spec.world_size * max(1, self.spec.num_workers)

    def _make_stream(self, source: Source, slot: int, on_loss=None) -> ShardStream:
        spec = self.spec
        return ShardStream(
            source.urls,
            slot=slot,
            num_slots=self.num_slots,
            seed=spec.seed,
            mode=spec.mode,
            shuffle_buffer=spec.shuffle_buffer,
            max_epochs=spec.max_epochs,
            name=source.name,
            start_epoch=spec.start_epoch,
            on_loss=on_loss,
        )

    def logical_worker(self) -> int:
        info = get_worker_info()
        workers = max(1, self.spec.num_workers)
        return ((info.id if info else 0) + self.rotation) % workers

    def __iter__(self) -> Iterator[Delivery]:
        """Batches with their positions; a data error becomes a `fatal` item, raised by the main process
        as one line (a worker's exception would arrive wrapped in its traceback)."""
        try:
            yield from self._batches()
        except DataError as exc:
            yield Delivery(fatal=str(exc))

    def _batches(self) -> Iterator[Delivery]:
        spec = self.spec
        worker = self.logical_worker()
        slot = spec.rank * max(1, spec.num_workers) + worker
        status = {"counts": counts.empty(s.name for s in spec.sources), "last_error": ""}

        def on_loss(source: str, lost: int | None) -> None:
            source_counts = status["counts"][source]
            source_counts["broken_shards"] += 1
            if lost is None:
                source_counts["unsized_broken_shards"] += 1
            else:
                source_counts["lost"] += lost

        stream = MixedStream(
            [self._make_stream(s, slot, on_loss) for s in spec.sources],
            [s.weight for s in spec.sources],
            seed=spec.seed,
            slot=slot,
        )
        if worker in self.start_states:
            start = self.start_states[worker]
            stream.load_state_dict(start["stream"])
            status["counts"] = counts.upgrade(start["counts"], [s.name for s in spec.sources])
        if spec.per_source:
            yield from self._per_source_batches(stream, worker, slot, status)
            return
        batch: list[dict] = []
        for raw in stream:
            sample = self._decode(raw, slot, status)
            if sample is not None:
                batch.append(sample)
            if len(batch) == spec.batch_size:
                yield self._package(self.collate(batch), worker, stream, status)
                batch = []
        if batch and not spec.drop_last:
            yield self._package(self.collate(batch), worker, stream, status)

    def _per_source_batches(self, stream: MixedStream, worker: int, slot: int, status: dict) -> Iterator[Delivery]:
        """Each batch: {source name: collated share of that source}; ends when any source ends."""
        readers = [iter(s) for s in stream.streams]
        while True:
            batch = {}
            for source, reader, share in zip(self.spec.sources, readers, self.spec.shares()):
                samples: list[dict] = []
                while len(samples) < share:
                    raw = next(reader, None)
                    if raw is None:
                        return
                    raw["__source__"] = source.name
                    sample = self._decode(raw, slot, status)
                    if sample is not None:
                        samples.append(sample)
                batch[source.name] = self.collate(samples)
            yield self._package(batch, worker, stream, status)

    def _decode(self, raw: dict, slot: int, status: dict) -> dict | None:
        """The decoded sample, or None (counted by reason, the reason kept) when it cannot be used."""
        source_counts = status["counts"][raw["__source__"]]
        source_counts["seen"] += 1
        try:
            # Random transforms draw from a per-sample seed (CPU generator). A worker process owns its RNG;
            # in the main process (no workers) the caller's RNG is left as it was.
            seed = sample_seed(self.spec.seed, slot, raw)
            if get_worker_info() is not None:
                torch.default_generator.manual_seed(seed)
                sample = self.decode(self.fields[raw["__source__"]].apply(raw))
            else:
                with torch.random.fork_rng(devices=[]):
                    torch.default_generator.manual_seed(seed)
                    sample = self.decode(self.fields[raw["__source__"]].apply(raw))
        except Exception as exc:  # one bad sample must not stop the run
            reason = (
                "missing_field"
                if isinstance(exc, MissingFieldError)
                else "text_encoding"
                if isinstance(exc, (TextEncodingError, UnicodeDecodeError))
                else "undecodable"
            )
            source_counts[reason] += 1
            where = f"sample {raw.get('__key__')!r} of {raw.get('__shard__')}"
            status["last_error"] = (
                f"{where}: {exc}" if reason == "missing_field" else f"{where}: {type(exc).__name__}: {exc}"
            )
            status["skipped_here"] = status.get("skipped_here", 0) + 1
            if status["skipped_here"] <= LOGGED_SKIPS or status["skipped_here"] % 1000 == 0:
                more = (
                    ""
                    if status["skipped_here"] < LOGGED_SKIPS
                    else (
                        f" ({status['skipped_here']} skipped by this reader; from here on one in 1000 is logged, "
                        "all are counted in data/skipped)"
                    )
                )
                log.warning("skipped %s%s", status["last_error"], more)
            if (
                reason == "missing_field"
                and source_counts["missing_field"] == source_counts["seen"] >= FIELD_CHECK_SAMPLES
            ):
                raise MissingFieldError(
                    f"source {raw['__source__']!r}: none of its first {FIELD_CHECK_SAMPLES} samples has a field the "
                    f"method needs; the last one: {exc}"
                ) from None
            # Checked here, where samples are read, not where batches arrive: a source whose every sample
            # fails never completes a batch.
            broken = self.skip_policy.violation(source_counts)
            if broken:
                raise DataError(
                    f"source {raw['__source__']!r}: {broken}; last failure: {status['last_error']}"
                ) from None
            return None
        source_counts["decoded"] += 1
        return sample

    def _package(self, batch, worker, stream, status) -> Delivery:
        position = {"worker": worker, "stream": stream.state_dict(), "counts": counts.merge({}, status["counts"])}
        return Delivery(batch, position, status["last_error"])


@dataclass
class Delivery:
    """What a worker hands the main process: a batch and the position of its stream after it, or a fatal error."""

    batch: Any = None
    position: dict | None = None
    last_error: str = ""
    fatal: str | None = None  # a data error's one-line message

    def pin_memory(self, device: Any = None) -> Delivery:
        """Called by the DataLoader's pinning thread: pins the batch's tensors only. The position (plain
        lists: a shuffle buffer's worth of sample identities) is passed on without being walked."""
        return replace(self, batch=pin_tensors(self.batch))


def pin_tensors(batch: Any) -> Any:
    """`batch` with its tensors in page-locked memory, so that their host-to-device copies are asynchronous.

    Dicts (per-source sub-batches too), lists, tuples and named tuples are walked and rebuilt; anything
    else (strings, numbers, a dialog batch's labels and ids) is passed on as it is.
    """
    if isinstance(batch, torch.Tensor):
        return batch.pin_memory()
    if isinstance(batch, dict):
        return {key: pin_tensors(value) for key, value in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(pin_tensors(value) for value in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(pin_tensors(value) for value in batch)
    return batch


@dataclass
class PackedSamples:
    """A unit's samples on their way from a worker: each field whose tensors all have one shape and dtype
    stacked into one tensor (one shared-memory block per field, not one per sample), other fields as lists."""

    count: int
    fields: dict[str, Any]
    loose: list[Any] | None = None  # samples that are not dicts of one set of keys travel as they are


def pack_samples(samples: list[Any]) -> PackedSamples:
    keys = samples[0].keys() if samples and isinstance(samples[0], dict) else None
    if keys is None or any(not isinstance(s, dict) or s.keys() != keys for s in samples):
        return PackedSamples(len(samples), {}, list(samples))
    fields: dict[str, Any] = {}
    for key in keys:
        values = [sample[key] for sample in samples]
        same = all(isinstance(v, torch.Tensor) for v in values) and len({(v.shape, v.dtype) for v in values}) == 1
        fields[key] = torch.stack(values) if same else values
    return PackedSamples(len(samples), fields)


def unpack_samples(packed: PackedSamples) -> list[Any]:
    if packed.loose is not None:
        return packed.loose
    return [{key: values[row] for key, values in packed.fields.items()} for row in range(packed.count)]


def _as_is(item: Any) -> Any:
    return item


@dataclass
class StatefulLoader:
    """Iterates a `BatchStream` through a DataLoader and remembers the consumed position."""

    dataset: BatchStream
    skip_policy: SkipPolicy = field(default_factory=SkipPolicy)
    batches: int = 0
    positions: dict[int, dict] = field(default_factory=dict)
    carried: counts.Counts = field(default_factory=dict)  # from before a reshard
    unit_collate: Callable[[list[dict]], Any] | None = None  # set by `read_in_units`
    prefetch: int = 4  # deliveries each worker keeps ready

    def __post_init__(self) -> None:
        self.dataset.skip_policy = self.skip_policy  # the readers enforce it on every sample they read

    def read_in_units(self, unit_size: int) -> None:
        """Deliver units of `unit_size` samples, uncollated, for `combine` to join several into one batch (a
        rank's micro-batch that follows its speed). Each unit is a delivery with its position, so the loader's
        state stays exact whatever number of units a batch takes. Call before iterating."""
        dataset = self.dataset
        self.unit_collate = dataset.collate
        self.prefetch *= max(1, dataset.spec.batch_size // unit_size)  # as many samples ready as with whole batches
        dataset.spec = replace(dataset.spec, batch_size=unit_size)
        dataset.collate = pack_samples

    def combine(self, units: list[Any]) -> Any:
        """One batch of the samples of `units` (from `read_in_units`), collated here, then pinned for a GPU."""
        assert self.unit_collate is not None, "read_in_units() first"
        collate = self.unit_collate
        if isinstance(units[0], dict):  # per-source units: {source: packed samples}
            batch = {name: collate([s for unit in units for s in unpack_samples(unit[name])]) for name in units[0]}
        else:
            batch = collate([sample for unit in units for sample in unpack_samples(unit)])
        return pin_tensors(batch) if pin_batches() else batch

    @property
    def source_names(self) -> list[str]:
        return [s.name for s in self.dataset.spec.sources]

    def state_dict(self) -> dict[str, Any]:
        spec = self.dataset.spec
        return {
            "batches": self.batches,
            "num_workers": spec.num_workers,
            "world_size": spec.world_size,
            "positions": {str(k): v for k, v in self.positions.items()},
            "carried": counts.merge({}, self.carried),
            "start_epoch": spec.start_epoch,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        spec = self.dataset.spec
        if (state["num_workers"], state["world_size"]) != (spec.num_workers, spec.world_size):
            raise DataError(
                f"the checkpoint's data position was saved with {state['world_size']} ranks x {state['num_workers']} "
                f"workers; this run has {spec.world_size} x {spec.num_workers}. Resume with the same layout."
            )
        self.batches = state["batches"]
        self.positions = {int(k): v for k, v in state["positions"].items()}
        self.carried = counts.upgrade(state.get("carried", {}), self.source_names)
        spec.start_epoch = state.get("start_epoch", 0)  # for a worker that had not delivered a batch yet

    def reshard(self, old_states: list[dict[str, Any]]) -> None:
        """Continue after a change of ranks or workers, from every old rank's saved state.

        Positions cannot be split differently, so every reader starts at the epoch after the furthest
        one any old reader had reached: no sample is read twice; in epoch mode, what was left of the
        epochs in progress is skipped. Counts carry over.
        """
        positions = [p for state in old_states for p in state["positions"].values()]
        epochs = [source["epoch"] for p in positions for source in p["stream"]["sources"]]
        self.dataset.spec.start_epoch = max(epochs, default=-1) + 1
        self.batches, self.positions = 0, {}
        if self.dataset.spec.rank == 0:  # counted once, not on every new rank
            names = self.source_names
            for saved in [state.get("carried", {}) for state in old_states] + [p["counts"] for p in positions]:
                counts.merge(self.carried, counts.upgrade(saved, names))

    def counts_by_source(self) -> counts.Counts:
        """This rank's counts per source: carried over plus every worker's at its last consumed batch."""
        total = counts.merge(counts.empty(self.source_names), self.carried)
        for position in self.positions.values():
            counts.merge(total, counts.upgrade(position["counts"], self.source_names))
        return total

    def counts(self) -> dict[str, int]:
        """This rank's counts, all sources together (`data.counts.totals`)."""
        return counts.totals(self.counts_by_source())

    def _check_skip_rate(self, last_error: str) -> None:
        """The policy over all of this rank's readers together, per source, then for all sources (each reader
        checks its own sources too)."""
        per_source = self.counts_by_source()
        for source, source_counts in per_source.items():
            broken = self.skip_policy.violation(source_counts)
            if broken:
                raise DataError(f"source {source!r}: {broken}; last failure: {last_error}")
        broken = self.skip_policy.violation(counts.totals(per_source))
        if broken:
            worst = max(per_source, key=lambda source: counts.skipped(per_source[source]))
            raise DataError(f"all sources: {broken}, most from source {worst!r}; last failure: {last_error}")

    def __iter__(self) -> Iterator[Any]:
        spec = self.dataset.spec
        self.dataset.start_states = dict(self.positions)
        self.dataset.rotation = self.batches % max(1, spec.num_workers)
        loader = DataLoader(
            self.dataset,
            batch_size=None,
            collate_fn=_as_is,  # batches are collated in the workers; don't walk the position state again
            num_workers=spec.num_workers,
            persistent_workers=False,
            prefetch_factor=self.prefetch if spec.num_workers else None,
            # Pinned in the DataLoader's own thread, so training's non_blocking copies to the GPU overlap compute.
            pin_memory=pin_batches() and self.unit_collate is None,  # units are pinned once collated
        )
        # Started here, not lazily: starting draws from the global RNG, which a resumed run restores after this.
        return self._consume(iter(loader))

    def _consume(self, items: Iterator[Delivery]) -> Iterator[Any]:
        for item in items:
            if item.fatal is not None:
                raise DataError(item.fatal)
            assert item.position is not None  # every non-fatal delivery carries its stream's position
            self.positions[item.position["worker"]] = item.position
            self.batches += 1
            if item.last_error:
                self._check_skip_rate(item.last_error)
            yield item.batch


def pin_batches() -> bool:
    """Whether loaders pin their batches: when there is a GPU to copy them to (on CPU there is nothing to gain)."""
    return torch.cuda.is_available()
