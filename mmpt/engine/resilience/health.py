"""Rank health: name the rank that arrives late, or whose collectives are slow, from the collective timings.

At every logging step one all-gather of each rank's window (`collective_timing.Window`) gives every rank the same
matrix, and every rank judges it alike, so a stop needs no further message: every rank raises the same error at
the same step. The two faults, their thresholds (`train.straggler_factor`, `train.slow_collective_factor`,
`train.unhealthy_min_share`, `train.straggler_windows`) and what a stop writes: docs/fault_tolerance.md
("Rank health"). Windows with an evaluation or a checkpoint are not judged: ranks do unequal work there by design.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, cast

from mmpt import distributed as mdist
from mmpt.artifacts import atomic_write
from mmpt.config import TrainConfig
from mmpt.engine.resilience import collective_timing
from mmpt.engine.resilience.collective_timing import KINDS, CollectiveClock, Window

log = logging.getLogger(__name__)

UNHEALTHY_FILE = "unhealthy.json"
Kind = Literal["straggler", "slow collectives"]
_SUMMARY_FIELDS = 5  # wall, collective seconds, sync calls, mean arrival, mean return


class UnhealthyRankError(Exception):
    """A rank stayed unhealthy and the run is set to stop (`train.on_unhealthy: stop`)."""


@dataclass(frozen=True)
class Thresholds:
    busy_factor: float
    collective_factor: float
    min_share: float
    windows: int

    @classmethod
    def of(cls, train: TrainConfig) -> Thresholds:
        return cls(
            train.straggler_factor, train.slow_collective_factor, train.unhealthy_min_share, train.straggler_windows
        )


@dataclass(frozen=True)
class RankRow:
    """One rank's window as every rank sees it after the gather."""

    wall: float
    collective: float
    calls: float
    arrival: float
    returned: float

    @property
    def busy(self) -> float:
        return max(0.0, self.wall - self.collective)


@dataclass(frozen=True)
class Finding:
    """A rank unhealthy in this window: its figure against its peers' median."""

    kind: Kind
    rank: int
    value: float
    peer_median: float

    @property
    def ratio(self) -> float:
        """value / peer median; a median under 0.1 ms (timing noise) counts as 0.1 ms, so the ratio stays finite."""
        return self.value / max(self.peer_median, 1e-4)


def _peer_median(values: list[float], rank: int) -> float:
    return statistics.median(v for r, v in enumerate(values) if r != rank)


def return_lags(rows: list[RankRow]) -> list[float]:
    """Per rank: seconds from the latest mean arrival of any rank to this rank's mean return (>= 0)."""
    latest = max(row.arrival for row in rows)
    return [max(0.0, row.returned - latest) for row in rows]


def judge(rows: list[RankRow], thresholds: Thresholds) -> list[Finding]:
    """The ranks unhealthy in one window (pure: every rank computes the same answer from the same rows)."""
    if len(rows) < 2:
        return []
    wall = statistics.median(row.wall for row in rows)
    floor = thresholds.min_share * wall
    findings: list[Finding] = []
    busy = [row.busy for row in rows]
    for rank, seconds in enumerate(busy):
        median = _peer_median(busy, rank)
        if seconds > thresholds.busy_factor * median and seconds - median >= floor:
            findings.append(Finding("straggler", rank, seconds, median))
    calls = {row.calls for row in rows}
    if len(calls) == 1 and rows[0].calls > 0:  # the same collectives on every rank: their returns compare
        lags = return_lags(rows)
        for rank, lag in enumerate(lags):
            median = _peer_median(lags, rank)
            if lag > thresholds.collective_factor * median and (lag - median) * rows[rank].calls >= floor:
                findings.append(Finding("slow collectives", rank, lag, median))
    return findings


