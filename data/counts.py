"""What became of each source's samples: decoded, skipped (by reason) or lost with a broken shard.

Counts are plain ``{source: {key: int}}`` dicts so they travel in batch positions and checkpoints.
`seen` counts every sample a shard yielded (decoded + skipped); samples that a broken tar never
yielded are `lost`: exactly when the shard's size is known (`sizes.json`, or img2dataset's
`*_stats.json`), otherwise the shard is counted in `unsized_broken_shards` and its lost rest is
unknown ("at least the rest of that shard").
"""

from __future__ import annotations

from collections.abc import Iterable

SKIP_REASONS = ("missing_field", "text_encoding", "undecodable")
KEYS = ("seen", "decoded", *SKIP_REASONS, "lost", "broken_shards", "unsized_broken_shards")

Counts = dict[str, dict[str, int]]


def empty(sources: Iterable[str]) -> Counts:
    return {name: dict.fromkeys(KEYS, 0) for name in sources}


def merge(into: Counts, other: Counts) -> Counts:
    """Add `other` into `into` (in place) and return it."""
    for name, counts in other.items():
        target = into.setdefault(name, dict.fromkeys(KEYS, 0))
        for key in KEYS:
            target[key] += counts.get(key, 0)
    return into


def skipped(counts: dict[str, int]) -> int:
    return sum(counts[reason] for reason in SKIP_REASONS)


def totals(per_source: Counts) -> dict[str, int]:
    """All sources together, with `skipped` (all reasons) added."""
    total: dict[str, int] = dict.fromkeys(KEYS, 0)
    for counts in per_source.values():
        for key in KEYS:
            total[key] += counts[key]
    return {**total, "skipped": skipped(total)}


ROW = (*KEYS[:2], "skipped", *(f"skipped/{r}" for r in SKIP_REASONS), *KEYS[-3:])


def row(counts: dict[str, int]) -> list[int]:
    """One source's (or the totals') counts in `ROW` order."""
    full = {**counts, "skipped": skipped(counts), **{f"skipped/{r}": counts[r] for r in SKIP_REASONS}}
    return [full[key] for key in ROW]


def groups(sources: list[str]) -> list[str]:
    """What the flat counts hold, in order: all sources, then each source when there are several."""
    return ["all", *sources] if len(sources) > 1 else ["all"]


def flatten(per_source: Counts, sources: list[str]) -> list[int]:
    """A fixed-length list every rank can all-reduce: `row` of the totals, then of each source (`groups`)."""
    values = row(totals(per_source))
    for source in groups(sources)[1:]:
        values += row(per_source.get(source, dict.fromkeys(KEYS, 0)))
    return values


def nest(values: list[int], sources: list[str]) -> dict[str, dict[str, int]]:
    """`flatten`'s (summed) values as {group: {ROW key: value}}."""
    return {
        group: {key: int(v) for key, v in zip(ROW, values[i * len(ROW) : (i + 1) * len(ROW)])}
        for i, group in enumerate(groups(sources))
    }


def metrics(nested: dict[str, dict[str, int]]) -> dict[str, int]:
    """`data/<key>` for the totals, `data/<source>/<key>` per source."""
    return {
        (f"data/{key}" if group == "all" else f"data/{group}/{key}"): value
        for group, counts in nested.items()
        for key, value in counts.items()
    }


def commonest_reason(counts: dict[str, int]) -> str:
    """The skip reason with the most samples in one source's (or the totals') counts."""
    return max(SKIP_REASONS, key=lambda reason: counts.get(reason, 0))


def describe(counts: dict[str, int]) -> str:
    """One line: `1200 decoded, 14 skipped (missing_field 4, undecodable 10), 37 lost with 2 broken shards`."""
    reasons = ", ".join(f"{r} {counts[f'skipped/{r}']}" for r in SKIP_REASONS if counts.get(f"skipped/{r}"))
    text = f"{counts['decoded']} decoded, {counts['skipped']} skipped" + (f" ({reasons})" if reasons else "")
    if counts["broken_shards"]:
        text += f", {counts['lost']} lost with {counts['broken_shards']} broken shard(s)"
        if counts["unsized_broken_shards"]:
            text += f" (+ the unknown rest of {counts['unsized_broken_shards']} shard(s) without a known size)"
    return text


def upgrade(saved: dict, sources: list[str]) -> Counts:
    """Counts from a checkpoint, also from before counts were kept per source (then: the first source)."""
    if "seen" in saved and not isinstance(saved["seen"], dict):
        old = empty(sources)
        first = old[sources[0]]
        first["seen"], first["undecodable"] = saved["seen"], saved.get("skipped", 0)
        first["decoded"] = first["seen"] - first["undecodable"]
        return old
    return merge(empty(sources), saved)