def node_rank() -> int | None:
    """This process's node number as its launcher set it (torchrun: GROUP_RANK, DeepSpeed: CROSS_RANK)."""
    for name in ("GROUP_RANK", "CROSS_RANK"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return None


def describe(finding: Finding, node: str, windows: int, step: int, calls: float) -> str:
    """The one line that names an unhealthy rank, with its evidence."""
    where = f"rank {finding.rank} on node {node}"
    evidence = f"{finding.value:.4f}s against the peer median {finding.peer_median:.4f}s ({finding.ratio:.1f}x)"
    if finding.kind == "straggler":
        return (
            f"straggler: {where} arrives late at the collectives: busy (outside collectives) {evidence} per "
            f"logging window, {windows} windows in a row up to step {step}"
        )
    return (
        f"slow collectives: {where} is slow once every rank arrived: its collectives return {evidence} after "
        f"the last rank arrived (mean of {calls:.0f} calls per window), {windows} windows in a row up to step "
        f"{step}; suspect its link or node"
    )


class HealthMonitor:
    """Judges every logging window; warns or stops on a rank unhealthy for enough windows in a row."""

    def __init__(
        self,
        clock: CollectiveClock,
        thresholds: Thresholds,
        action: Literal["warn", "stop"],
        run_dir: Path,
        nodes: list[tuple[str, int | None]],
    ):
        self.clock, self.thresholds, self.action, self.run_dir, self.nodes = clock, thresholds, action, run_dir, nodes
        self.rank = mdist.get_rank()
        self._streaks: dict[tuple[Kind, int], int] = {}
        self._pending: list[tuple[Finding, int, float]] = []  # named this window: (finding, windows, calls)
        self.named: dict[Kind, dict[int, float]] = {"straggler": {}, "slow collectives": {}}  # rank -> worst ratio
        self._skip_window = False
        self.judged = False  # whether the last window was judged (one with evaluation or a checkpoint is not)

    @classmethod
    def start(cls, train: TrainConfig, run_dir: Path, cuda: bool) -> HealthMonitor | None:
        """Install the collective clock and learn every rank's node (one gather, at start). None, and nothing
        installed, unless `train.rank_health` or `train.adaptive_batch` asks for it on several ranks."""
        if not (train.rank_health or train.adaptive_batch) or mdist.get_world_size() < 2:
            return None
        clock = collective_timing.install(cuda)
        nodes = mdist.all_gather_objects((socket.gethostname(), node_rank()))
        clock.mark_reference()  # that gather returned on every rank together
        pairs = [cast(tuple[str, "int | None"], node) for node in nodes]
        return cls(clock, Thresholds.of(train), train.on_unhealthy, run_dir, pairs)

    def reached(self, point: str, step: int) -> None:
        """A step hook: a window with an evaluation or a checkpoint is not judged."""
        if point in ("eval", "checkpoint"):
            self._skip_window = True

    def window(self, step: int) -> dict[str, Any]:
        """Gather every rank's window (a collective), judge it; returns the per-rank fields for the metrics."""
        mine = self.clock.take()
        gathered = mdist.all_gather_floats(_row(mine))
        self.clock.mark_reference()
        rows = [RankRow(*values[:_SUMMARY_FIELDS]) for values in gathered]
        skip, self._skip_window = self._skip_window, False
        self.judged = not skip
        if not skip:
            self._update(judge(rows, self.thresholds), step, rows)
        return _record(rows, gathered)

    def _update(self, findings: list[Finding], step: int, rows: list[RankRow]) -> None:
        seen = {(f.kind, f.rank) for f in findings}
        for key in list(self._streaks):
            if key not in seen:
                del self._streaks[key]
        for finding in findings:
            key = (finding.kind, finding.rank)
            self._streaks[key] = self._streaks.get(key, 0) + 1
            if self._streaks[key] >= self.thresholds.windows:
                worst = self.named[finding.kind]
                if finding.rank not in worst:
                    self._pending.append((finding, self._streaks[key], rows[finding.rank].calls))
                worst[finding.rank] = max(finding.ratio, worst.get(finding.rank, 0.0))

    @property
    def stops(self) -> bool:
        """`act` will stop the run: a rank was named this window and `train.on_unhealthy` is `stop`."""
        return self.action == "stop" and bool(self._pending)

    def act(self, step: int) -> None:
        """Say the ranks named this window (rank 0), write unhealthy.json, and stop if the run is set to."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        lines = [describe(f, self.nodes[f.rank][0], windows, step, calls) for f, windows, calls in pending]
        if self.rank == 0:
            for line in lines:
                log.warning("%s", line)
            self._write(pending, lines, step)
        if self.action == "stop":
            raise UnhealthyRankError(
                "; ".join(lines) + f". Stopping (train.on_unhealthy=stop); {UNHEALTHY_FILE} names the node"
            )

    def _write(self, pending: list[tuple[Finding, int, float]], lines: list[str], step: int) -> None:
        ranks = []
        for (finding, windows, _), line in zip(pending, lines):
            node, number = self.nodes[finding.rank]
            ranks.append(
                {**asdict(finding), "ratio": finding.ratio, "node": node, "node_rank": number, "windows": windows}
                | {"line": line}
            )
        report = {"step": step, "action": self.action, "nodes": sorted({r["node"] for r in ranks}), "ranks": ranks}
        atomic_write(self.run_dir / UNHEALTHY_FILE, json.dumps(report, indent=1) + "\n")

    def summary(self) -> dict[str, dict[str, float]]:
        """The ranks named over the run, with their worst ratio, for summary.json."""
        return {
            "stragglers": {str(r): round(v, 2) for r, v in sorted(self.named["straggler"].items())},
            "slow_collectives": {str(r): round(v, 2) for r, v in sorted(self.named["slow collectives"].items())},
        }


def _row(window: Window) -> list[float]:
    """The floats one rank hands in: the summary, then (seconds, calls, MiB) per collective kind."""
    row = [window.wall, window.collective_seconds, float(window.sync_calls), window.mean_arrival, window.mean_return]
    for kind in KINDS:
        totals = window.kind_totals(kind)
        row += [totals.seconds, float(totals.calls), totals.bytes / 2**20]
    return row


def _record(rows: list[RankRow], gathered: list[list[float]]) -> dict[str, Any]:
    """Per-rank lists for metrics.jsonl: busy and collective time, return lags, and each kind that ran."""
    record: dict[str, Any] = {
        "busy_time_per_rank": [round(row.busy, 5) for row in rows],
        "collective_time_per_rank": [round(row.collective, 5) for row in rows],
        "collective_return_lag_per_rank": [round(lag, 5) for lag in return_lags(rows)],
    }
    for index, kind in enumerate(KINDS):
        at = _SUMMARY_FIELDS + 3 * index
        if any(values[at + 1] for values in gathered):
            record[f"collectives/{kind}/seconds_per_rank"] = [round(values[at], 5) for values in gathered]
            record[f"collectives/{kind}/calls_per_rank"] = [int(values[at + 1]) for values in gathered]
            record[f"collectives/{kind}/mib_per_rank"] = [round(values[at + 2], 3) for values in gathered]
    return record
